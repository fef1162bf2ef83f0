"""Bradley–Terry pairwise preference loss, shared by reward-model training and DPO.

Pair layout: samples 2i (chosen) and 2i + 1 (rejected) form pair i, so a micro-batch must hold
whole pairs (an even number of samples) and both members of a pair share their `sample_mask`.
The loss is sequence-level over *pairs*: the number of valid pairs of the global batch is
`global_valid_seqs / 2`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from rl_algos.losses.common import LossBatch, LossInputError, as_normaliser, masked_sum, to_floats
from rl_core.interfaces import LossType


def split_pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) = the even and the odd samples of an interleaved batch."""
    return values[0::2], values[1::2]


def pair_mask(batch: LossBatch) -> torch.Tensor:
    """[B / 2] validity of each chosen/rejected pair; rejects odd batches and split pairs."""
    sample_mask = batch.sample_mask()
    if sample_mask.shape[0] % 2:
        raise LossInputError(
            f"{batch.loss_name}: needs chosen/rejected pairs interleaved (sample 2i chosen, 2i+1 "
            f"rejected), but the micro-batch has an odd number of samples ({sample_mask.shape[0]})"
        )
    chosen, rejected = split_pairs(sample_mask)
    if not torch.equal(chosen, rejected):
        bad = int(torch.nonzero(chosen != rejected)[0, 0])
        raise LossInputError(
            f"{batch.loss_name}: sample_mask differs within pair {bad} (samples {2 * bad} and "
            f"{2 * bad + 1}: {chosen[bad].item()} vs {rejected[bad].item()}); a pair is valid or invalid as a whole"
        )
    return chosen


def num_pairs_normaliser(global_valid_seqs: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    return as_normaliser(torch.as_tensor(global_valid_seqs, dtype=like.dtype, device=like.device) / 2, like)


def bradley_terry(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    valid_pairs: torch.Tensor,
    num_pairs: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-log sigmoid(r_chosen - r_rejected), averaged over the global valid pairs.

    Metrics (contributions to global means over valid pairs): `accuracy` (margin > 0, ties
    count as wrong), `margin`, `rewards_chosen_mean`, `rewards_rejected_mean`.
    """
    margin = chosen_rewards - rejected_rewards
    loss = masked_sum(-F.logsigmoid(margin), valid_pairs) / num_pairs

    def pair_mean(values: torch.Tensor) -> torch.Tensor:
        return masked_sum(values.detach(), valid_pairs) / num_pairs

    return loss, {
        "accuracy": pair_mean((margin > 0).to(margin.dtype)),
        "margin": pair_mean(margin),
        "rewards_chosen_mean": pair_mean(chosen_rewards),
        "rewards_rejected_mean": pair_mean(rejected_rewards),
    }


class PreferenceLossFn:
    """Bradley–Terry loss of a reward model.

    `logits` are the model's scalar rewards, one per sequence: shape [B] or [B, 1] (the output of
    a sequence-classification head with one label, already pooled at each sequence's last
    token). Needs `sample_mask` [B]; pairs are interleaved as described in the module docstring.
    Metrics: `loss`, `accuracy`, `margin`, `rewards_chosen_mean`, `rewards_rejected_mean` (global
    means over valid pairs), `num_valid_samples` (sequences) and `num_valid_pairs`.
    """

    loss_type = LossType.SEQUENCE_LEVEL

    def __call__(
        self,
        logits: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        name = type(self).__name__
        if not isinstance(logits, torch.Tensor) or not (
            logits.ndim == 1 or (logits.ndim == 2 and logits.shape[1] == 1)
        ):
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise LossInputError(
                f"{name}: expects one scalar reward per sequence, logits of shape [B] or [B, 1]; got {shape}"
            )
        batch = LossBatch(name, data, logits)
        rewards = logits.reshape(-1).to(batch.dtype)
        valid_pairs = pair_mask(batch)
        chosen, rejected = split_pairs(rewards)
        loss, metrics = bradley_terry(
            chosen, rejected, valid_pairs, num_pairs_normaliser(global_valid_seqs, rewards)
        )
        return loss, to_floats(
            {
                "loss": loss,
                **metrics,
                "num_valid_samples": 2 * valid_pairs.sum(),
                "num_valid_pairs": valid_pairs.sum(),
            }
        )
