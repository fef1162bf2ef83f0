"""Loss functions (the `rl_core.interfaces.LossFunction` contract) and their shared helpers."""

from rl_algos.losses.clipped_pg import ClippedPGLossConfig, ClippedPGLossFn, importance_ratio
from rl_algos.losses.common import (
    LossBatch,
    LossInputError,
    as_normaliser,
    global_sequence_mean,
    global_token_mean,
    masked_sum,
    reduce_per_token,
    sequence_mean,
    to_floats,
    token_logprobs,
)
from rl_algos.losses.distillation import DistillationLossConfig, DistillationLossFn
from rl_algos.losses.dpo import DPOLossConfig, DPOLossFn
from rl_algos.losses.kl import KLType, kl_estimate
from rl_algos.losses.nll import NLLLossFn
from rl_algos.losses.preference import PreferenceLossFn, bradley_terry

__all__ = [
    "ClippedPGLossConfig",
    "ClippedPGLossFn",
    "DPOLossConfig",
    "DPOLossFn",
    "DistillationLossConfig",
    "DistillationLossFn",
    "KLType",
    "LossBatch",
    "LossInputError",
    "NLLLossFn",
    "PreferenceLossFn",
    "as_normaliser",
    "bradley_terry",
    "global_sequence_mean",
    "global_token_mean",
    "importance_ratio",
    "kl_estimate",
    "masked_sum",
    "reduce_per_token",
    "sequence_mean",
    "to_floats",
    "token_logprobs",
]
