"""A group of Ray actors of one class, one per bundle of a `RayVirtualCluster`."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
from ray.actor import ActorHandle

from rl_core import venvs  # module import: rl_core.venvs itself imports rl_core.distributed
from rl_core.distributed.actor_registry import SYSTEM_ENV, get_actor_environment
from rl_core.distributed.named_sharding import NamedSharding
from rl_core.distributed.virtual_cluster import RayVirtualCluster
from rl_core.distributed.worker_initializer import (
    forget_worker_initializer,
    forget_worker_initializers_for_python,
    get_worker_initializer,
)

logger = logging.getLogger(__name__)


class WorkerGroupError(RuntimeError):
    """A worker failed; the message names its rank, class and method."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def _kill_quietly(handles: Sequence[ActorHandle]) -> None:
    for handle in handles:
        try:
            ray.kill(handle, no_restart=True)
        except Exception as exc:  # already dead or Ray shut down: nothing left to stop
            logger.debug("killing actor: %s", exc)


class RayWorkerGroup:
    """Spawns ``cluster.world_size()`` actors of class ``actor_fqn`` and dispatches calls to them.

    Each worker sees RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR
    and MASTER_PORT in its environment before its class is constructed. The class is
    imported and instantiated by a per-node `WorkerInitializer` running in the class's
    registered environment, so the driver never imports it.

    Args:
        cluster: the bundles to place workers in (worker ``r`` in bundle ``r``).
        actor_fqn: ``package.module.Class``, registered in `actor_registry`.
        sharding: named layout of the workers; default a 1-d ``dp`` axis over all of them.
        init_args, init_kwargs: constructor arguments for every worker. They cross into the
            worker's venv, so use plain types (or types of packages both sides have).
        env_vars: extra environment variables for the workers (and the initializers that
            import their class).
        name_prefix: when set, workers are named actors ``{name_prefix}-{rank}``.
        num_gpus_per_worker: GPUs per actor; default ``1/max_colocated_worker_groups`` on GPU
            clusters, 0 on CPU-only ones.
        single_venv: force (True) or forbid (False) the driver's interpreter for every worker;
            default from $RL_SINGLE_VENV.
    """

    def __init__(
        self,
        cluster: RayVirtualCluster,
        actor_fqn: str,
        sharding: NamedSharding | None = None,
        init_args: Sequence[Any] = (),
        init_kwargs: dict[str, Any] | None = None,
        env_vars: dict[str, str] | None = None,
        name_prefix: str = "",
        num_gpus_per_worker: float | None = None,
        single_venv: bool | None = None,
    ) -> None:
        world_size = cluster.world_size()
        if sharding is None:
            sharding = NamedSharding(np.arange(world_size), ["dp"])
        if sharding.size != world_size:
            raise ValueError(
                f"sharding {sharding} covers {sharding.size} ranks but the cluster has {world_size} bundles"
            )
        self.actor_fqn = actor_fqn
        self.sharding = sharding
        self.environment = get_actor_environment(actor_fqn)
        self._cluster = cluster
        self._num_gpus = self._gpus_per_worker(cluster, num_gpus_per_worker)
        self._workers: list[ActorHandle] = []
        # Held so the initializers, which own the workers, live at least as long as this group.
        self._initializers: list[ActorHandle] = []
        self._is_shut_down = False

        locations = cluster.get_bundle_locations()
        if self.environment == SYSTEM_ENV or venvs.is_single_venv_mode(single_venv):
            self.python_by_node: dict[str, str] = {}  # the cluster's default interpreter
        else:
            venv_by_node = venvs.ensure_venv_on_all_nodes(self.environment)
            self.python_by_node = {node: info.python for node, info in venv_by_node.items()}
            for info in venv_by_node.values():
                if info.built:  # initializers started from the replaced venv must not be reused
                    forget_worker_initializers_for_python(info.python)
        self.master_address, self.master_port = cluster.get_master_address_and_port()
        user_env = {str(k): str(v) for k, v in (env_vars or {}).items()}
        handle_refs: list[Any] = []
        initializers: list[ActorHandle] = []
        try:
            for loc in locations:
                worker_env = {
                    **user_env,
                    "RANK": str(loc.rank),
                    "WORLD_SIZE": str(world_size),
                    "LOCAL_RANK": str(loc.local_rank),
                    "LOCAL_WORLD_SIZE": str(loc.local_world_size),
                    "NODE_RANK": str(loc.node_rank),
                    "MASTER_ADDR": self.master_address,
                    "MASTER_PORT": str(self.master_port),
                }
                options: dict[str, Any] = {
                    "num_cpus": cluster.num_cpus_per_bundle / cluster.max_colocated_worker_groups,
                    "num_gpus": self._num_gpus,
                    "scheduling_strategy": cluster.scheduling_strategy_for_rank(loc.rank),
                    "runtime_env": self._runtime_env(loc.node_id, worker_env),
                }
                if name_prefix:
                    options["name"] = f"{name_prefix}-{loc.rank}"
                initializer = get_worker_initializer(
                    loc.node_id, self.python_by_node.get(loc.node_id), user_env
                )
                initializers.append(initializer)
                if initializer not in self._initializers:
                    self._initializers.append(initializer)
                handle_refs.append(
                    initializer.create_worker.remote(
                        actor_fqn, options, tuple(init_args), dict(init_kwargs or {})
                    )
                )
            self._workers = self.get_results(handle_refs, "actor creation")
            self.get_results([w.__ray_ready__.remote() for w in self._workers], "__init__")
        except BaseException:
            # The initializers outlive this group, so the actors they did create must be
            # killed here rather than dying with their owner.
            self._kill_created(handle_refs, initializers)
            self.shutdown()
            raise
        logger.info(
            "RayWorkerGroup %s: %d workers in environment %r (sharding %s)",
            actor_fqn,
            world_size,
            self.environment,
            sharding,
        )

    # ----------------------------------------------------------------- spawning

    @staticmethod
    def _gpus_per_worker(cluster: RayVirtualCluster, requested: float | None) -> float:
        if requested is None:
            return 1.0 / cluster.max_colocated_worker_groups if cluster.use_gpus else 0.0
        if requested < 0 or (not cluster.use_gpus and requested > 0):
            raise ValueError(
                f"num_gpus_per_worker={requested} is invalid for a cluster with use_gpus={cluster.use_gpus}"
            )
        if requested > 1:
            raise ValueError(f"num_gpus_per_worker={requested} exceeds the 1 GPU a bundle holds")
        return float(requested)

    def _runtime_env(self, node_id: str, env_vars: dict[str, str]) -> dict[str, Any]:
        runtime_env: dict[str, Any] = {"env_vars": env_vars}
        if node_id in self.python_by_node:
            runtime_env["py_executable"] = self.python_by_node[node_id]
        return runtime_env

    @staticmethod
    def _kill_created(handle_refs: list[Any], initializers: list[ActorHandle]) -> None:
        for ref, initializer in zip(handle_refs, initializers):
            try:
                handle = ray.get(ref, timeout=30)
            except ray.exceptions.RayActorError:
                forget_worker_initializer(initializer)  # it died; start a fresh one next time
                continue
            except Exception as exc:  # the creation call itself failed: no actor to kill
                logger.debug("actor creation failed: %s", exc)
                continue
            _kill_quietly([handle])

    # ----------------------------------------------------------------- properties

    @property
    def workers(self) -> list[ActorHandle]:
        return list(self._workers)

    @property
    def world_size(self) -> int:
        return self.sharding.size

    @property
    def cluster(self) -> RayVirtualCluster:
        return self._cluster

    # ----------------------------------------------------------------- results

    def get_results(
        self, refs: Sequence[Any], method_name: str = "", ranks: Sequence[int] | None = None
    ) -> list[Any]:
        """``ray.get`` of ``refs`` (from rank ``ranks[i]``, default ``i``), failing on the first
        worker error with that worker's rank in the message."""
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        position = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                index = position[ref]
                try:
                    results[index] = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    rank = ranks[index]
                    raise WorkerGroupError(
                        f"worker rank {rank} of {self.world_size} ({self.actor_fqn}) failed in "
                        f"{method_name or 'a call'}: {exc}",
                        rank=rank,
                    ) from exc
        return results

    def _method(self, rank: int, method_name: str) -> Any:
        try:
            return getattr(self._workers[rank], method_name)
        except AttributeError:
            raise AttributeError(f"actor class {self.actor_fqn} has no method {method_name!r}") from None

    def _require_workers(self) -> None:
        if self._is_shut_down or not self._workers:
            raise RuntimeError(f"RayWorkerGroup of {self.actor_fqn} has been shut down")

    # ----------------------------------------------------------------- dispatch

    def run_all_workers_single_data_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method_name(*args, **kwargs)`` on every worker; ObjectRefs in rank order."""
        self._require_workers()
        return [self._method(rank, method_name).remote(*args, **kwargs) for rank in range(self.world_size)]

    def run_all_workers_single_data(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method_name(*args, **kwargs)`` on every worker; results in rank order."""
        return self.get_results(
            self.run_all_workers_single_data_async(method_name, *args, **kwargs), method_name
        )

    def run_all_workers_multiple_data_async(
        self, method_name: str, data: Sequence[Any], common_kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Worker ``r`` gets ``method_name(data[r], **common_kwargs)``; ObjectRefs in rank order."""
        self._require_workers()
        if len(data) != self.world_size:
            raise ValueError(
                f"run_all_workers_multiple_data({method_name!r}): got {len(data)} items for {self.world_size} workers"
            )
        kwargs = common_kwargs or {}
        return [self._method(rank, method_name).remote(item, **kwargs) for rank, item in enumerate(data)]

    def run_all_workers_multiple_data(
        self, method_name: str, data: Sequence[Any], common_kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Worker ``r`` gets ``method_name(data[r], **common_kwargs)``; results in rank order."""
        return self.get_results(
            self.run_all_workers_multiple_data_async(method_name, data, common_kwargs), method_name
        )

    def _validate_sharded_axes(
        self,
        in_sharded_axes: Sequence[str],
        replicate_on_axes: Sequence[str],
        output_is_replicated: Sequence[str],
    ) -> None:
        names = self.sharding.names
        for label, axes in (
            ("in_sharded_axes", in_sharded_axes),
            ("replicate_on_axes", replicate_on_axes),
            ("output_is_replicated", output_is_replicated),
        ):
            unknown = [a for a in axes if a not in names]
            if unknown:
                raise ValueError(f"{label} names unknown axes {unknown}; sharding axes are {list(names)}")
            if len(set(axes)) != len(axes):
                raise ValueError(f"{label} repeats an axis: {list(axes)}")
        both = sorted(set(in_sharded_axes) & set(replicate_on_axes))
        missing = [a for a in names if a not in in_sharded_axes and a not in replicate_on_axes]
        if both or missing:
            raise ValueError(
                f"every sharding axis must be in exactly one of in_sharded_axes={list(in_sharded_axes)} and "
                f"replicate_on_axes={list(replicate_on_axes)}; in both: {both}, in neither: {missing}"
            )
        not_replicated = [a for a in output_is_replicated if a not in replicate_on_axes]
        if not_replicated:
            raise ValueError(
                f"output_is_replicated axes {not_replicated} are not in replicate_on_axes={list(replicate_on_axes)}: "
                "only workers that received the same data can return the same output"
            )

    def run_all_workers_sharded_data(
        self,
        method_name: str,
        data: Sequence[Any],
        in_sharded_axes: Sequence[str],
        replicate_on_axes: Sequence[str],
        output_is_replicated: Sequence[str] | None = None,
        common_kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Send each worker its shard of ``data`` and collect the results.

        ``data`` holds one payload per shard, ``prod(axis sizes of in_sharded_axes)`` of them,
        row-major in the order of ``in_sharded_axes``. Each worker calls
        ``method_name(payload, **common_kwargs)`` with the payload at its coordinates on those
        axes, so workers differing only along ``replicate_on_axes`` get the same payload.

        Results come back in shard order: row-major over ``in_sharded_axes`` and then over
        the replicated axes not in ``output_is_replicated``; along an ``output_is_replicated``
        axis only coordinate 0's result is kept. With every replicated axis listed there, the
        result list is one entry per payload, aligned with ``data``.
        """
        self._require_workers()
        output_axes = list(output_is_replicated or [])
        self._validate_sharded_axes(in_sharded_axes, replicate_on_axes, output_axes)
        shard_shape = tuple(self.sharding.get_axis_size(a) for a in in_sharded_axes)
        if len(data) != math.prod(shard_shape):
            sizes = " x ".join(f"{a}={s}" for a, s in zip(in_sharded_axes, shard_shape)) or "no sharded axes"
            raise ValueError(
                f"run_all_workers_sharded_data({method_name!r}): expected {math.prod(shard_shape)} payloads "
                f"({sizes}), got {len(data)}"
            )
        # One object-store copy per payload, however many replicas read it.
        payload_refs = [ray.put(item) for item in data]
        kwargs = common_kwargs or {}
        kept_axes = [*in_sharded_axes, *(a for a in replicate_on_axes if a not in output_axes)]
        refs, returned = [], []
        for rank in range(self.world_size):
            coords = self.sharding.get_worker_coords(rank)
            shard_index = (
                int(np.ravel_multi_index([coords[a] for a in in_sharded_axes], shard_shape))
                if shard_shape
                else 0
            )
            refs.append(self._method(rank, method_name).remote(payload_refs[shard_index], **kwargs))
            if all(coords[a] == 0 for a in output_axes):
                returned.append((tuple(coords[a] for a in kept_axes), rank))
        results = self.get_results(refs, method_name)
        return [results[rank] for _, rank in sorted(returned)]

    # ----------------------------------------------------------------- teardown

    def shutdown(self, cleanup_method: str | None = None, timeout_s: float = 60.0) -> bool:
        """Call ``cleanup_method`` on every worker (if given, waiting up to ``timeout_s``), then
        kill the workers. Returns False if the cleanup failed or timed
        out (the actors are killed regardless). Idempotent."""
        if self._is_shut_down:
            return True
        self._is_shut_down = True
        clean = True
        if cleanup_method and self._workers:
            refs = [self._method(rank, cleanup_method).remote() for rank in range(len(self._workers))]
            ready, not_ready = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            if not_ready:
                clean = False
                logger.warning(
                    "%s.%s did not finish within %g s on ranks %s; killing anyway",
                    self.actor_fqn,
                    cleanup_method,
                    timeout_s,
                    [refs.index(r) for r in not_ready],
                )
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as exc:
                    clean = False
                    logger.warning(
                        "%s.%s failed on rank %d: %s", self.actor_fqn, cleanup_method, refs.index(ref), exc
                    )
        _kill_quietly(self._workers)
        self._workers = []
        self._initializers = []
        return clean
