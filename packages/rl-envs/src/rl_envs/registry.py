"""Environments by name, and starting them as Ray actors from a recipe's ``env:`` section.

A recipe says ``env: {math: {num_workers: 4}, code: {...}}``; each key is a task name that
samples carry in ``task_name``. The environment class is the registered one of the same name,
or the one named by an optional ``type:`` entry (``env: {gsm8k: {type: math}}``).
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Mapping
from typing import Any

from rl_core.interfaces import EnvironmentInterface
from rl_envs.base import validate_config

_FQN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")
_BUILTIN: dict[str, str] = {
    "math": "rl_envs.math.MathEnvironment",
    "code": "rl_envs.code.CodeEnvironment",
    "reward_model": "rl_envs.reward_model.RewardModelEnvironment",
    "sliding_puzzle": "rl_envs.sliding_puzzle.SlidingPuzzleEnvironment",
    "tools": "rl_envs.tools.ToolEnvironment",
}
TYPE_KEY = "type"

_lock = threading.Lock()
_registry: dict[str, str] = dict(_BUILTIN)


class UnknownEnvironmentError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def register_environment(name: str, fqn: str, *, replace: bool = False) -> None:
    """Make ``name`` refer to the environment class ``fqn`` (``package.module.Class``)."""
    if not isinstance(fqn, str) or not _FQN.match(fqn):
        raise ValueError(f"environment {name!r}: {fqn!r} is not a fully-qualified 'package.module.Class'")
    with _lock:
        existing = _registry.get(name)
        if existing is not None and existing != fqn and not replace:
            raise ValueError(f"environment {name!r} is already registered as {existing!r}; pass replace=True")
        _registry[name] = fqn


def registered_environments() -> dict[str, str]:
    with _lock:
        return dict(_registry)


def get_environment_class(name: str) -> type[EnvironmentInterface]:
    """Import the class registered as ``name``; an unknown name lists the registered ones."""
    with _lock:
        fqn = _registry.get(name)
        known = sorted(_registry)
    if fqn is None:
        raise UnknownEnvironmentError(f"unknown environment {name!r}; registered environments: {known}")
    module_name, _, class_name = fqn.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"environment {name!r}: cannot import {fqn!r}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, EnvironmentInterface)):
        raise TypeError(f"environment {name!r}: {fqn!r} is not an EnvironmentInterface subclass")
    return cls


def _split_section(task_name: str, section: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]]:
    settings = dict(section or {})
    env_type = settings.pop(TYPE_KEY, task_name)
    if not isinstance(env_type, str):
        raise ValueError(f"env.{task_name}.{TYPE_KEY}: expected an environment name, got {env_type!r}")
    return env_type, settings


def _validated(
    name: str, config: Mapping[str, Any] | None, where: str
) -> tuple[type[EnvironmentInterface], Any]:
    cls = get_environment_class(name)
    config_cls = getattr(cls, "config_class", None)
    settings: Any = dict(config or {})
    if config_cls is not None:
        settings = validate_config(config_cls, settings, where).model_dump()
    return cls, settings


def _start(
    cls: type[EnvironmentInterface], settings: Any, num_cpus: float, max_concurrency: int, **options: Any
) -> Any:
    import ray

    return (
        ray.remote(cls)
        .options(num_cpus=num_cpus, max_concurrency=max_concurrency, **options)
        .remote(settings)
    )


def create_environment(
    name: str,
    config: Mapping[str, Any] | None = None,
    *,
    num_cpus: float = 0.0,
    max_concurrency: int = 8,
    **actor_options: Any,
) -> Any:
    """Start environment ``name`` as a Ray actor and return its handle.

    The config is validated here, in the caller, so a bad key fails before any actor starts.
    Environments do their heavy work in their own worker processes/sandboxes, so the actor
    reserves no CPU by default; concurrent ``step`` calls are served in parallel (the
    environments are thread-safe). ``actor_options`` go to Ray's ``.options``.
    """
    cls, settings = _validated(name, config, f"env.{name}")
    return _start(cls, settings, num_cpus, max_concurrency, **actor_options)


def create_environments(
    env_section: Mapping[str, Mapping[str, Any] | None],
    *,
    num_cpus: float = 0.0,
    max_concurrency: int = 8,
    **actor_options: Any,
) -> dict[str, Any]:
    """One actor per task name of a recipe's ``env:`` section; all configs are validated first."""
    prepared = {}
    for task_name, section in env_section.items():
        env_type, settings = _split_section(task_name, section)
        prepared[task_name] = _validated(env_type, settings, f"env.{task_name}")
    return {
        task_name: _start(cls, settings, num_cpus, max_concurrency, **actor_options)
        for task_name, (cls, settings) in prepared.items()
    }
