"""Contracts between the algorithm loops and the backends (DESIGN.md §3)."""

from rl_core.interfaces.environment import EnvironmentInterface, EnvironmentReturn
from rl_core.interfaces.generation import GenerationInterface
from rl_core.interfaces.loss import LossFunction, LossType
from rl_core.interfaces.policy import PolicyInterface, WeightBucket
from rl_core.interfaces.specs import (
    TRAINING_FIELDS,
    GenerationInput,
    GenerationOutput,
    LogprobOutput,
    Message,
    MessageLog,
    ReferenceLogprobOutput,
    TopkLogitsOutput,
    TrainingBatch,
)

__all__ = [
    "TRAINING_FIELDS",
    "EnvironmentInterface",
    "EnvironmentReturn",
    "GenerationInput",
    "GenerationInterface",
    "GenerationOutput",
    "LogprobOutput",
    "LossFunction",
    "LossType",
    "Message",
    "MessageLog",
    "PolicyInterface",
    "ReferenceLogprobOutput",
    "TopkLogitsOutput",
    "TrainingBatch",
    "WeightBucket",
]
