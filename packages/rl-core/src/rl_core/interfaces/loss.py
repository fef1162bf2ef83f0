"""The loss-function contract shared by every training backend."""

from __future__ import annotations

import enum
from typing import Any, Protocol, runtime_checkable

import torch


class LossType(enum.StrEnum):
    """How a loss is normalised across the global batch.

    TOKEN_LEVEL losses divide by the global number of valid tokens
    (sum of `token_mask[:, 1:] * sample_mask`), SEQUENCE_LEVEL losses by the global number of
    valid sequences (sum of `sample_mask`). The global counts are all-reduced over data-parallel
    ranks and micro-batches *before* the optimiser step, so that gradient accumulation, data
    parallelism and sequence packing give exactly the update of one big batch.
    """

    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


@runtime_checkable
class LossFunction(Protocol):
    """A loss over one micro-batch that already carries the global normaliser.

    `logits` are the model's logits for the micro-batch, [B, T, V], where position t predicts
    token t + 1. Implementations upcast to float32 themselves. The returned loss is
    `sum over the micro-batch / global count`, so summing the losses of all micro-batches on all
    ranks gives the loss of the whole global batch. Metrics are plain Python numbers (or
    tensors of them) that the backend sums across micro-batches and ranks.
    """

    loss_type: LossType

    def __call__(
        self,
        logits: torch.Tensor,
        data: Any,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, Any]]: ...
