"""Distributed plumbing: named shardings, Ray start-up, virtual clusters, worker groups."""

from rl_core.distributed.actor_registry import (
    EnvironmentSpec,
    UnknownEnvironmentError,
    UnregisteredActorError,
    get_actor_environment,
    get_environment_spec,
    register_actor,
    register_environment,
)
from rl_core.distributed.named_sharding import NamedSharding
from rl_core.distributed.ray_init import init_ray, shutdown_ray
from rl_core.distributed.virtual_cluster import BundleLocation, PlacementGroupTimeoutError, RayVirtualCluster
from rl_core.distributed.worker_group import RayWorkerGroup, WorkerGroupError

__all__ = [
    "BundleLocation",
    "EnvironmentSpec",
    "NamedSharding",
    "PlacementGroupTimeoutError",
    "RayVirtualCluster",
    "RayWorkerGroup",
    "UnknownEnvironmentError",
    "UnregisteredActorError",
    "WorkerGroupError",
    "get_actor_environment",
    "get_environment_spec",
    "init_ray",
    "register_actor",
    "register_environment",
    "shutdown_ray",
]
