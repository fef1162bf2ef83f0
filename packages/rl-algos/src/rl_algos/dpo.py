"""Direct Preference Optimisation on `prompt / chosen / rejected` pairs.

Per step: the next batch of pairs; the frozen reference policy's log-probs of every token,
computed per batch by the same workers (`get_reference_policy_logprobs`, the initial weights
swapped in); one optimizer step of `DPOLossFn` (β, optional SFT term on the chosen responses,
summed or averaged sequence log-probs, see `rl_algos.losses.dpo`). Metrics per step and on
the validation pairs: `loss`, `preference_loss`, `sft_loss`, reward `accuracy` and `margin`,
`rewards_chosen_mean` / `rewards_rejected_mean`, `logprobs_chosen_mean` /
`logprobs_rejected_mean`. `run_dpo` is what `rl dpo` runs.
"""

from __future__ import annotations

from functools import partial
from typing import Self

from pydantic import Field, model_validator

from rl_algos.losses import DPOLossConfig, DPOLossFn
from rl_algos.pairwise import (
    PairwiseLoopConfig,
    PairwiseRun,
    PreferenceDataConfig,
    check_pairwise_policy,
    pairwise_step,
    setup_pairwise,
    validate_pairwise,
)
from rl_algos.training import LoopResult, PolicyRunConfig, execute


class DPOConfig(PairwiseLoopConfig):
    """The `dpo` section (β and the SFT term are in `loss_fn`)."""


class DPOMasterConfig(PolicyRunConfig):
    """A whole DPO recipe."""

    dpo: DPOConfig
    loss_fn: DPOLossConfig = Field(default_factory=DPOLossConfig)
    data: PreferenceDataConfig

    @model_validator(mode="after")
    def _dpo_policy(self) -> Self:
        if not self.policy.reference_model:
            raise ValueError(
                "policy.reference_model: DPO compares against the reference policy; set it to true"
            )
        if self.policy.model_class != "causal_lm":
            raise ValueError(f"policy.model_class: DPO trains a causal LM, got {self.policy.model_class!r}")
        check_pairwise_policy(self.policy)
        return self


def setup(cfg: DPOMasterConfig) -> PairwiseRun:
    return setup_pairwise(cfg, "dpo", cfg.dpo, cfg.data, DPOLossFn(cfg.loss_fn), with_reference_logprobs=True)


def run_dpo(cfg: DPOMasterConfig) -> LoopResult:
    """Set up, train, print the summary and shut down (what `rl dpo` runs)."""
    run = setup(cfg)
    validate = partial(validate_pairwise, run) if run.validation is not None else None
    return execute(run, partial(pairwise_step, run), validate)


__all__ = ["DPOConfig", "DPOMasterConfig", "run_dpo", "setup"]
