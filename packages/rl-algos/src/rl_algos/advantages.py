"""Advantage estimators without a critic: GRPO group baselines and REINFORCE++.

Both run on the driver over the whole step's batch, so "global" statistics here are over the
complete batch. Samples of one prompt form a group, named either by `group_ids` (any integer
labels, [B]) or by `num_generations_per_prompt` (consecutive blocks of that size).
"""

from __future__ import annotations

import torch

from rl_algos.losses.common import compute_dtype
from rl_algos.losses.kl import KLType, kl_estimate


def group_index(
    batch_size: int,
    group_ids: torch.Tensor | None = None,
    num_generations_per_prompt: int | None = None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, int]:
    """([B] group number in 0..G-1, G) from exactly one of `group_ids` / `num_generations_per_prompt`."""
    if (group_ids is None) == (num_generations_per_prompt is None):
        raise ValueError("give exactly one of group_ids and num_generations_per_prompt")
    if group_ids is not None:
        if group_ids.shape != (batch_size,):
            raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, expected [B] = ({batch_size},)")
        unique, inverse = torch.unique(group_ids.to(device), return_inverse=True)
        return inverse, int(unique.numel())
    assert num_generations_per_prompt is not None
    if num_generations_per_prompt < 1 or batch_size % num_generations_per_prompt:
        raise ValueError(
            f"num_generations_per_prompt={num_generations_per_prompt} must be >= 1 and divide the batch size {batch_size}"
        )
    num_groups = batch_size // num_generations_per_prompt
    index = torch.arange(num_groups, device=device).repeat_interleave(num_generations_per_prompt)
    return index, num_groups


def _check_rewards(rewards: torch.Tensor) -> torch.Tensor:
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [B] (one scalar per sample), got shape {tuple(rewards.shape)}")
    values = rewards.to(compute_dtype(rewards.dtype))
    bad = ~torch.isfinite(values)
    if bad.any():
        first = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"reward of sample {first} is {values[first].item()}; rewards must be finite")
    return values


