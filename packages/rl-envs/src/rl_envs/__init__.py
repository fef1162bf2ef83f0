"""Environments for rl: math verification, sandboxed code, reward model, multi-turn games and tools.

Public names resolve lazily, so `import rl_envs` does not import torch, transformers or sympy.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "MathEnvironment": "rl_envs.math",
    "CodeEnvironment": "rl_envs.code",
    "RewardModelEnvironment": "rl_envs.reward_model",
    "SlidingPuzzleEnvironment": "rl_envs.sliding_puzzle",
    "ToolEnvironment": "rl_envs.tools",
    "Sandbox": "rl_envs.sandbox",
    "SandboxConfig": "rl_envs.sandbox",
    "SandboxResult": "rl_envs.sandbox",
    "EnvironmentRouter": "rl_envs.router",
    "create_environment": "rl_envs.registry",
    "create_environments": "rl_envs.registry",
    "get_environment_class": "rl_envs.registry",
    "register_environment": "rl_envs.registry",
    "registered_environments": "rl_envs.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rl_envs' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
