"""Starting or joining the Ray cluster that every rl component runs on."""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

logger = logging.getLogger(__name__)

# Settings of rl itself that workers must see the same way as the driver. A local cluster
# inherits the driver's environment; a joined cluster does not, so they are passed along.
PROPAGATED_ENV_PREFIXES = ("RL_",)


def _driver_env_vars_for_workers() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(PROPAGATED_ENV_PREFIXES)}


def _merge_env_vars(runtime_env: dict[str, Any] | None, env_vars: dict[str, str]) -> dict[str, Any] | None:
    if not env_vars:
        return runtime_env
    merged = dict(runtime_env or {})
    # Explicit runtime_env values win over the driver's environment.
    merged["env_vars"] = {**env_vars, **dict(merged.get("env_vars") or {})}
    return merged


def init_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    runtime_env: dict[str, Any] | None = None,
    log_to_driver: bool = True,
    **kwargs: Any,
) -> None:
    """Join the cluster at ``address`` (or ``$RAY_ADDRESS``), else start a local one.

    A local cluster is started without dashboard, usage stats, or token auth (Ray 2.60 turns
    auth on by default; a private single-machine cluster does not need it). Calling this when
    Ray is already initialised does nothing. Workers use the driver's interpreter by default,
    so in single-venv mode every rl package the driver can import is importable there too;
    isolated worker venvs are chosen per actor by `RayWorkerGroup`.

    ``num_cpus``/``num_gpus`` size a new local cluster; they are ignored (with a warning)
    when joining an existing one, whose size is fixed by its nodes.
    """
    if ray.is_initialized():
        logger.info("Ray is already initialised; init_ray does nothing")
        return
    _keep_workers_off_uv_run()
    target = address or os.environ.get("RAY_ADDRESS") or None
    if target is not None and target != "local":
        if num_cpus is not None or num_gpus is not None:
            logger.warning(
                "init_ray: ignoring num_cpus=%s num_gpus=%s: joining the existing cluster at %s",
                num_cpus,
                num_gpus,
                target,
            )
        ray.init(
            address=target,
            runtime_env=_merge_env_vars(runtime_env, _driver_env_vars_for_workers()),
            log_to_driver=log_to_driver,
            **kwargs,
        )
        logger.info("joined Ray cluster at %s: %s", target, ray.cluster_resources())
        return
    # These must be in the environment before ray.init spawns the local daemons.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kwargs.setdefault("include_dashboard", False)
    ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        runtime_env=runtime_env,
        log_to_driver=log_to_driver,
        **kwargs,
    )
    logger.info("started a local Ray cluster: %s", ray.cluster_resources())


def _keep_workers_off_uv_run() -> None:
    """Stop Ray from re-running every worker under `uv run` when the driver was started by
    `uv run` (Ray's default since 2.43, `RAY_ENABLE_UV_RUN_RUNTIME_ENV`).

    That hook uploads the working directory (results and checkpoints included, refused above
    Ray's upload limit) and builds a second environment from it on every node. Our workers
    already get the right interpreter: the driver's, or a backend venv built by
    `rl_core.venvs`. Setting the variable explicitly (to 1) keeps Ray's behaviour.
    """
    if "RAY_ENABLE_UV_RUN_RUNTIME_ENV" in os.environ:
        return
    from ray._private import ray_constants

    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    # Processes started from here (a nested driver) see the same choice.
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"


def shutdown_ray() -> None:
    """Disconnect from (and, for a local cluster, stop) Ray. Safe to call when not initialised."""
    if ray.is_initialized():
        ray.shutdown()
