"""The environment contract: verifiers, sandboxes, games and tools, run as Ray actors."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch

from rl_core.interfaces.specs import MessageLog


class EnvironmentReturn(NamedTuple):
    """What one `step` returns for a batch of B conversations.

    observations: the next message for each conversation, `{"role": ..., "content": ...}`
        (role "environment", "tool" or "user"); empty content when there is nothing to add.
    metadata: per-sample state carried to the next turn (None when the episode is over).
    next_stop_strings: per-sample stop strings for the next generation turn (None: default).
    rewards: [B] float32 reward of this turn.
    terminateds: [B] bool, True when the episode is over.
    answers: per-sample extracted final answer (for logging / majority vote), or None.
    """

    observations: list[dict[str, str]]
    metadata: list[dict[str, Any] | None]
    next_stop_strings: list[list[str] | None]
    rewards: torch.Tensor
    terminateds: torch.Tensor
    answers: list[str | None]


class EnvironmentInterface(ABC):
    """Scores (and, for multi-turn tasks, answers) a batch of conversations."""

    @abstractmethod
    def step(self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        """Advance every conversation by one environment turn."""

    @abstractmethod
    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        """After a whole rollout batch: post-process it (e.g. shape rewards) and return metrics."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release pools, sandboxes and models."""
