"""The per-node actor that creates worker actors from inside their own venv.

The driver names worker classes by string and may not be able to import them (it lacks
vLLM, Megatron, ...). This actor runs in the worker's environment (it is part of rl-core,
which every worker venv contains), imports the class there and creates the worker actors.
It owns them, so it must live as long as they do: initializers are kept for the whole Ray
session and shared by every worker group with the same node, interpreter and env vars
(which also saves a process start per group).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from typing import Any

import ray
from ray.actor import ActorClass, ActorHandle


def import_actor_class(fqn: str) -> Any:
    """Import ``package.module.Class``, with errors that say which interpreter looked."""
    module_name, _, class_name = fqn.rpartition(".")
    if not module_name:
        raise ImportError(
            f"actor class name {fqn!r} is not fully qualified (expected 'package.module.Class')"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"cannot import module {module_name!r} of actor class {fqn!r} with interpreter "
            f"{sys.executable} (sys.prefix {sys.prefix}): {exc}"
        ) from exc
    try:
        return getattr(module, class_name)
    except AttributeError:
        raise ImportError(
            f"module {module_name!r} ({module.__file__}) has no attribute {class_name!r}"
        ) from None


class WorkerInitializer:
    """Creates actors of classes named by string; one per node and worker group."""

    def __init__(self) -> None:
        # Typed loosely: ray's stubs type `.options(...).remote()` as returning a class.
        self._actor_classes: dict[str, Any] = {}

    def _actor_class(self, fqn: str) -> Any:
        if fqn not in self._actor_classes:
            cls = import_actor_class(fqn)
            self._actor_classes[fqn] = cls if isinstance(cls, ActorClass) else ray.remote(cls)
        return self._actor_classes[fqn]

    def create_worker(
        self, fqn: str, actor_options: dict[str, Any], init_args: tuple[Any, ...], init_kwargs: dict[str, Any]
    ) -> ActorHandle:
        handle: ActorHandle = (
            self._actor_class(fqn).options(**actor_options).remote(*init_args, **init_kwargs)
        )
        return handle

    def describe(self) -> dict[str, Any]:
        """Plain-typed facts about this process (safe to return across venvs)."""
        return {"python": sys.executable, "prefix": sys.prefix, "pid": os.getpid()}


_initializers: dict[tuple[str, str, str, tuple[tuple[str, str], ...]], ActorHandle] = {}
_initializers_lock = threading.Lock()


def get_worker_initializer(node_id: str, python: str | None, env_vars: dict[str, str]) -> ActorHandle:
    """The session's initializer on ``node_id`` running ``python`` (None: the cluster's
    default interpreter) with ``env_vars``; started on first use."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    job_id = ray.get_runtime_context().get_job_id()
    key = (job_id, node_id, python or "", tuple(sorted(env_vars.items())))
    with _initializers_lock:
        for stale in [k for k in _initializers if k[0] != job_id]:  # from an earlier ray.init
            del _initializers[stale]
        if key not in _initializers:
            runtime_env: dict[str, Any] = {"env_vars": dict(env_vars)}
            if python:
                runtime_env["py_executable"] = python
            actor_class: Any = ray.remote(num_cpus=0)(WorkerInitializer)
            _initializers[key] = actor_class.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
                runtime_env=runtime_env,
            ).remote()
        return _initializers[key]


def forget_worker_initializer(handle: ActorHandle) -> None:
    """Drop an initializer (a dead one) from the cache so the next request starts a new one."""
    with _initializers_lock:
        for key in [k for k, v in _initializers.items() if v == handle]:
            del _initializers[key]


def forget_worker_initializers_for_python(python: str) -> None:
    """Stop handing out initializers running ``python`` (its venv was rebuilt).

    They are only dropped from the cache, not killed: worker groups still using them hold
    their own handles and keep them (and the actors they own) alive until they shut down.
    """
    with _initializers_lock:
        for key in [k for k in _initializers if k[2] == python]:
            del _initializers[key]
