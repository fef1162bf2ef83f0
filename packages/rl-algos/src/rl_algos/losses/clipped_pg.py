"""The clipped policy-gradient loss behind PPO, GRPO, DAPO, GSPO and REINFORCE-style runs.

Per valid token t of sample i (all log-probs aligned with `input_ids`):

    r_t   = pi(y_t) / pi_old(y_t)                     (pi_old: `prev_logprobs`)
    pg_t  = max(-A_t * r_t, -A_t * clip(r_t, 1 - eps_low, 1 + eps_high))
    pg_t  = min(pg_t, -c * A_t)            where A_t < 0, with dual clip c (`ratio_clip_c`)
    pg_t  = -A_t * log pi(y_t)             instead, when `disable_ppo_ratio` (REINFORCE/RLOO)
    pg_t *= w_t                            off-policy correction, `use_importance_sampling_correction`
    kl_t  = KL estimate (k1/k2/k3) of KL(pi || pi_ref), optionally times pi/pi_gen
    loss  = reduce(pg_t) + beta * reduce(kl_t)

`reduce` is the token-level (DAPO) or sequence-level (GRPO) global mean of `reduce_per_token`.

GSPO (`sequence_level_importance_ratios`): the ratio of sample i is the geometric mean of its
token ratios, s_i = exp(mean_t (log pi - log pi_old)), clipped at sequence level. It enters as
the GSPO-token ratio `sg[s_i] * pi(y_t) / sg[pi(y_t)]`, whose value is s_i and whose gradient
is s_i * grad log pi(y_t); with one advantage per sample and sequence-level reduction this is
exactly the GSPO objective, and it stays well defined for per-token advantages. GSPO uses
far smaller clip ranges than token-level PPO (the paper: eps_low = 3e-4, eps_high = 4e-4).

The importance-sampling weight corrects for the rollout engine's policy pi_gen differing from
the trainer's pi_old (different kernels, precision, or stale weights in async runs):
w_t = pi_old / pi_gen = exp(prev_logprobs - generation_logprobs) (per sample, the geometric
mean over its tokens, when the ratios are sequence-level), truncated at
`truncated_importance_sampling_ratio` (TIS) and never differentiated.

Metrics are contributions that sum over micro-batches and data-parallel ranks to global values:
`loss`, `actor_loss`, `kl_penalty` (beta * KL, as added to the loss) follow the loss's own
normalisation; every other per-token statistic is a mean over the global valid tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

import torch
from pydantic import Field, model_validator

from rl_algos.losses.common import (
    LossBatch,
    as_normaliser,
    global_token_mean,
    reduce_per_token,
    sequence_mean,
    to_floats,
)
from rl_algos.losses.config import coerce_config
from rl_algos.losses.kl import KLType, kl_estimate
from rl_core.config import RLConfig
from rl_core.interfaces import LossType


class ClippedPGLossConfig(RLConfig):
    """Knobs of `ClippedPGLossFn` (the `loss_fn` section of a GRPO recipe)."""

    ratio_clip_min: float = Field(
        default=0.2, ge=0.0, lt=1.0, description="eps_low: ratios clip at 1 - eps_low"
    )
    ratio_clip_max: float = Field(
        default=0.2, ge=0.0, description="eps_high: ratios clip at 1 + eps_high (DAPO: 0.28)"
    )
    ratio_clip_c: float | None = Field(
        default=None,
        gt=1.0,
        description="dual-clip bound c on -A*r for negative advantages; null disables it",
    )
    disable_ppo_ratio: bool = Field(
        default=False, description="REINFORCE: pg = -A * log pi, no ratio, no clipping"
    )
    reference_policy_kl_penalty: float = Field(
        default=0.0, ge=0.0, description="beta of the KL(pi || pi_ref) term"
    )
    reference_policy_kl_type: KLType = "k3"
    kl_input_clamp_value: float | None = Field(
        default=20.0, gt=0.0, description="clamp |log pi_ref - log pi|"
    )
    kl_output_clamp_value: float | None = Field(
        default=10.0, gt=0.0, description="clamp the per-token KL estimate"
    )
    use_on_policy_kl_approximation: bool = Field(
        default=False,
        description="weight the KL estimate by pi / pi_gen so it estimates KL under the current policy",
    )
    token_level_loss: bool = Field(
        default=True, description="true: mean over tokens (DAPO); false: over sequences"
    )
    sequence_level_importance_ratios: bool = Field(default=False, description="GSPO sequence-level ratios")
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_ratio: float | None = Field(
        default=None,
        gt=0.0,
        description="upper bound of the importance weight pi_old / pi_gen; null: no bound",
    )

    @model_validator(mode="after")
    def _check_combinations(self) -> Self:
        if self.disable_ppo_ratio and self.sequence_level_importance_ratios:
            raise ValueError(
                "sequence_level_importance_ratios (GSPO) needs the PPO ratio; disable_ppo_ratio is true"
            )
        if self.disable_ppo_ratio and self.ratio_clip_c is not None:
            raise ValueError("ratio_clip_c (dual clip) has no effect with disable_ppo_ratio; set it to null")
        if (
            self.truncated_importance_sampling_ratio is not None
            and not self.use_importance_sampling_correction
        ):
            raise ValueError(
                "truncated_importance_sampling_ratio is set but use_importance_sampling_correction is false"
            )
        return self


def importance_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, sequence_level: bool
) -> torch.Tensor:
    """[B, T] ratio pi / pi_old per token, or the GSPO-token sequence ratio broadcast over tokens.

    Inputs must already be zero outside `mask`. Detached inputs give detached weights, which is
    how the importance-sampling correction reuses this.
    """
    if not sequence_level:
        return torch.exp(logprobs - old_logprobs)
    per_sequence = sequence_mean((logprobs - old_logprobs).detach(), mask).unsqueeze(-1)
    return torch.exp(per_sequence + logprobs - logprobs.detach())


class ClippedPGLossFn:
    """Clipped PPO-style policy-gradient loss with a KL penalty; see the module docstring.

    Needs `input_ids`, `token_mask`, `sample_mask`, `advantages`, `prev_logprobs`; plus
    `reference_policy_logprobs` when beta > 0 and `generation_logprobs` for the
    importance-sampling correction or the on-policy KL approximation. When
    `generation_logprobs` is present, `token_mult_prob_error` and `gen_kl_error` are reported.
    The backend must have scaled the logits by the sampling temperature, exactly as it does
    for `get_logprobs`.
    """

    def __init__(self, cfg: ClippedPGLossConfig | Mapping[str, Any] | None = None) -> None:
        self.cfg = coerce_config(cfg, ClippedPGLossConfig)
        self.loss_type = LossType.TOKEN_LEVEL if self.cfg.token_level_loss else LossType.SEQUENCE_LEVEL

    def _clipped_objective(
        self, advantages: torch.Tensor, ratio: torch.Tensor, clamped_ratio: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token pessimistic (max) PPO loss with optional dual clip, and where each clip acts.

        Returns (loss, lower clip active, upper clip active, dual clip active): a clip "acts" on
        a token when it bounds the loss there, i.e. the token gets no gradient from it.
        """
        unclipped_loss = -advantages * ratio
        clipped_loss = -advantages * clamped_ratio
        pg = torch.maximum(unclipped_loss, clipped_loss)
        clip_active = clipped_loss > unclipped_loss
        dual_clipped = torch.zeros_like(clip_active)
        if self.cfg.ratio_clip_c is not None:
            dual_bound = -self.cfg.ratio_clip_c * advantages
            dual_clipped = (advantages < 0) & (dual_bound < pg)
            pg = torch.where(dual_clipped, dual_bound, pg)
        return pg, clip_active & (advantages < 0), clip_active & (advantages > 0), dual_clipped

    def __call__(
        self,
        logits: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = self.cfg
        batch = LossBatch(type(self).__name__, data, logits)
        mask = batch.valid_token_mask()
        valid = mask.bool()
        sample_mask = batch.sample_mask()
        num_seqs = as_normaliser(global_valid_seqs, mask)
        num_toks = as_normaliser(global_valid_toks, mask)

        def field(key: str) -> torch.Tensor:
            # Zeroing padding up front keeps every later exp/ratio finite there (no inf * 0).
            return torch.where(valid, batch.tokens(key), 0.0)

        def token_mean(values: torch.Tensor) -> torch.Tensor:
            return global_token_mean(values, mask, num_toks)

        def reduce(values: torch.Tensor) -> torch.Tensor:
            return reduce_per_token(values, mask, sample_mask, self.loss_type, num_seqs, num_toks)

        logprobs = torch.where(valid, batch.token_logprobs(logits), 0.0)
        prev_logprobs = field("prev_logprobs")
        advantages = field("advantages")
        needs_generation = cfg.use_importance_sampling_correction or (
            cfg.use_on_policy_kl_approximation and cfg.reference_policy_kl_penalty > 0
        )
        generation_logprobs = (
            field("generation_logprobs") if needs_generation or batch.has("generation_logprobs") else None
        )

        ratio = importance_ratio(logprobs, prev_logprobs, mask, cfg.sequence_level_importance_ratios)
        clamped_ratio = ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
        if cfg.disable_ppo_ratio:
            pg = -advantages * logprobs
            clipped_low = clipped_high = dual_clipped = torch.zeros_like(valid)
        else:
            pg, clipped_low, clipped_high, dual_clipped = self._clipped_objective(
                advantages, ratio, clamped_ratio
            )

        metrics: dict[str, torch.Tensor] = {}
        if cfg.use_importance_sampling_correction:
            assert generation_logprobs is not None
            weights = importance_ratio(
                prev_logprobs, generation_logprobs, mask, cfg.sequence_level_importance_ratios
            ).detach()
            limit = cfg.truncated_importance_sampling_ratio
            if limit is not None:
                metrics["importance_weight_truncated_fraction"] = token_mean((weights > limit).to(mask))
                weights = weights.clamp(max=limit)
            metrics["importance_weight_mean"] = token_mean(weights)
            pg = pg * weights

        kl_term = torch.zeros_like(logprobs)
        if batch.has("reference_policy_logprobs") or cfg.reference_policy_kl_penalty > 0:
            reference_kl = kl_estimate(
                logprobs,
                field("reference_policy_logprobs"),
                cfg.reference_policy_kl_type,
                cfg.kl_input_clamp_value,
                cfg.kl_output_clamp_value,
            )
            metrics["reference_kl"] = token_mean(reference_kl)
            if cfg.reference_policy_kl_penalty > 0:
                if cfg.use_on_policy_kl_approximation:
                    assert generation_logprobs is not None
                    # Samples come from pi_gen; weighting by pi / pi_gen estimates KL under pi.
                    reference_kl = reference_kl * torch.exp(logprobs - generation_logprobs).detach()
                kl_term = cfg.reference_policy_kl_penalty * reference_kl

        actor_loss = reduce(pg)
        kl_penalty = reduce(kl_term)
        loss = actor_loss + kl_penalty

        with torch.no_grad():
            ratio_d = ratio.detach()
            logprobs_d = logprobs.detach()
            metrics.update(
                loss=loss,
                actor_loss=actor_loss,
                kl_penalty=kl_penalty,
                probs_ratio_mean=token_mean(ratio_d),
                probs_ratio_clamped_mean=token_mean(clamped_ratio.detach()),
                clip_fraction_lower=token_mean(clipped_low.to(mask)),
                clip_fraction_upper=token_mean(clipped_high.to(mask)),
                clip_fraction=token_mean((clipped_low | clipped_high).to(mask)),
                dual_clip_fraction=token_mean(dual_clipped.to(mask)),
                num_valid_samples=sample_mask.sum(),
                num_valid_tokens=mask.sum(),
            )
            if generation_logprobs is not None:
                metrics["token_mult_prob_error"] = token_mean(
                    torch.exp((generation_logprobs - prev_logprobs).abs())
                )
                # KL(pi_gen || pi_old) estimated on tokens sampled from pi_gen.
                metrics["gen_kl_error"] = token_mean(kl_estimate(generation_logprobs, prev_logprobs, "k3"))
                # Entropy of pi estimated from pi_gen's samples: E_gen[-(pi / pi_gen) log pi].
                entropy_weight = torch.exp(logprobs_d - generation_logprobs)
            else:
                entropy_weight = torch.ones_like(logprobs_d)
            metrics["approx_entropy"] = token_mean(-entropy_weight * logprobs_d)
        return loss, to_floats(metrics)
