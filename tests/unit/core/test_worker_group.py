"""RayWorkerGroup with real actors on the local test cluster (workers in the driver's venv)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import ray
from workers_for_tests import DISTRIBUTED_ENV_KEYS, SYSTEM_WORKER_FQN, WORKER_ENV

from rl_core.distributed.actor_registry import UnregisteredActorError, register_actor
from rl_core.distributed.named_sharding import NamedSharding
from rl_core.distributed.virtual_cluster import RayVirtualCluster
from rl_core.distributed.worker_group import RayWorkerGroup, WorkerGroupError

pytestmark = pytest.mark.ray

register_actor(SYSTEM_WORKER_FQN, "system")


@pytest.fixture
def cpu_cluster_2(ray_cluster: None) -> Iterator[RayVirtualCluster]:
    cluster = RayVirtualCluster([2], use_gpus=False, name="rl-test-wg2")
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def group_dp2_tp2(ray_cluster: None) -> Iterator[tuple[RayWorkerGroup, list[list[int]]]]:
    # Transposed layout: rank order differs from (dp, tp) order, so ordering bugs show.
    layout = [[0, 2], [1, 3]]
    cluster = RayVirtualCluster([4], use_gpus=False, name="rl-test-wg4", num_cpus_per_bundle=0.5)
    group = RayWorkerGroup(
        cluster, SYSTEM_WORKER_FQN, sharding=NamedSharding(layout, ["dp", "tp"]), env_vars=WORKER_ENV
    )
    yield group, layout
    group.shutdown()
    cluster.shutdown()


def test_workers_see_distributed_env_and_can_rendezvous(cpu_cluster_2: RayVirtualCluster) -> None:
    group = RayWorkerGroup(cpu_cluster_2, SYSTEM_WORKER_FQN, init_kwargs={"tag": "t"}, env_vars=WORKER_ENV)
    try:
        (node,) = [n for n in ray.nodes() if n["Alive"]]
        reports = group.run_all_workers_single_data("report_env")
        for rank, report in enumerate(reports):
            expected = {
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": "2",
                "NODE_RANK": "0",
                "MASTER_ADDR": node["NodeManagerAddress"],
                "MASTER_PORT": str(group.master_port),
            }
            assert {k: report[k] for k in DISTRIBUTED_ENV_KEYS} == expected
            assert report["tag"] == "t"
        assert group.sharding == NamedSharding([0, 1], ["dp"])
        # The variables are usable: a real gloo rendezvous sums rank + 1 over both workers.
        assert group.run_all_workers_single_data("all_reduce_rank_sum") == [3.0, 3.0]
        refs = group.run_all_workers_single_data_async("echo", "x", offset=5)
        assert ray.get(refs) == [{"rank": r, "payload": "x", "offset": 5} for r in range(2)]
        assert group.run_all_workers_multiple_data("echo", ["a", "b"], common_kwargs={"offset": 1}) == [
            {"rank": 0, "payload": "a", "offset": 1},
            {"rank": 1, "payload": "b", "offset": 1},
        ]
        with pytest.raises(ValueError, match="got 3 items for 2 workers"):
            group.run_all_workers_multiple_data("echo", [1, 2, 3])
    finally:
        assert group.shutdown(cleanup_method="cleanup") is True
    with pytest.raises(RuntimeError, match="has been shut down"):
        group.run_all_workers_single_data("report_env")


CoordFn = Callable[[int, int], Any]


def _expected_sharded(
    layout: list[list[int]], data: list, shard_index: CoordFn, keep: CoordFn, order: CoordFn
) -> list[dict]:
    """Plain-loop reference over (dp, tp): which payload each worker gets, whether its result
    is kept, and its position in the result list."""
    entries = []
    for dp, tp in itertools.product(range(2), range(2)):
        if keep(dp, tp):
            entries.append((order(dp, tp), {"rank": layout[dp][tp], "payload": data[shard_index(dp, tp)]}))
    return [entry for _, entry in sorted(entries, key=lambda e: e[0])]


def test_sharded_along_dp_replicated_along_tp(group_dp2_tp2: tuple[RayWorkerGroup, list[list[int]]]) -> None:
    group, layout = group_dp2_tp2
    data = [[1, 2], [3, 4]]  # one payload per dp shard
    deduped = group.run_all_workers_sharded_data(
        "echo", data, in_sharded_axes=["dp"], replicate_on_axes=["tp"], output_is_replicated=["tp"]
    )
    assert [{k: r[k] for k in ("rank", "payload")} for r in deduped] == _expected_sharded(
        layout, data, lambda dp, tp: dp, lambda dp, tp: tp == 0, lambda dp, tp: (dp,)
    )
    assert [r["rank"] for r in deduped] == [0, 1]  # (dp0, tp0) and (dp1, tp0) in the transposed layout

    every = group.run_all_workers_sharded_data(
        "echo", data, in_sharded_axes=["dp"], replicate_on_axes=["tp"], common_kwargs={"offset": 7}
    )
    assert [{k: r[k] for k in ("rank", "payload")} for r in every] == _expected_sharded(
        layout, data, lambda dp, tp: dp, lambda dp, tp: True, lambda dp, tp: (dp, tp)
    )
    assert {r["offset"] for r in every} == {7}


def test_sharded_along_both_axes_in_given_axis_order(
    group_dp2_tp2: tuple[RayWorkerGroup, list[list[int]]],
) -> None:
    group, layout = group_dp2_tp2
    data = ["tp0dp0", "tp0dp1", "tp1dp0", "tp1dp1"]  # row-major over ["tp", "dp"]
    results = group.run_all_workers_sharded_data(
        "echo", data, in_sharded_axes=["tp", "dp"], replicate_on_axes=[]
    )
    assert [{k: r[k] for k in ("rank", "payload")} for r in results] == _expected_sharded(
        layout, data, lambda dp, tp: 2 * tp + dp, lambda dp, tp: True, lambda dp, tp: (tp, dp)
    )
    assert [r["payload"] for r in results] == data  # aligned with the input shards


def test_fully_replicated_data(group_dp2_tp2: tuple[RayWorkerGroup, list[list[int]]]) -> None:
    group, _ = group_dp2_tp2
    results = group.run_all_workers_sharded_data(
        "echo",
        [np.arange(3)],
        in_sharded_axes=[],
        replicate_on_axes=["dp", "tp"],
        output_is_replicated=["dp", "tp"],
    )
    assert len(results) == 1 and results[0]["rank"] == 0
    np.testing.assert_array_equal(results[0]["payload"], np.arange(3))


@pytest.mark.parametrize(
    ("sharded", "replicated", "output", "data_len", "pattern"),
    [
        (["dp"], ["dp", "tp"], None, 2, r"in both: \['dp'\], in neither: \[\]"),
        (["dp"], [], None, 2, r"in both: \[\], in neither: \['tp'\]"),
        (
            ["dp", "pp"],
            ["tp"],
            None,
            2,
            r"in_sharded_axes names unknown axes \['pp'\]; sharding axes are \['dp', 'tp'\]",
        ),
        (["dp"], ["tp"], ["dp"], 2, r"output_is_replicated axes \['dp'\] are not in replicate_on_axes"),
        (["dp"], ["tp"], None, 3, r"expected 2 payloads \(dp=2\), got 3"),
    ],
)
def test_sharded_dispatch_rejects_bad_axes(
    group_dp2_tp2: tuple[RayWorkerGroup, list[list[int]]],
    sharded: list[str],
    replicated: list[str],
    output: list[str] | None,
    data_len: int,
    pattern: str,
) -> None:
    group, _ = group_dp2_tp2
    with pytest.raises(ValueError, match=pattern):
        group.run_all_workers_sharded_data("echo", list(range(data_len)), sharded, replicated, output)


def test_worker_errors_name_the_rank(group_dp2_tp2: tuple[RayWorkerGroup, list[list[int]]]) -> None:
    group, _ = group_dp2_tp2
    with pytest.raises(
        WorkerGroupError,
        match=r"worker rank 3 of 4 \(workers_for_tests.EnvReportingWorker\) failed in fail_on",
    ) as info:
        group.run_all_workers_single_data("fail_on", 3)
    assert info.value.rank == 3
    assert "deliberate failure on rank 3" in str(info.value)
    with pytest.raises(AttributeError, match="EnvReportingWorker has no method 'no_such_method'"):
        group.run_all_workers_single_data("no_such_method")
    assert group.run_all_workers_single_data("fail_on", -1) == [0, 1, 2, 3]  # the group survives


def test_constructor_failure_names_rank_and_frees_the_bundles(cpu_cluster_2: RayVirtualCluster) -> None:
    with pytest.raises(WorkerGroupError, match=r"worker rank 1 of 2 .* failed in __init__") as info:
        RayWorkerGroup(cpu_cluster_2, SYSTEM_WORKER_FQN, init_kwargs={"fail_on_rank": 1}, env_vars=WORKER_ENV)
    assert "constructor told to fail on rank 1" in str(info.value)
    # Rank 0 was constructed fine but killed with its group: a task needing bundle 0's whole
    # CPU can run there. (The timeout only bounds a hang if the actor had leaked.)
    needs_whole_bundle = ray.remote(num_cpus=1)(lambda: "ran")
    strategy = cpu_cluster_2.scheduling_strategy_for_rank(0)
    assert ray.get(needs_whole_bundle.options(scheduling_strategy=strategy).remote(), timeout=300) == "ran"


def test_colocated_groups_share_bundles(ray_cluster: None) -> None:
    cluster = RayVirtualCluster([1], use_gpus=False, max_colocated_worker_groups=2, name="rl-test-coloc")
    groups = []
    try:
        # The bundle holds 1 CPU; each actor asks for 1/2, so both groups fit in the same bundle.
        groups = [RayWorkerGroup(cluster, SYSTEM_WORKER_FQN, env_vars=WORKER_ENV) for _ in range(2)]
        (pg,) = cluster.get_placement_groups()
        for group in groups:
            infos = group.run_all_workers_single_data("interpreter")
            assert [i["placement_group_id"] for i in infos] == [pg.id.hex()]
    finally:
        for group in groups:
            group.shutdown()
        cluster.shutdown()


def test_unregistered_class_is_rejected_before_spawning(cpu_cluster_2: RayVirtualCluster) -> None:
    with pytest.raises(
        UnregisteredActorError, match=r"'workers_for_tests.NotRegistered' is not registered.*register_actor"
    ):
        RayWorkerGroup(cpu_cluster_2, "workers_for_tests.NotRegistered", env_vars=WORKER_ENV)


def test_missing_class_is_reported_with_the_interpreter_that_looked(cpu_cluster_2: RayVirtualCluster) -> None:
    register_actor("workers_for_tests.DoesNotExist", "system")
    with pytest.raises(WorkerGroupError, match=r"worker rank 0 of 2 .* failed in actor creation") as info:
        RayWorkerGroup(cpu_cluster_2, "workers_for_tests.DoesNotExist", env_vars=WORKER_ENV)
    assert "module 'workers_for_tests'" in str(info.value)
    assert "has no attribute 'DoesNotExist'" in str(info.value)


def test_sharding_must_cover_the_cluster(cpu_cluster_2: RayVirtualCluster) -> None:
    with pytest.raises(ValueError, match="covers 4 ranks but the cluster has 2 bundles"):
        RayWorkerGroup(
            cpu_cluster_2, SYSTEM_WORKER_FQN, sharding=NamedSharding.from_axis_sizes({"dp": 2, "tp": 2})
        )
