"""GRPO batch transforms: reward scaling, DAPO overlong shaping, dynamic sampling, overlong
filtering, the training batch and the padding to whole optimizer steps."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from rl_algos.batch_filters import group_rows, informative_groups, overlong_filtered_mask
from rl_algos.grpo import build_training_batch
from rl_algos.rewards import (
    RewardScalingConfig,
    RewardShapingConfig,
    overlong_penalty,
    scale_rewards,
    shape_rewards,
)
from rl_core.data import BatchedDataDict


def reference_scale(r: float, smin: float, smax: float, tmin: float, tmax: float) -> float:
    r = min(max(r, smin), smax)
    return tmin + (r - smin) / (smax - smin) * (tmax - tmin)


def test_reward_scaling_maps_and_clamps() -> None:
    cfg = RewardScalingConfig(enabled=True, source_min=0.0, source_max=1.0, target_min=-1.0, target_max=1.0)
    rewards = torch.tensor([0.0, 0.25, 0.5, 1.0, 2.0, -3.0])
    got = scale_rewards(rewards, cfg)
    expected = [reference_scale(r, 0.0, 1.0, -1.0, 1.0) for r in rewards.tolist()]
    assert got.tolist() == pytest.approx(expected)
    assert got.tolist() == pytest.approx([-1.0, -0.5, 0.0, 1.0, 1.0, -1.0])
    # Disabled: the same tensor, untouched.
    assert scale_rewards(rewards, RewardScalingConfig()) is rewards
    with pytest.raises(ValidationError, match="source_max"):
        RewardScalingConfig(source_min=1.0, source_max=1.0)


def reference_overlong(length: int, max_len: int, buffer: int, penalty: float) -> float:
    """DAPO eq. (13), written out as in the paper."""
    if length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return ((max_len - buffer) - length) / buffer * penalty
    return -penalty


def test_overlong_penalty_matches_the_dapo_formula() -> None:
    lengths = list(range(0, 40))
    got = overlong_penalty(torch.tensor(lengths), max_response_length=32, buffer_length=8, penalty=0.5)
    expected = [reference_overlong(n, 32, 8, 0.5) for n in lengths]
    assert got.tolist() == pytest.approx(expected)
    # Spot values: no penalty up to 24 tokens, half of it at 28, all of it from 32 on.
    assert got[24].item() == 0.0 and got[28].item() == pytest.approx(-0.25) and got[33].item() == -0.5
    with pytest.raises(ValueError, match="overlong_buffer_length"):
        overlong_penalty(torch.tensor([1]), max_response_length=4, buffer_length=8, penalty=1.0)


def test_shape_rewards_uses_the_default_max_length() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0])
    lengths = torch.tensor([10, 30, 40])
    cfg = RewardShapingConfig(enabled=True, overlong_buffer_length=10, overlong_buffer_penalty=1.0)
    got = shape_rewards(rewards, lengths, cfg, default_max_length=40)
    assert got.tolist() == pytest.approx([1.0, 1.0, -1.0])
    cfg = cfg.model_copy(update={"max_response_length": 35})
    got = shape_rewards(rewards, lengths, cfg, default_max_length=40)
    assert got.tolist() == pytest.approx([1.0, 1.0 - 0.5, -1.0])
    assert shape_rewards(rewards, lengths, RewardShapingConfig(), 40) is rewards


def test_dynamic_sampling_keeps_groups_with_different_rewards() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 1.0])
    groups = informative_groups(rewards, 3)
    # Groups: [1,1,1] [0,0,0] [0,.5,.5] [.5,.5,1]
    assert groups.tolist() == [False, False, True, True]
    assert group_rows(groups, 3).tolist() == [6, 7, 8, 9, 10, 11]
    assert group_rows(torch.tensor([False, False]), 4).tolist() == []
    with pytest.raises(ValueError, match="divide"):
        informative_groups(rewards, 5)


def test_overlong_filtering_masks_truncated_samples() -> None:
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    truncated = torch.tensor([False, True, True, False])
    assert overlong_filtered_mask(mask, truncated).tolist() == [1.0, 0.0, 0.0, 1.0]


def _log(prompt: list[int], reply: list[int], logprobs: list[float]) -> list[dict]:
    return [
        {"role": "user", "content": "q", "token_ids": torch.tensor(prompt)},
        {
            "role": "assistant",
            "content": "a",
            "token_ids": torch.tensor(reply),
            "generation_logprobs": torch.tensor(logprobs),
        },
    ]


def test_training_batch_masks_prompts_and_broadcasts_advantages() -> None:
    batch = BatchedDataDict(
        message_log=[_log([5, 6, 7], [8, 9], [-0.5, -0.25]), _log([5, 6], [8, 9, 10], [-1.0, -2.0, -3.0])],
        sequence_advantages=torch.tensor([1.5, -0.5]),
    )
    train = build_training_batch(batch, torch.tensor([1.0, 0.0]), pad_token_id=0)
    assert train["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 6, 8, 9, 10]]
    assert train["input_lengths"].tolist() == [5, 5]
    assert train["token_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]
    assert train["advantages"].tolist() == [[0, 0, 0, 1.5, 1.5], [0, 0, -0.5, -0.5, -0.5]]
    assert train["generation_logprobs"].tolist() == [[0, 0, 0, -0.5, -0.25], [0, 0, -1.0, -2.0, -3.0]]
    assert train["sample_mask"].tolist() == [1.0, 0.0]
