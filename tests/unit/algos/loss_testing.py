"""Helpers shared by the loss tests: random padded batches, reference log-probs, and the
micro-batch additivity check (the global-normalisation rule of DESIGN.md §3)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

TOL = 1e-9  # float64 throughout; the contract asks for < 1e-6


def random_batch(
    batch_size: int = 6, seq_len: int = 9, vocab: int = 11, seed: int = 0, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and an RL training batch with prompts, right padding, masked holes (as from
    multi-turn observations), one filtered sample, and NaN in every unused logprob position."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(batch_size, seq_len, vocab, generator=g, dtype=dtype)
    input_ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    lengths = torch.randint(3, seq_len + 1, (batch_size,), generator=g)
    prompt_lengths = torch.randint(1, 3, (batch_size,), generator=g)
    positions = torch.arange(seq_len)
    token_mask = (positions >= prompt_lengths[:, None]) & (positions < lengths[:, None])
    token_mask &= torch.rand(batch_size, seq_len, generator=g) > 0.15
    token_mask = token_mask.to(dtype)
    sample_mask = torch.ones(batch_size, dtype=dtype)
    sample_mask[1 % batch_size] = 0.0

    def noisy(scale: float) -> torch.Tensor:
        values = -torch.rand(batch_size, seq_len, generator=g, dtype=dtype) * 3.0
        return values + scale * torch.randn(batch_size, seq_len, generator=g, dtype=dtype)

    data = {
        "input_ids": input_ids,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "prev_logprobs": noisy(0.0),
        "generation_logprobs": noisy(0.3),
        "reference_policy_logprobs": noisy(0.3),
        "advantages": torch.randn(batch_size, seq_len, generator=g, dtype=dtype),
    }
    for key in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs", "advantages"):
        data[key] = with_garbage(data[key], data)
    # Position 0 predicts nothing: a mask bit there must be ignored (its values are NaN).
    token_mask[0, 0] = 1.0
    return logits, data


def with_garbage(values: torch.Tensor, data: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """NaN wherever a token does not count (prompt, padding, filtered sample, position 0):
    a loss that lets masked values leak into its result or its gradient fails loudly."""
    valid = data["token_mask"] * data["sample_mask"][:, None]
    valid[:, 0] = 0.0
    return torch.where(valid > 0, values, torch.full_like(values, math.nan))


def make_near_policy(logits: torch.Tensor, data: dict[str, torch.Tensor], scale: float, seed: int) -> None:
    """Set prev/generation/reference logprobs to the logits' own logprobs plus noise of `scale`,
    so that ratios land on both sides of the clip range."""
    g = torch.Generator().manual_seed(seed)
    current = reference_logprobs(logits, data["input_ids"]).detach()
    for key in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs"):
        noise = scale * torch.randn(current.shape, generator=g, dtype=current.dtype)
        data[key] = with_garbage(current + noise, data)


def reference_logprob(logits: torch.Tensor, input_ids: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """log softmax(logits[b, t-1])[input_ids[b, t]], one token at a time."""
    row = logits[b, t - 1].to(torch.float64)
    return row[int(input_ids[b, t])] - torch.logsumexp(row, dim=0)


def reference_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    batch_size, seq_len = input_ids.shape
    out = torch.zeros(batch_size, seq_len, dtype=torch.float64)
    for b in range(batch_size):
        for t in range(1, seq_len):
            out[b, t] = reference_logprob(logits, input_ids, b, t)
    return out


def valid_positions(data: Mapping[str, torch.Tensor], b: int) -> list[int]:
    """Token positions of sample b that count (t >= 1, trained, sample kept)."""
    if float(data["sample_mask"][b]) == 0.0:
        return []
    mask = data["token_mask"][b]
    return [t for t in range(1, mask.shape[0]) if float(mask[t]) != 0.0]


def global_counts(data: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(global_valid_seqs, global_valid_toks) exactly as DESIGN.md §3 defines them."""
    sample_mask = data["sample_mask"]
    tokens = (data["token_mask"][:, 1:] * sample_mask[:, None]).sum()
    return sample_mask.sum(), tokens


def slice_batch(data: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
    return {key: value[start:stop] for key, value in data.items()}


LossFn = Callable[..., tuple[torch.Tensor, dict[str, Any]]]


def assert_microbatch_additivity(
    loss_fn: LossFn,
    logits: torch.Tensor,
    data: Mapping[str, torch.Tensor],
    boundaries: Sequence[int],
    counts: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Summing the losses (and every metric) of micro-batches, each called with the global
    counts, equals the full-batch call, and so do the gradients w.r.t. the logits."""
    gvs, gvt = counts if counts is not None else global_counts(data)
    full_logits = logits.detach().clone().requires_grad_(True)
    full_loss, full_metrics = loss_fn(full_logits, data, gvs, gvt)
    full_loss.backward()

    split_logits = logits.detach().clone().requires_grad_(True)
    edges = [0, *boundaries, logits.shape[0]]
    total = torch.zeros((), dtype=torch.float64)
    summed: dict[str, float] = {}
    for start, stop in itertools.pairwise(edges):
        loss, metrics = loss_fn(split_logits[start:stop], slice_batch(data, start, stop), gvs, gvt)
        total = total + loss
        for key, value in metrics.items():
            summed[key] = summed.get(key, 0.0) + float(value)
    total.backward()

    assert torch.allclose(total, full_loss, atol=TOL, rtol=0), (float(total), float(full_loss))
    assert full_logits.grad is not None and split_logits.grad is not None
    assert torch.allclose(split_logits.grad, full_logits.grad, atol=TOL, rtol=0)
    assert set(summed) == set(full_metrics)
    for key, value in full_metrics.items():
        assert math.isclose(summed[key], float(value), abs_tol=1e-9), (key, summed[key], value)


def assert_close_with_grad(
    implementation: Callable[[torch.Tensor], torch.Tensor],
    reference: Callable[[torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    tol: float = TOL,
) -> None:
    """Same value and same gradient w.r.t. the logits."""
    a = logits.detach().clone().requires_grad_(True)
    b = logits.detach().clone().requires_grad_(True)
    value_a = implementation(a)
    value_b = reference(b)
    assert torch.allclose(value_a, value_b.to(value_a.dtype), atol=tol, rtol=0), (
        float(value_a),
        float(value_b),
    )
    value_a.backward()
    value_b.backward()
    assert a.grad is not None and b.grad is not None
    assert torch.allclose(a.grad, b.grad, atol=tol, rtol=0), (a.grad - b.grad).abs().max()
    assert a.grad.abs().sum() > 0  # the comparison is not vacuous
