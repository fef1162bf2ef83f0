"""The model forward on right-padded or packed micro-batches, and per-token log-probs.

Both layouts return logits in the right-padded `[B, T, V]` layout, where position t predicts
token t + 1, so losses and log-prob code never see packing. A packed micro-batch lays the
sequences end to end in one row with position ids restarting at 0 per sequence; attention is
kept inside each sequence by varlen FlashAttention (it reads the boundaries from the position
ids) or, without it, by a dense block-diagonal causal mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rl_core.data.packing import block_diagonal_attention_mask, pack_sequences, unpack_sequences


@dataclass(frozen=True)
class ForwardLayout:
    """How micro-batches are fed to the model.

    packed: lay sequences end to end in one row.
    seq_multiple: the (packed per-sequence / padded) length must be a multiple of this
        (the TP size with sequence parallel, which splits the sequence across ranks).
    varlen_attention: the model runs varlen FlashAttention (no dense mask needed).
    compute_dtype: the dtype attention runs in (the dense mask's dtype).
    """

    packed: bool = False
    seq_multiple: int = 1
    varlen_attention: bool = False
    pad_token_id: int = 0
    compute_dtype: torch.dtype = torch.float32


def padding_mask(input_lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, T] bool, True at the first `input_lengths[b]` positions of row b."""
    positions = torch.arange(seq_len, device=input_lengths.device)
    return positions[None, :] < input_lengths[:, None]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean "may attend" mask -> additive float mask (0 / dtype min), which every
    attention implementation (eager adds it, SDPA takes it as attn_mask) reads the same way."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, blocked)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# Reads the per-position output [B, T, ...] of one model call (by default its LM logits).
OutputReader = Callable[[Any], torch.Tensor]


def _lm_logits(output: Any) -> torch.Tensor:
    logits: torch.Tensor = output.logits
    return logits


def _padded_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    multiple: int,
    read: OutputReader = _lm_logits,
) -> torch.Tensor:
    seq_len = input_ids.shape[1]
    width = _round_up(seq_len, multiple)
    if width != seq_len:
        input_ids = F.pad(input_ids, (0, width - seq_len))
    attention_mask = padding_mask(input_lengths, width).long()
    logits = read(model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False))
    return logits[:, :seq_len]


def _packed_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    layout: ForwardLayout,
    read: OutputReader = _lm_logits,
) -> torch.Tensor:
    packed = pack_sequences(input_ids, input_lengths, layout.seq_multiple, layout.pad_token_id)
    if layout.varlen_attention:
        # HF's FlashAttention path derives cu_seqlens from the restarting position ids.
        logits = read(model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False))
    else:
        allowed = block_diagonal_attention_mask(packed.cu_seqlens, packed.total_len)
        mask = additive_mask(allowed, layout.compute_dtype)[None, None]
        logits = read(
            model(
                input_ids=packed.input_ids,
                position_ids=packed.position_ids,
                attention_mask=mask,
                use_cache=False,
            )
        )
    return unpack_sequences(logits, packed, max_len=input_ids.shape[1])


def causal_lm_logits(
    model: nn.Module, input_ids: torch.Tensor, input_lengths: torch.Tensor, layout: ForwardLayout
) -> torch.Tensor:
    """Logits `[B, T, V]` of a right-padded micro-batch (values at padding are unspecified)."""
    return _forward(model, input_ids, input_lengths, layout, _lm_logits)


def sequence_scores(
    model: nn.Module,
    head: nn.Module,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    layout: ForwardLayout,
) -> torch.Tensor:
    """`[B, num_labels]`: a sequence-classification model's head output at each sequence's
    last token (position `input_lengths - 1`).

    The head's per-position output is captured by a hook during the ordinary model call (so
    FSDP's root hooks run as usual) and pooled here from the lengths, which works for padded
    and packed micro-batches alike and does not depend on which token id pads a row.
    """
    captured: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _module, _inputs, output: captured.append(output))
    try:
        per_position = _forward(model, input_ids, input_lengths, layout, lambda _output: captured.pop())
    finally:
        handle.remove()
    last = (input_lengths.to(per_position.device) - 1).clamp(min=0)
    rows = torch.arange(per_position.shape[0], device=per_position.device)
    return per_position[rows, last]


def _forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    layout: ForwardLayout,
    read: OutputReader,
) -> torch.Tensor:
    if layout.packed:
        return _packed_forward(model, input_ids, input_lengths, layout, read)
    return _padded_forward(model, input_ids, input_lengths, layout.seq_multiple, read)


def zero_beyond_lengths(values: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
    """`values [B, T, ...]` with positions t >= input_lengths[b] set to 0."""
    keep = padding_mask(input_lengths.to(values.device), values.shape[1])
    while keep.dim() < values.dim():
        keep = keep.unsqueeze(-1)
    return torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
