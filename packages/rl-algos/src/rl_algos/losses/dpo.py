"""Direct Preference Optimisation, with an optional SFT term on the chosen responses.

For pair i (chosen c = sample 2i, rejected r = sample 2i + 1; see `preference`):

    logp(y)  = sum over y's valid tokens of log pi   (mean instead, with `preference_average_log_probs`)
    reward_y = beta * (logp(y) - logp_ref(y))
    pref_i   = -log sigmoid(reward_c - reward_r)
    sft_i    = -sum (or mean, `sft_average_log_probs`) of log pi over c's valid tokens
    loss     = mean over the global valid pairs of (pref_i + sft_loss_weight * sft_i)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from pydantic import Field

from rl_algos.losses.common import LossBatch, masked_sum, sequence_mean, to_floats
from rl_algos.losses.config import coerce_config
from rl_algos.losses.preference import bradley_terry, num_pairs_normaliser, pair_mask, split_pairs
from rl_core.config import RLConfig
from rl_core.interfaces import LossType


class DPOLossConfig(RLConfig):
    beta: float = Field(default=0.1, gt=0.0, description="inverse temperature of the implicit reward")
    sft_loss_weight: float = Field(
        default=0.0, ge=0.0, description="weight of the NLL of the chosen responses"
    )
    preference_average_log_probs: bool = Field(
        default=False, description="mean instead of sum of token log-probs"
    )
    sft_average_log_probs: bool = Field(default=False, description="mean instead of sum in the SFT term")


class DPOLossFn:
    """DPO over interleaved chosen/rejected pairs; see the module docstring.

    Needs `input_ids`, `token_mask`, `sample_mask`, `reference_policy_logprobs` (aligned with
    `input_ids`). Metrics, each a contribution to a global mean over valid pairs: `loss`,
    `preference_loss`, `sft_loss`, `accuracy`, `margin`, `rewards_chosen_mean`,
    `rewards_rejected_mean`, `logprobs_chosen_mean`, `logprobs_rejected_mean` (the policy's
    sequence log-probs as the preference term uses them); plus the counts `num_valid_samples`
    and `num_valid_pairs`.
    """

    loss_type = LossType.SEQUENCE_LEVEL

    def __init__(self, cfg: DPOLossConfig | Mapping[str, Any] | None = None) -> None:
        self.cfg = coerce_config(cfg, DPOLossConfig)

    def __call__(
        self,
        logits: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = self.cfg
        batch = LossBatch(type(self).__name__, data, logits)
        valid_pairs = pair_mask(batch)
        mask = batch.valid_token_mask()
        logprobs = batch.token_logprobs(logits)
        reference = batch.tokens("reference_policy_logprobs")
        num_pairs = num_pairs_normaliser(global_valid_seqs, logprobs)

        def per_sequence(values: torch.Tensor, average: bool) -> torch.Tensor:
            return sequence_mean(values, mask) if average else masked_sum(values, mask, dim=-1)

        policy_seq = per_sequence(logprobs, cfg.preference_average_log_probs)
        rewards = cfg.beta * (policy_seq - per_sequence(reference, cfg.preference_average_log_probs))
        chosen_rewards, rejected_rewards = split_pairs(rewards)
        preference_loss, metrics = bradley_terry(chosen_rewards, rejected_rewards, valid_pairs, num_pairs)

        sft_per_pair = split_pairs(-per_sequence(logprobs, cfg.sft_average_log_probs))[0]
        sft_loss = masked_sum(sft_per_pair, valid_pairs) / num_pairs
        loss = (
            preference_loss + cfg.sft_loss_weight * sft_loss if cfg.sft_loss_weight > 0 else preference_loss
        )

        chosen_logp, rejected_logp = split_pairs(policy_seq.detach())
        return loss, to_floats(
            {
                "loss": loss,
                "preference_loss": preference_loss,
                "sft_loss": sft_loss,
                **metrics,
                "logprobs_chosen_mean": masked_sum(chosen_logp, valid_pairs) / num_pairs,
                "logprobs_rejected_mean": masked_sum(rejected_logp, valid_pairs) / num_pairs,
                "num_valid_samples": 2 * valid_pairs.sum(),
                "num_valid_pairs": valid_pairs.sum(),
            }
        )
