"""Reward transforms applied between the environments and the advantage estimator.

- Scaling: a linear map of `[source_min, source_max]` onto `[target_min, target_max]`,
  rewards outside the source range clamped to it first.
- DAPO overlong shaping (Yu et al., 2025, "soft overlong punishment"): with maximum response
  length L_max and buffer L_buf, a response of length L gets
      0                                   if L <= L_max - L_buf
      ((L_max - L_buf) - L) / L_buf * p   if L_max - L_buf < L <= L_max
      -p                                  if L > L_max
  added to its reward, so responses that run into the length limit are discouraged smoothly.
"""

from __future__ import annotations

from typing import Self

import torch
from pydantic import Field, model_validator

from rl_core.config import RLConfig


class RewardScalingConfig(RLConfig):
    enabled: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.source_max <= self.source_min:
            raise ValueError(
                f"source_max ({self.source_max}) must be greater than source_min ({self.source_min})"
            )
        return self


class RewardShapingConfig(RLConfig):
    """DAPO's soft overlong punishment (see the module docstring)."""

    enabled: bool = False
    overlong_buffer_length: int = Field(default=128, ge=1)
    overlong_buffer_penalty: float = Field(default=1.0, ge=0.0)
    # L_max; None: the policy's `generation.max_new_tokens`.
    max_response_length: int | None = Field(default=None, ge=1)


def scale_rewards(rewards: torch.Tensor, cfg: RewardScalingConfig) -> torch.Tensor:
    """Rewards clamped to the source range and mapped linearly onto the target range."""
    if not cfg.enabled:
        return rewards
    clamped = rewards.clamp(cfg.source_min, cfg.source_max)
    fraction = (clamped - cfg.source_min) / (cfg.source_max - cfg.source_min)
    return cfg.target_min + fraction * (cfg.target_max - cfg.target_min)


def overlong_penalty(
    response_lengths: torch.Tensor, max_response_length: int, buffer_length: int, penalty: float
) -> torch.Tensor:
    """[B] the (non-positive) DAPO soft overlong punishment of each response length."""
    if buffer_length > max_response_length:
        raise ValueError(
            f"overlong_buffer_length ({buffer_length}) exceeds the maximum response length ({max_response_length})"
        )
    lengths = response_lengths.to(torch.float32)
    start = max_response_length - buffer_length
    ramp = (start - lengths) / buffer_length * penalty
    return torch.where(
        lengths <= start,
        torch.zeros_like(lengths),
        torch.where(lengths <= max_response_length, ramp, torch.full_like(lengths, -penalty)),
    )


def shape_rewards(
    rewards: torch.Tensor, response_lengths: torch.Tensor, cfg: RewardShapingConfig, default_max_length: int
) -> torch.Tensor:
    """Rewards plus the overlong punishment, when enabled."""
    if not cfg.enabled:
        return rewards
    max_length = cfg.max_response_length or default_max_length
    return rewards + overlong_penalty(
        response_lengths, max_length, cfg.overlong_buffer_length, cfg.overlong_buffer_penalty
    ).to(rewards.dtype)
