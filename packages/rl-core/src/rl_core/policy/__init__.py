"""The driver side of a policy: its config schema and the objects that drive its Ray workers.

Nothing here imports a backend package: workers are named by fully-qualified class and
started by Ray in their own environment (DESIGN.md §2), so `rl_algos` builds any backend
through `Policy` / `WorkerGroupGeneration` / `ColocatedGeneration` alone.
"""

from rl_core.policy.config import (
    DynamicBatchingConfig,
    HFGenerationConfig,
    OptimizerConfig,
    ParallelConfig,
    PolicyConfig,
    PolicyGenerationConfig,
    SamplingConfig,
    SchedulerConfig,
    SequencePackingConfig,
)
from rl_core.policy.generation import ColocatedGeneration, WorkerGroupGeneration
from rl_core.policy.lm_policy import POLICY_WORKER_FQNS, Policy

__all__ = [
    "POLICY_WORKER_FQNS",
    "ColocatedGeneration",
    "DynamicBatchingConfig",
    "HFGenerationConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "Policy",
    "PolicyConfig",
    "PolicyGenerationConfig",
    "SamplingConfig",
    "SchedulerConfig",
    "SequencePackingConfig",
    "WorkerGroupGeneration",
]
