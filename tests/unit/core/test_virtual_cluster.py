"""RayVirtualCluster on the real local test cluster (8 logical CPUs, no GPU)."""

from __future__ import annotations

import pytest
import ray
from ray.util.placement_group import PlacementGroup, placement_group_table

from rl_core.distributed.ray_init import init_ray
from rl_core.distributed.virtual_cluster import PlacementGroupTimeoutError, RayVirtualCluster

pytestmark = pytest.mark.ray


def _state(pg: PlacementGroup) -> str:
    return str(placement_group_table(pg)["state"])


def test_init_ray_is_idempotent(ray_cluster: None) -> None:
    init_ray(num_cpus=2)  # already initialised by the fixture: must not restart or resize
    assert ray.is_initialized()
    assert ray.cluster_resources()["CPU"] == 8.0


def test_cpu_bundles_create_locate_and_shut_down(ray_cluster: None) -> None:
    cluster = RayVirtualCluster([2], use_gpus=False, name="rl-test-cpu", num_cpus_per_bundle=1.5)
    try:
        assert cluster.world_size() == 2
        assert cluster.node_count() == 1
        (pg,) = cluster.get_placement_groups()
        assert pg.bundle_specs == [{"CPU": 1.5}, {"CPU": 1.5}]
        assert _state(pg) == "CREATED"

        (node,) = [n for n in ray.nodes() if n["Alive"]]
        locations = cluster.get_bundle_locations()
        assert [(b.rank, b.bundle_index, b.local_rank) for b in locations] == [(0, 0, 0), (1, 1, 1)]
        assert {(b.node_id, b.node_ip, b.node_rank, b.local_world_size) for b in locations} == {
            (node["NodeID"], node["NodeManagerAddress"], 0, 2)
        }

        address, port = cluster.get_master_address_and_port()
        assert address == node["NodeManagerAddress"]
        assert 1 <= port <= 65535
    finally:
        cluster.shutdown()
    assert _state(pg) == "REMOVED"
    cluster.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="has been shut down"):
        cluster.get_placement_groups()


def test_per_node_and_unified_groups(ray_cluster: None) -> None:
    per_node = RayVirtualCluster([1, 2], use_gpus=False, num_cpus_per_bundle=0.5)
    unified = RayVirtualCluster([1, 2], use_gpus=False, num_cpus_per_bundle=0.5, unified_placement_group=True)
    try:
        assert [pg.bundle_count for pg in per_node.get_placement_groups()] == [1, 2]
        assert [(b.placement_group_index, b.bundle_index) for b in per_node.get_bundle_locations()] == [
            (0, 0),
            (1, 0),
            (1, 1),
        ]
        assert per_node.placement_group_strategy == "STRICT_PACK"
        assert [pg.bundle_count for pg in unified.get_placement_groups()] == [3]
        assert unified.placement_group_strategy == "PACK"
        assert [b.local_rank for b in unified.get_bundle_locations()] == [0, 1, 2]
        assert unified.world_size() == per_node.world_size() == 3
    finally:
        per_node.shutdown()
        unified.shutdown()


def test_unsatisfiable_request_names_requested_and_available_resources(ray_cluster: None) -> None:
    with pytest.raises(PlacementGroupTimeoutError) as info:
        RayVirtualCluster([64], use_gpus=False, name="rl-test-infeasible", placement_group_timeout_s=3)
    message = str(info.value)
    assert "'rl-test-infeasible'" in message
    assert "not ready after 3 s" in message
    assert "[64 x {'CPU': 1.0}]" in message
    assert "in total {'CPU': 64.0}" in message
    assert "Cluster resources: {'CPU': 8.0," in message
    # The pending group was removed rather than left to grab resources later.
    states = [t["state"] for t in placement_group_table().values() if t["name"] == "rl-test-infeasible-pg0"]
    assert states == ["REMOVED"]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"bundle_ct_per_node_list": []}, "non-empty list of positive ints"),
        ({"bundle_ct_per_node_list": [2, 0]}, r"got \[2, 0\]"),
        (
            {"bundle_ct_per_node_list": [9], "use_gpus": True},
            "9 GPU bundles on one node, but num_gpus_per_node=8",
        ),
        ({"bundle_ct_per_node_list": [1], "max_colocated_worker_groups": 0}, "max_colocated_worker_groups"),
        (
            {"bundle_ct_per_node_list": [1], "placement_group_strategy": "RANDOM"},
            r"'RANDOM'; valid: \['PACK', 'SPREAD', 'STRICT_PACK', 'STRICT_SPREAD'\]",
        ),
    ],
)
def test_invalid_arguments(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        RayVirtualCluster(**kwargs)
