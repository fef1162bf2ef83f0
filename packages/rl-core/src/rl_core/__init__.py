"""rl-core: protocols and plumbing shared by every rl package.

Public names are resolved lazily so that `import rl_core` stays cheap (the `rl` command
parses its arguments before torch and Ray are imported).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # data
    "BatchedDataDict": "rl_core.data",
    "DynamicBatchingArgs": "rl_core.data",
    "SequencePackingArgs": "rl_core.data",
    # distributed
    "NamedSharding": "rl_core.distributed",
    "RayVirtualCluster": "rl_core.distributed",
    "RayWorkerGroup": "rl_core.distributed",
    "init_ray": "rl_core.distributed",
    # interfaces
    "EnvironmentInterface": "rl_core.interfaces",
    "EnvironmentReturn": "rl_core.interfaces",
    "GenerationInterface": "rl_core.interfaces",
    "LossFunction": "rl_core.interfaces",
    "LossType": "rl_core.interfaces",
    "PolicyInterface": "rl_core.interfaces",
    # config, logging, checkpoints
    "ConfigError": "rl_core.config",
    "RLConfig": "rl_core.config",
    "apply_overrides": "rl_core.config",
    "load_config": "rl_core.config",
    "Logger": "rl_core.logging",
    "LoggerConfig": "rl_core.logging",
    "CheckpointConfig": "rl_core.checkpoint",
    "CheckpointManager": "rl_core.checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rl_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from rl_core.checkpoint import CheckpointConfig, CheckpointManager
    from rl_core.config import ConfigError, RLConfig, apply_overrides, load_config
    from rl_core.data import BatchedDataDict, DynamicBatchingArgs, SequencePackingArgs
    from rl_core.distributed import NamedSharding, RayVirtualCluster, RayWorkerGroup, init_ray
    from rl_core.interfaces import (
        EnvironmentInterface,
        EnvironmentReturn,
        GenerationInterface,
        LossFunction,
        LossType,
        PolicyInterface,
    )
    from rl_core.logging import Logger, LoggerConfig
