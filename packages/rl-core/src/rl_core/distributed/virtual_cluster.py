"""A slice of the Ray cluster reserved as placement-group bundles, one bundle per worker."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class PlacementGroupTimeoutError(RuntimeError):
    """The requested bundles could not be reserved in time (the cluster is too small or busy)."""


@dataclass(frozen=True)
class BundleLocation:
    """Where the worker of global rank ``rank`` lives."""

    rank: int
    placement_group_index: int
    bundle_index: int
    node_id: str
    node_ip: str
    node_rank: int  # index of the node, in order of the first rank placed on it
    local_rank: int  # index among this cluster's bundles on the same node
    local_world_size: int  # this cluster's bundles on the same node


def _user_resources(resources: dict[str, float]) -> dict[str, float]:
    # Ray lists per-node ("node:<ip>") and per-placement-group ("CPU_group_...") entries too;
    # they are noise in an error message.
    return {k: v for k, v in sorted(resources.items()) if ":" not in k and "_group_" not in k}


def _find_free_port_here() -> tuple[str, int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port = int(sock.getsockname()[1])
    return ray.util.get_node_ip_address(), port


class RayVirtualCluster:
    """Placement groups reserving ``sum(bundle_ct_per_node_list)`` bundles, one per worker.

    Args:
        bundle_ct_per_node_list: bundles wanted on each node, e.g. ``[8, 8]`` for two nodes.
        use_gpus: bundles hold one GPU each (``{"CPU": n, "GPU": 1}``); else CPU only.
        num_gpus_per_node: upper bound for a per-node entry when ``use_gpus``.
        max_colocated_worker_groups: how many worker groups share the bundles; each of their
            actors takes ``1/max_colocated_worker_groups`` of a bundle's GPU and CPU.
        name: prefix of the placement-group names (for `ray status` and debugging).
        placement_group_strategy: Ray strategy for each placement group. Default: ``STRICT_PACK``
            for per-node groups (an entry's bundles share a node), ``PACK`` for a unified group.
        num_cpus_per_bundle: CPUs reserved per bundle.
        placement_group_timeout_s: how long to wait for the reservation before giving up.
        unified_placement_group: one placement group for all bundles (Ray chooses the nodes)
            instead of one per entry of ``bundle_ct_per_node_list``.
    """

    def __init__(
        self,
        bundle_ct_per_node_list: list[int],
        use_gpus: bool = True,
        num_gpus_per_node: int = 8,
        max_colocated_worker_groups: int = 1,
        name: str = "",
        placement_group_strategy: str | None = None,
        num_cpus_per_bundle: float = 1,
        placement_group_timeout_s: float = 180,
        unified_placement_group: bool = False,
    ) -> None:
        counts = list(bundle_ct_per_node_list)
        if not counts or not all(isinstance(c, int) and c > 0 for c in counts):
            raise ValueError(
                f"bundle_ct_per_node_list must be a non-empty list of positive ints, got {bundle_ct_per_node_list!r}"
            )
        if use_gpus and max(counts) > num_gpus_per_node:
            raise ValueError(
                f"bundle_ct_per_node_list={counts} asks for {max(counts)} GPU bundles on one node, "
                f"but num_gpus_per_node={num_gpus_per_node}"
            )
        if not isinstance(max_colocated_worker_groups, int) or max_colocated_worker_groups < 1:
            raise ValueError(
                f"max_colocated_worker_groups must be an int >= 1, got {max_colocated_worker_groups!r}"
            )
        if num_cpus_per_bundle < 0 or placement_group_timeout_s <= 0:
            raise ValueError(
                f"num_cpus_per_bundle must be >= 0 and placement_group_timeout_s > 0, got "
                f"{num_cpus_per_bundle} and {placement_group_timeout_s}"
            )
        strategy = placement_group_strategy or ("PACK" if unified_placement_group else "STRICT_PACK")
        if strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"unknown placement_group_strategy {strategy!r}; valid: {list(PLACEMENT_STRATEGIES)}"
            )
        if not ray.is_initialized():
            raise RuntimeError("RayVirtualCluster needs Ray: call rl_core.distributed.init_ray() first")

        self.bundle_ct_per_node_list = counts
        self.use_gpus = use_gpus
        self.num_gpus_per_node = num_gpus_per_node
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self.name = name
        self.placement_group_strategy = strategy
        self.num_cpus_per_bundle = float(num_cpus_per_bundle)
        self.placement_group_timeout_s = float(placement_group_timeout_s)
        self.unified_placement_group = unified_placement_group
        self._placement_groups: list[PlacementGroup] = []
        self._bundle_locations: list[BundleLocation] = []
        self._create_placement_groups()

    # ----------------------------------------------------------------- reservation

    @property
    def bundle_resources(self) -> dict[str, float]:
        resources = {"CPU": self.num_cpus_per_bundle}
        if self.use_gpus:
            resources["GPU"] = 1.0
        return resources

    def _group_sizes(self) -> list[int]:
        return (
            [sum(self.bundle_ct_per_node_list)]
            if self.unified_placement_group
            else self.bundle_ct_per_node_list
        )

    def _create_placement_groups(self) -> None:
        for index, count in enumerate(self._group_sizes()):
            self._placement_groups.append(
                placement_group(
                    [dict(self.bundle_resources) for _ in range(count)],
                    strategy=self.placement_group_strategy,
                    name=f"{self.name}-pg{index}" if self.name else "",
                )
            )
        try:
            ray.get([pg.ready() for pg in self._placement_groups], timeout=self.placement_group_timeout_s)
        except ray.exceptions.GetTimeoutError:
            message = self._reservation_failure_message()
            self.shutdown()
            raise PlacementGroupTimeoutError(message) from None
        self._bundle_locations = self._locate_bundles()
        logger.info(
            "RayVirtualCluster %r: %d bundles of %s on %d node(s)",
            self.name,
            self.world_size(),
            self.bundle_resources,
            len({b.node_id for b in self._bundle_locations}),
        )

    def _reservation_failure_message(self) -> str:
        sizes = self._group_sizes()
        total = {k: v * sum(sizes) for k, v in self.bundle_resources.items()}
        groups = ", ".join(f"{n} x {self.bundle_resources}" for n in sizes)
        return (
            f"RayVirtualCluster {self.name!r}: placement groups not ready after "
            f"{self.placement_group_timeout_s:g} s. Requested {len(sizes)} placement group(s) with "
            f"strategy {self.placement_group_strategy}: [{groups}], in total {total}. "
            f"Cluster resources: {_user_resources(ray.cluster_resources())}; currently available: "
            f"{_user_resources(ray.available_resources())}. Ask for fewer bundles or resources, "
            f"add nodes, or free the resources other placement groups hold."
        )

    def _locate_bundles(self) -> list[BundleLocation]:
        node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        placed: list[tuple[int, int, str]] = []
        for pg_index, pg in enumerate(self._placement_groups):
            bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
            placed += [(pg_index, b, bundle_nodes[b]) for b in range(pg.bundle_count)]
        node_order: dict[str, int] = {}
        for _, _, node_id in placed:
            node_order.setdefault(node_id, len(node_order))
        if self.unified_placement_group:
            # Ray may interleave nodes within one group; contiguous ranks per node keep
            # intra-node groups (tp) on fast links.
            placed.sort(key=lambda item: node_order[item[2]])
        per_node = {node_id: sum(1 for *_, n in placed if n == node_id) for node_id in node_order}
        seen: dict[str, int] = {}
        locations = []
        for rank, (pg_index, bundle_index, node_id) in enumerate(placed):
            local_rank = seen.get(node_id, 0)
            seen[node_id] = local_rank + 1
            locations.append(
                BundleLocation(
                    rank=rank,
                    placement_group_index=pg_index,
                    bundle_index=bundle_index,
                    node_id=node_id,
                    node_ip=node_ips.get(node_id, ""),
                    node_rank=node_order[node_id],
                    local_rank=local_rank,
                    local_world_size=per_node[node_id],
                )
            )
        return locations

    # ----------------------------------------------------------------- queries

    def _require_alive(self) -> None:
        if not self._placement_groups:
            raise RuntimeError(f"RayVirtualCluster {self.name!r} has been shut down")

    def world_size(self) -> int:
        return sum(self.bundle_ct_per_node_list)

    def node_count(self) -> int:
        """Nodes requested (entries of ``bundle_ct_per_node_list``)."""
        return len(self.bundle_ct_per_node_list)

    def get_placement_groups(self) -> list[PlacementGroup]:
        self._require_alive()
        return list(self._placement_groups)

    def get_bundle_locations(self) -> list[BundleLocation]:
        """One entry per global rank, in rank order."""
        self._require_alive()
        return list(self._bundle_locations)

    def scheduling_strategy_for_rank(self, rank: int) -> PlacementGroupSchedulingStrategy:
        location = self.get_bundle_locations()[rank]
        return PlacementGroupSchedulingStrategy(
            placement_group=self._placement_groups[location.placement_group_index],
            placement_group_bundle_index=location.bundle_index,
            placement_group_capture_child_tasks=True,
        )

    def get_master_address_and_port(self) -> tuple[str, int]:
        """IP of the node hosting rank 0's bundle and a port that is free on that node.

        The port is probed by a zero-CPU task inside that bundle, so it is free where the
        rendezvous happens rather than on the driver. Each call probes again (colocated
        worker groups need distinct ports).
        """
        probe: Any = ray.remote(num_cpus=0, max_retries=0)(_find_free_port_here)
        address, port = ray.get(
            probe.options(scheduling_strategy=self.scheduling_strategy_for_rank(0)).remote()
        )
        return str(address), int(port)

    def shutdown(self) -> None:
        """Release the placement groups (actors placed in them die with them). Idempotent."""
        for pg in self._placement_groups:
            try:
                remove_placement_group(pg)
            except Exception as exc:  # already removed, or Ray is gone: nothing left to free
                logger.debug("removing placement group %s: %s", pg.id, exc)
        self._placement_groups = []
        self._bundle_locations = []

    def __repr__(self) -> str:
        return (
            f"RayVirtualCluster(name={self.name!r}, bundles={self.bundle_ct_per_node_list}, "
            f"bundle={self.bundle_resources}, colocated={self.max_colocated_worker_groups}, "
            f"strategy={self.placement_group_strategy})"
        )
