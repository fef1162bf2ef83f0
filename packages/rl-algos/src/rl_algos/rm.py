"""Reward-model training: a causal LM with a one-output classification head, Bradley–Terry loss.

The policy is loaded as a sequence classifier (`policy.model_class: sequence_classification`,
`num_labels: 1`): the head is new, the backbone comes from the checkpoint. Its score of a
conversation is the head's output at the last token; the loss is -log σ(score(chosen) −
score(rejected)) over `prompt / chosen / rejected` pairs (`PreferenceLossFn`). Metrics per step
and on the validation pairs: `loss`, pairwise `accuracy`, `margin`, `rewards_chosen_mean`,
`rewards_rejected_mean`. With `rm.export_hf_dir` the final model is written as a Hugging Face
`...ForSequenceClassification` directory, which the `reward_model` environment loads.
`run_rm` is what `rl rm` runs.
"""

from __future__ import annotations

from functools import partial
from typing import Self

from pydantic import model_validator

from rl_algos.losses import PreferenceLossFn
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


class RMConfig(PairwiseLoopConfig):
    """The `rm` section."""


class RMMasterConfig(PolicyRunConfig):
    """A whole reward-model recipe."""

    rm: RMConfig
    data: PreferenceDataConfig

    @model_validator(mode="after")
    def _reward_model_policy(self) -> Self:
        if self.policy.model_class != "sequence_classification":
            raise ValueError(
                "policy.model_class: a reward model is a sequence classifier; set it to sequence_classification "
                f"(got {self.policy.model_class!r})"
            )
        if self.policy.num_labels != 1:
            raise ValueError(
                f"policy.num_labels: a reward model outputs one score; set it to 1 (got {self.policy.num_labels})"
            )
        check_pairwise_policy(self.policy)
        return self


def setup(cfg: RMMasterConfig) -> PairwiseRun:
    # The loss needs no reference policy: skip the frozen copy of the weights.
    policy_cfg = cfg.policy.model_copy(update={"reference_model": False})
    return setup_pairwise(cfg, "rm", cfg.rm, cfg.data, PreferenceLossFn(), False, policy_cfg)


def run_rm(cfg: RMMasterConfig) -> LoopResult:
    """Set up, train, print the summary and shut down (what `rl rm` runs)."""
    run = setup(cfg)
    validate = partial(validate_pairwise, run) if run.validation is not None else None
    return execute(run, partial(pairwise_step, run), validate)


__all__ = ["RMConfig", "RMMasterConfig", "run_rm", "setup"]
