"""GRPO and REINFORCE++ advantages against closed forms and plain loops."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_algos.advantages import (
    broadcast_to_tokens,
    compute_grpo_advantages,
    compute_reinforce_plus_plus_advantages,
    group_index,
)


def closed_form_grpo(
    rewards: list[float], groups: list[int], leave_one_out: bool, normalize_std: bool, eps: float
) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        n = len(members)
        if n < 2 or len(set(members)) == 1:
            out.append(0.0)
            continue
        baseline = (sum(members) - r) / (n - 1) if leave_one_out else sum(members) / n
        advantage = r - baseline
        if normalize_std:
            advantage /= statistics.stdev(members) + eps
        out.append(advantage)
    return out


REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 3.0, -1.0, 2.0, 0.25]


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("normalize_std", [False, True])
def test_grpo_matches_closed_form(leave_one_out: bool, normalize_std: bool) -> None:
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    got = compute_grpo_advantages(
        rewards,
        num_generations_per_prompt=4,
        leave_one_out=leave_one_out,
        normalize_std=normalize_std,
        eps=1e-6,
    )
    expected = closed_form_grpo(REWARDS, [i // 4 for i in range(12)], leave_one_out, normalize_std, 1e-6)
    assert got.tolist() == pytest.approx(expected, abs=1e-12)
    # Hand-checked values of group 0 ([1, 0, 0, 1]: mean 0.5, sample std 1/sqrt(3)).
    if normalize_std and not leave_one_out:
        assert float(got[0]) == pytest.approx(0.5 / (1 / math.sqrt(3) + 1e-6))
    if leave_one_out and not normalize_std:
        assert float(got[0]) == pytest.approx(1.0 - 1.0 / 3.0)


def test_zero_variance_and_singleton_groups_give_exactly_zero() -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point: a mean-subtraction alone would leave residue.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 5.0], dtype=torch.float32)
    group_ids = torch.tensor([3, 3, 3, 8, 8, 8, 1])
    for leave_one_out in (False, True):
        for normalize_std in (False, True):
            got = compute_grpo_advantages(
                rewards, group_ids=group_ids, leave_one_out=leave_one_out, normalize_std=normalize_std
            )
            assert torch.equal(got, torch.zeros(7)), (leave_one_out, normalize_std, got)
            assert not torch.isnan(got).any()


def test_group_ids_may_be_arbitrary_labels_in_any_order() -> None:
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    contiguous = compute_grpo_advantages(rewards, num_generations_per_prompt=4, leave_one_out=True)
    permutation = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([70, -2, 5])[torch.arange(12) // 4]
    shuffled = compute_grpo_advantages(
        rewards[permutation], group_ids=labels[permutation], leave_one_out=True
    )
    assert torch.allclose(shuffled, contiguous[permutation], atol=1e-12, rtol=0)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(min_value=-3, max_value=3), min_size=2, max_size=6),
    st.floats(min_value=-100, max_value=100),
    st.booleans(),
)
def test_grpo_is_shift_invariant_and_centred(rewards: list[int], shift: float, leave_one_out: bool) -> None:
    base = torch.tensor(rewards, dtype=torch.float64)
    plain = compute_grpo_advantages(
        base, num_generations_per_prompt=len(rewards), leave_one_out=leave_one_out
    )
    shifted = compute_grpo_advantages(
        base + shift, num_generations_per_prompt=len(rewards), leave_one_out=leave_one_out
    )
    assert torch.allclose(plain, shifted, atol=1e-9)
    assert abs(float(plain.sum())) < 1e-9  # both baselines give advantages summing to zero


def test_grpo_input_errors() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        compute_grpo_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match="divide the batch size 5"):
        compute_grpo_advantages(torch.zeros(5), num_generations_per_prompt=2)
    with pytest.raises(ValueError, match="reward of sample 2 is nan"):
        compute_grpo_advantages(torch.tensor([0.0, 1.0, math.nan, 1.0]), num_generations_per_prompt=2)
    with pytest.raises(ValueError, match=r"group_ids has shape \(3,\)"):
        group_index(4, group_ids=torch.zeros(3))


def test_broadcast_to_tokens() -> None:
    token_mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])
    got = broadcast_to_tokens(torch.tensor([2.0, -1.0]), token_mask)
    assert got.tolist() == [[0.0, 2.0, 2.0, 0.0], [0.0, 0.0, -1.0, -1.0]]


def reference_reinforce_pp(
    rewards: list[float],
    token_mask: torch.Tensor,
    sample_mask: list[float],
    logprobs: torch.Tensor,
    reference: torch.Tensor,
    kl_coef: float,
    gamma: float,
    groups: list[int] | None,
    eps: float,
) -> torch.Tensor:
    if groups is not None:
        rewards = [
            r - statistics.mean(rewards[j] for j in range(len(rewards)) if groups[j] == groups[i])
            for i, r in enumerate(rewards)
        ]
    batch_size, seq_len = token_mask.shape
    returns = torch.zeros(batch_size, seq_len, dtype=torch.float64)
    valid: list[tuple[int, int]] = []
    for b in range(batch_size):
        positions = [t for t in range(1, seq_len) if token_mask[b, t] and sample_mask[b]]
        token_rewards = {t: -kl_coef * (float(logprobs[b, t]) - float(reference[b, t])) for t in positions}
        if positions:
            token_rewards[positions[-1]] += rewards[b]
        running = 0.0
        for t in reversed(positions):
            running = token_rewards[t] + gamma * running
            returns[b, t] = running
        valid += [(b, t) for t in positions]
    values = [float(returns[b, t]) for b, t in valid]
    mean, std = statistics.fmean(values), statistics.pstdev(values)
    out = torch.zeros(batch_size, seq_len, dtype=torch.float64)
    for b, t in valid:
        out[b, t] = (returns[b, t] - mean) / (std + eps)
    return out


@pytest.mark.parametrize(
    ("kl_coef", "gamma", "grouped"),
    [(0.0, 1.0, False), (0.1, 1.0, False), (0.05, 0.9, True), (0.0, 0.8, True)],
)
def test_reinforce_plus_plus_matches_reference(kl_coef: float, gamma: float, grouped: bool) -> None:
    g = torch.Generator().manual_seed(1)
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    token_mask = (torch.rand(6, 7, generator=g) > 0.3).long()
    token_mask[:, 0] = 1  # position 0 never counts
    sample_mask = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    logprobs = -torch.rand(6, 7, generator=g, dtype=torch.float64)
    reference = -torch.rand(6, 7, generator=g, dtype=torch.float64)
    got = compute_reinforce_plus_plus_advantages(
        torch.tensor(rewards, dtype=torch.float64),
        token_mask,
        sample_mask=torch.tensor(sample_mask),
        logprobs=logprobs,
        reference_logprobs=reference,
        kl_coef=kl_coef,
        gamma=gamma,
        num_generations_per_prompt=2 if grouped else None,
    )
    groups = [i // 2 for i in range(6)] if grouped else None
    expected = reference_reinforce_pp(
        rewards, token_mask, sample_mask, logprobs, reference, kl_coef, gamma, groups, 1e-8
    )
    assert torch.allclose(got, expected, atol=1e-10, rtol=0)
    assert got.abs().sum() > 0


def test_reinforce_plus_plus_constant_returns_give_zero() -> None:
    token_mask = torch.tensor([[0, 1, 0], [0, 0, 1]])
    got = compute_reinforce_plus_plus_advantages(torch.tensor([0.3, 0.3]), token_mask)
    assert torch.equal(got, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="needs logprobs and reference_logprobs"):
        compute_reinforce_plus_plus_advantages(torch.tensor([0.3, 0.3]), token_mask, kl_coef=0.1)