def _group_sum(values: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def _group_is_constant(values: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[B]: whether each sample's group has a single distinct value (compared exactly, no tolerance)."""
    empty = torch.full((num_groups,), float("nan"), dtype=values.dtype, device=values.device)
    high = empty.scatter_reduce(0, index, values, "amax", include_self=False)
    low = empty.scatter_reduce(0, index, values, "amin", include_self=False)
    return (high == low)[index]


def compute_grpo_advantages(
    rewards: torch.Tensor,
    *,
    group_ids: torch.Tensor | None = None,
    num_generations_per_prompt: int | None = None,
    leave_one_out: bool = False,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """[B] GRPO advantages: reward minus the group baseline, optionally divided by the group std.

    The baseline of sample i in group g (size n) is the group mean, or with `leave_one_out`
    the mean of the other n - 1 rewards (RLOO). With `normalize_std` the difference is divided
    by (std_g + eps), std_g the unbiased (n - 1) standard deviation of the group's rewards.
    A group whose rewards are all equal, or that has a single sample, gets advantage exactly 0.
    """
    values = _check_rewards(rewards)
    index, num_groups = group_index(values.shape[0], group_ids, num_generations_per_prompt, values.device)
    counts = _group_sum(torch.ones_like(values), index, num_groups)
    totals = _group_sum(values, index, num_groups)
    means = totals / counts.clamp(min=1.0)
    size = counts[index]
    if leave_one_out:
        baseline = (totals[index] - values) / (size - 1).clamp(min=1.0)
    else:
        baseline = means[index]
    advantages = values - baseline
    if normalize_std:
        squares = _group_sum((values - means[index]).square(), index, num_groups)
        std = torch.sqrt(squares / (counts - 1).clamp(min=1.0))
        advantages = advantages / (std[index] + eps)
    no_signal = _group_is_constant(values, index, num_groups) | (size < 2)
    return torch.where(no_signal, torch.zeros_like(advantages), advantages)


def broadcast_to_tokens(advantages: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """[B] sequence advantages -> [B, T], the advantage on each trained token and 0 elsewhere."""
    if advantages.ndim != 1 or token_mask.ndim != 2 or token_mask.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"expected advantages [B] and token_mask [B, T], got {tuple(advantages.shape)} and {tuple(token_mask.shape)}"
        )
    return advantages.unsqueeze(-1) * (token_mask != 0).to(advantages.dtype)


def _returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted return-to-go over each sequence's valid tokens (untrained tokens are skipped)."""
    if gamma == 1.0:
        return torch.flip(torch.cumsum(torch.flip(token_rewards, [-1]), -1), [-1]) * mask
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        step = mask[:, t] > 0
        running = torch.where(step, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(step, running, torch.zeros_like(running))
    return returns


def compute_reinforce_plus_plus_advantages(
    rewards: torch.Tensor,
    token_mask: torch.Tensor,
    *,
    sample_mask: torch.Tensor | None = None,
    logprobs: torch.Tensor | None = None,
    reference_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_type: KLType = "k1",
    gamma: float = 1.0,
    group_ids: torch.Tensor | None = None,
    num_generations_per_prompt: int | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """[B, T] REINFORCE++ advantages (Hu et al., 2025), zero outside the valid tokens.

    The outcome reward sits on each sequence's last valid token and every valid token pays the
    KL penalty: r_t = 1[t = last] * R - kl_coef * KL_t, with KL_t = log pi_old - log pi_ref
    (`kl_type` k1, the paper's choice) from `logprobs` / `reference_logprobs` ([B, T], aligned
    with `input_ids`). The advantage is the return-to-go sum_{s >= t} gamma^(s - t) r_s, counted
    over valid tokens only, whitened over all valid tokens of the batch: (A - mean) / (std + eps),
    std the population standard deviation. Giving groups (`group_ids` or
    `num_generations_per_prompt`) selects REINFORCE++-baseline: R is first reduced by its group
    mean. Valid tokens are `token_mask * sample_mask` from position 1 on, as in the losses.
    """
    values = _check_rewards(rewards)
    batch_size = values.shape[0]
    if token_mask.ndim != 2 or token_mask.shape[0] != batch_size:
        raise ValueError(
            f"token_mask must be [B, T] with B = {batch_size}, got shape {tuple(token_mask.shape)}"
        )
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    mask = (token_mask != 0).to(values.dtype)
    if sample_mask is not None:
        if sample_mask.shape != (batch_size,):
            raise ValueError(
                f"sample_mask must be [B] = ({batch_size},), got shape {tuple(sample_mask.shape)}"
            )
        mask = mask * sample_mask.to(mask).unsqueeze(-1)
    mask[:, 0] = 0.0

    if group_ids is not None or num_generations_per_prompt is not None:
        index, num_groups = group_index(batch_size, group_ids, num_generations_per_prompt, values.device)
        group_means = _group_sum(values, index, num_groups) / _group_sum(
            torch.ones_like(values), index, num_groups
        )
        values = values - group_means[index]

    positions = torch.arange(mask.shape[1], device=mask.device, dtype=mask.dtype)
    last = (mask * (positions + 1)).argmax(dim=-1, keepdim=True)
    token_rewards = torch.zeros_like(mask).scatter(-1, last, values.unsqueeze(-1)) * mask
    if kl_coef != 0.0:
        if logprobs is None or reference_logprobs is None:
            raise ValueError("kl_coef != 0 needs logprobs and reference_logprobs")
        for name, tensor in (("logprobs", logprobs), ("reference_logprobs", reference_logprobs)):
            if tensor.shape != mask.shape:
                raise ValueError(
                    f"{name} has shape {tuple(tensor.shape)}, expected [B, T] = {tuple(mask.shape)}"
                )
        kl = kl_estimate(logprobs.to(mask), reference_logprobs.to(mask), kl_type)
        token_rewards = token_rewards - kl_coef * torch.where(mask > 0, kl, torch.zeros_like(kl))

    advantages = _returns(token_rewards, mask, gamma)
    valid = mask > 0
    if not valid.any():
        return torch.zeros_like(advantages)
    selected = advantages[valid]
    if bool(selected.max() == selected.min()):
        return torch.zeros_like(advantages)
    mean = selected.mean()
    std = selected.std(unbiased=False)
    return torch.where(valid, (advantages - mean) / (std + eps), torch.zeros_like(advantages))
