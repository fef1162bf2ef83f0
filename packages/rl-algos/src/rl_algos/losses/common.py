"""Shared machinery of every loss: token log-probs from logits, masks, global normalisation.

Conventions (DESIGN.md §3):

- `logits[:, t]` predicts token `t + 1`; every log-prob tensor in a training batch is aligned
  with `input_ids` instead (the log-prob of token t sits at position t, position 0 is unused).
  `token_logprobs` converts the former into the latter.
- A token is *valid* when `token_mask[:, t] * sample_mask` is 1 and t >= 1, so the valid-token
  mask sums to the `global_valid_toks` the backend all-reduces.
- Each micro-batch returns `sum over its tokens (or sequences) / global count`; summing the
  results of all micro-batches gives the loss of the whole batch. Every metric a loss returns
  follows the same rule (a *contribution*): summing it over micro-batches and ranks gives the
  global value, e.g. a mean over all valid tokens of the global batch.
- Losses compute in at least float32: bf16/fp16 logits are upcast, float64 stays float64.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rl_core.interfaces import LossType

# Re-exported from rl-core: losses and backends share one log-prob code path.
from rl_core.ops import compute_dtype as compute_dtype
from rl_core.ops import token_logprobs as token_logprobs


class LossInputError(ValueError):
    """A batch handed to a loss lacks a field or has one of the wrong shape or type."""


def as_normaliser(count: torch.Tensor | float | int, like: torch.Tensor) -> torch.Tensor:
    """A global count as a scalar tensor on `like`'s device; 0 becomes 1.

    A zero count means the whole global batch has nothing valid, in which case every numerator
    is 0 as well: dividing by 1 returns the correct 0 instead of NaN.
    """
    value = torch.as_tensor(count, dtype=like.dtype, device=like.device).detach()
    if value.numel() != 1:
        raise LossInputError(f"a global count must be a scalar, got a tensor of shape {tuple(value.shape)}")
    return value.reshape(()).clamp(min=1.0)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is set; masked-out entries never leak (even inf or NaN)."""
    kept = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B]: mean of each sequence over its masked tokens (0 for a sequence without any)."""
    counts = mask.to(values.dtype).sum(dim=-1).clamp(min=1.0)
    return masked_sum(values, mask, dim=-1) / counts


def global_token_mean(
    values: torch.Tensor, mask: torch.Tensor, global_valid_toks: torch.Tensor
) -> torch.Tensor:
    """This micro-batch's contribution to the mean of `values` over all valid tokens."""
    return masked_sum(values, mask) / global_valid_toks


def global_sequence_mean(
    per_sequence: torch.Tensor, sample_mask: torch.Tensor, global_valid_seqs: torch.Tensor
) -> torch.Tensor:
    """This micro-batch's contribution to the mean of a [B] quantity over all valid sequences."""
    return masked_sum(per_sequence, sample_mask) / global_valid_seqs


