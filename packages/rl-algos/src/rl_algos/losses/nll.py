"""Negative log-likelihood over the trained tokens: the SFT loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rl_algos.losses.common import LossBatch, as_normaliser, global_token_mean, to_floats
from rl_core.interfaces import LossType


class NLLLossFn:
    """Mean over the global valid tokens of -log pi(token); prompt tokens are masked by `token_mask`.

    Needs `input_ids`, `token_mask`, `sample_mask`. Metrics: `loss` (the loss's contribution),
    `num_valid_tokens`, `num_valid_samples` (counts; they sum over micro-batches).
    """

    loss_type = LossType.TOKEN_LEVEL

    def __call__(
        self,
        logits: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        batch = LossBatch(type(self).__name__, data, logits)
        mask = batch.valid_token_mask()
        logprobs = batch.token_logprobs(logits)
        loss = global_token_mean(-logprobs, mask, as_normaliser(global_valid_toks, mask))
        return loss, to_floats(
            {
                "loss": loss,
                "num_valid_tokens": mask.sum(),
                "num_valid_samples": batch.sample_mask().sum(),
            }
        )