def reduce_per_token(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    sample_mask: torch.Tensor,
    loss_type: LossType,
    global_valid_seqs: torch.Tensor,
    global_valid_toks: torch.Tensor,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to this micro-batch's share of the global loss.

    TOKEN_LEVEL: sum over valid tokens / global valid tokens (every token weighs the same).
    SEQUENCE_LEVEL: each sequence's mean over its valid tokens, summed over valid sequences,
    / global valid sequences (every sequence weighs the same, whatever its length).
    """
    if loss_type is LossType.TOKEN_LEVEL:
        return global_token_mean(per_token, mask, global_valid_toks)
    return global_sequence_mean(sequence_mean(per_token, mask), sample_mask, global_valid_seqs)


def to_floats(metrics: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Metrics as plain Python floats, read from the device in one transfer (one sync, not one per key)."""
    keys = [key for key, value in metrics.items() if isinstance(value, torch.Tensor)]
    out = {key: float(value) for key, value in metrics.items() if not isinstance(value, torch.Tensor)}
    if keys:
        stacked = torch.stack([torch.as_tensor(metrics[key]).detach().reshape(()).double() for key in keys])
        out.update(zip(keys, stacked.tolist(), strict=True))
    return {key: out[key] for key in metrics}


class LossBatch:
    """Typed, validated access to the fields of one micro-batch on behalf of a named loss.

    Every field is checked for presence and shape against `input_ids` (or the logits' batch
    size), moved to the logits' device and, for float fields, cast to the loss's compute dtype;
    a problem raises `LossInputError` naming the loss, the key and the expected shape.
    """

    def __init__(self, loss_name: str, data: Mapping[str, Any], logits: torch.Tensor) -> None:
        if not isinstance(data, Mapping):
            raise LossInputError(f"{loss_name}: data must be a mapping of tensors, got {type(data).__name__}")
        if not isinstance(logits, torch.Tensor):
            raise LossInputError(f"{loss_name}: logits must be a tensor, got {type(logits).__name__}")
        self.loss_name = loss_name
        self.data = data
        self.device = logits.device
        self.dtype = compute_dtype(logits.dtype)
        self.batch_size = int(logits.shape[0]) if logits.ndim else 0
        self._input_ids: torch.Tensor | None = None

    def token_logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probs of `input_ids` under `logits`; bad inputs are reported as this loss's."""
        try:
            return token_logprobs(logits, self.input_ids)
        except ValueError as err:
            raise LossInputError(f"{self.loss_name}: {err}") from err

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str, expected: str) -> torch.Tensor:
        value = self.data.get(key)
        if value is None:
            present = ", ".join(sorted(str(k) for k in self.data)) or "nothing"
            raise LossInputError(
                f"{self.loss_name}: the batch has no '{key}' (expected {expected}); it has: {present}"
            )
        if not isinstance(value, torch.Tensor):
            raise LossInputError(
                f"{self.loss_name}: data['{key}'] must be a tensor ({expected}), got {type(value).__name__}"
            )
        return value

    def _check_shape(self, key: str, value: torch.Tensor, shape: Sequence[int], expected: str) -> None:
        if tuple(value.shape) != tuple(shape):
            raise LossInputError(
                f"{self.loss_name}: data['{key}'] has shape {tuple(value.shape)}, expected {expected} = {tuple(shape)}"
            )

    @property
    def input_ids(self) -> torch.Tensor:
        if self._input_ids is None:
            self._input_ids = self._load_input_ids()
        return self._input_ids

    def _load_input_ids(self) -> torch.Tensor:
        ids = self.raw("input_ids", "[B, T] int64 token ids")
        if ids.ndim != 2 or ids.shape[0] != self.batch_size:
            raise LossInputError(
                f"{self.loss_name}: data['input_ids'] has shape {tuple(ids.shape)}, expected [B, T] "
                f"with B = {self.batch_size} (the logits' batch size)"
            )
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise LossInputError(f"{self.loss_name}: data['input_ids'] must hold integers, got {ids.dtype}")
        return ids.to(self.device)

    def tokens(self, key: str) -> torch.Tensor:
        """A [B, T] float field aligned with `input_ids`, in the compute dtype."""
        shape = tuple(self.input_ids.shape)
        value = self.raw(key, "[B, T] aligned with input_ids")
        self._check_shape(key, value, shape, "[B, T] like input_ids")
        return value.to(device=self.device, dtype=self.dtype)

    def samples(self, key: str) -> torch.Tensor:
        """A [B] float field, in the compute dtype."""
        value = self.raw(key, "[B], one value per sample")
        self._check_shape(key, value, (self.batch_size,), "[B]")
        return value.to(device=self.device, dtype=self.dtype)

    def indexed(self, key: str, shape: Sequence[int], expected: str) -> torch.Tensor:
        """A field of a given shape, as it is (dtype kept), on the loss's device."""
        value = self.raw(key, expected)
        self._check_shape(key, value, shape, expected)
        return value.to(self.device)

    def sample_mask(self) -> torch.Tensor:
        return self.samples("sample_mask")

    def valid_token_mask(self) -> torch.Tensor:
        """[B, T]: 1 on the tokens that count (trained and in a valid sample), 0 at position 0.

        Its sum over the global batch is exactly the `global_valid_toks` of DESIGN.md §3.
        """
        mask = self.tokens("token_mask") * self.sample_mask().unsqueeze(-1)
        mask[:, 0] = 0.0
        return mask
