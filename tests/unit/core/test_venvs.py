"""Isolated worker venvs: the registry, real uv builds (offline, from uv's cache), locking, reuse."""

from __future__ import annotations

import dataclasses
import fcntl
import importlib.metadata
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from workers_for_tests import ISOLATED_WORKER_FQN, SYSTEM_WORKER_FQN, WORKER_ENV

from rl_core.distributed.actor_registry import (
    UnknownEnvironmentError,
    UnregisteredActorError,
    get_actor_environment,
    get_environment_spec,
    register_actor,
    register_environment,
)
from rl_core.distributed.virtual_cluster import RayVirtualCluster
from rl_core.distributed.worker_group import RayWorkerGroup
from rl_core.venvs import (
    MARKER_NAME,
    VenvBuildError,
    build_venv,
    ensure_venv,
    find_workspace_root,
    get_actor_python_executable,
    plan_venv,
    shared_distribution_pins,
    venv_lock_path,
)

ISOLATED_ENV = "rl-test-isolated"  # rl-core from the workspace, with ray + torch pinned to ours
TINY_ENV = "rl-test-tiny"  # one small pinned wheel: for the builder mechanics

register_actor(SYSTEM_WORKER_FQN, "system")
register_environment(TINY_ENV, [], ["msgpack"], replace=True)


@pytest.fixture(autouse=True)
def offline_uv(monkeypatch: pytest.MonkeyPatch) -> None:
    # Everything comes from uv's cache (hardlinked): no registry traffic in tests.
    monkeypatch.setenv("UV_OFFLINE", "1")


@pytest.fixture(scope="module")
def isolated_venv_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A venv root holding the isolated environment, built once for the module."""
    root = tmp_path_factory.mktemp("rl-venvs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RL_VENV_DIR", str(root))
        patch.setenv("UV_OFFLINE", "1")
        register_environment(ISOLATED_ENV, ["rl-core"], replace=True)
        register_actor(ISOLATED_WORKER_FQN, ISOLATED_ENV, replace=True)
        started = time.monotonic()
        info = ensure_venv(ISOLATED_ENV, force_rebuild=False)
        assert info.built
        sys.stderr.write(
            f"\n[test_venvs] isolated venv (rl-core, torch, ray) built in {time.monotonic() - started:.1f} s\n"
        )
        yield root


# --------------------------------------------------------------------------- registry


def test_registry_knows_our_backends_and_rejects_unknown_names() -> None:
    assert get_actor_environment("rl_vllm.worker.VllmGenerationWorker") == "vllm"
    assert get_actor_environment("rl_dtensor.worker.DTensorPolicyWorker") == "dtensor"
    assert get_actor_environment("rl_megatron.worker.MegatronPolicyWorker") == "megatron"
    assert get_actor_environment("rl_envs.math.MathEnvironment") == "system"
    assert get_environment_spec("vllm").packages == ("rl-vllm",)
    with pytest.raises(
        UnregisteredActorError,
        match=r"'pkg.mod.Missing' is not registered.*register_actor\('pkg.mod.Missing'",
    ):
        get_actor_environment("pkg.mod.Missing")
    with pytest.raises(
        UnknownEnvironmentError, match=r"unknown environment 'dtensr'; registered environments: \[.*'dtensor'"
    ):
        register_actor("pkg.mod.Cls", "dtensr")
    with pytest.raises(ValueError, match="already registered to environment 'vllm'; pass replace=True"):
        register_actor("rl_vllm.worker.VllmGenerationWorker", "system")
    with pytest.raises(ValueError, match="fully-qualified"):
        register_actor("NoModule", "system")
    with pytest.raises(ValueError, match="packages must be a list of non-empty strings"):
        register_environment("broken", "rl-core")  # type: ignore[arg-type]


def test_get_actor_python_executable_modes(isolated_venv_root: Path) -> None:
    assert get_actor_python_executable(SYSTEM_WORKER_FQN, single_venv=False) == sys.executable
    assert get_actor_python_executable(ISOLATED_WORKER_FQN, single_venv=True) == sys.executable
    python = get_actor_python_executable(ISOLATED_WORKER_FQN, single_venv=False)
    assert python == str(plan_venv(ISOLATED_ENV).venv_dir() / "bin" / "python")
    assert Path(python).parent.parent.parent == isolated_venv_root
    with pytest.raises(UnregisteredActorError, match=r"'pkg\.mod\.Unknown'"):
        get_actor_python_executable("pkg.mod.Unknown", single_venv=False)


# --------------------------------------------------------------------------- plans


def test_plan_installs_workspace_closure_pinned_to_driver_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels /extra/wheels")
    register_environment("rl-test-envs", ["rl-envs[reward-model]"], ["math-verify"], replace=True)
    root = find_workspace_root()
    assert root is not None and (root / "packages" / "rl-envs" / "pyproject.toml").is_file()
    plan = plan_venv("rl-test-envs")
    # rl-envs depends on rl-core: both come from the checkout, never from the registry.
    assert plan.install_args == (
        "-e",
        str(root / "packages" / "rl-core"),
        "-e",
        f"{root / 'packages' / 'rl-envs'}[reward-model]",
        "math-verify",
    )
    expected_pins = {
        f"{name}=={importlib.metadata.version(name)}"
        for name in ("torch", "ray", "numpy", "msgpack", "pydantic", "pyyaml")
    }
    assert set(plan.constraints) == expected_pins == set(shared_distribution_pins())
    assert plan.find_links == ("/opt/wheels", "/extra/wheels")

    registry_plan = plan_venv("rl-test-envs", workspace_root=None)
    rl_envs_version = importlib.metadata.version("rl-envs")
    assert registry_plan.install_args == (f"rl-envs[reward-model]=={rl_envs_version}", "math-verify")
    assert registry_plan.spec_hash != plan.spec_hash

    register_environment("rl-test-envs", ["rl-envs"], replace=True)
    assert plan_venv("rl-test-envs").spec_hash != plan.spec_hash  # a new spec gets a new venv


def test_plan_rejects_packages_outside_the_workspace() -> None:
    register_environment("rl-test-bad", ["not-a-workspace-package"], replace=True)
    with pytest.raises(
        VenvBuildError, match=r"'not-a-workspace-package' is not in the workspace .*\['rl-algos', 'rl-core'"
    ):
        plan_venv("rl-test-bad")


# --------------------------------------------------------------------------- building


def test_build_reuse_and_rebuild_of_incomplete_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RL_VENV_DIR", str(tmp_path))
    plan = plan_venv(TINY_ENV)
    first = build_venv(plan)
    assert first.built and Path(first.python).is_file()
    marker = json.loads((Path(first.venv_dir) / MARKER_NAME).read_text())
    assert (marker["spec_hash"], marker["build_id"]) == (plan.spec_hash, first.build_id)
    version = subprocess.run(
        [first.python, "-c", "import importlib.metadata as m; print(m.version('msgpack'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert version == importlib.metadata.version("msgpack")  # pinned to the driver's version

    again = build_venv(plan)
    assert not again.built and again.build_id == first.build_id

    (Path(first.venv_dir) / MARKER_NAME).unlink()  # as if the first build died half-way
    rebuilt = build_venv(plan)
    assert rebuilt.built and rebuilt.build_id != first.build_id

    forced = build_venv(plan, rebuild_id="request-1")
    assert forced.built and forced.build_id == "request-1"
    assert not build_venv(plan, rebuild_id="request-1").built  # that request is already served


def test_failed_build_reports_command_and_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RL_VENV_DIR", str(tmp_path))
    missing = tmp_path / "no-such-project"
    register_environment("rl-test-failing", [], [str(missing)], replace=True)
    plan = plan_venv("rl-test-failing")
    with pytest.raises(VenvBuildError) as info:
        build_venv(plan)
    message = str(info.value)
    assert "building venv for environment 'rl-test-failing' failed (exit" in message
    assert "command: " in message and " pip install " in message and str(missing) in message
    assert "stderr (last 40 lines):" in message and "not found" in message.lower()
    assert not plan.venv_dir().exists()  # no half-built venv left behind


_CHILD_BUILDER = """
import dataclasses, json, sys
from rl_core.venvs import VenvPlan, build_venv
fields = {k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
          for k, v in json.loads(sys.argv[1]).items()}
print(json.dumps(dataclasses.asdict(build_venv(VenvPlan(**fields)))))
"""


def test_concurrent_builders_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RL_VENV_DIR", str(tmp_path))
    plan = plan_venv(TINY_ENV)
    lock_path = venv_lock_path(plan.venv_dir())
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    children = []
    with open(lock_path, "a+") as held:
        # Hold the lock until both builders are blocked on it, so they really contend.
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        for _ in range(2):
            children.append(
                subprocess.Popen(
                    [sys.executable, "-c", _CHILD_BUILDER, json.dumps(dataclasses.asdict(plan))],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        for child in children:
            assert child.stderr is not None
            seen: list[str] = []
            while not any("waiting for another process building" in line for line in seen):
                line = child.stderr.readline()
                assert line, f"builder exited before waiting on the lock: {''.join(seen)}"
                seen.append(line)
        fcntl.flock(held.fileno(), fcntl.LOCK_UN)
    infos = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err
        infos.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(info["built"] for info in infos) == [False, True]
    assert infos[0]["python"] == infos[1]["python"] == str(plan.venv_dir() / "bin" / "python")
    assert infos[0]["build_id"] == infos[1]["build_id"]
    marker = json.loads((plan.venv_dir() / MARKER_NAME).read_text())
    assert marker["build_id"] == infos[0]["build_id"]


# --------------------------------------------------------------------------- actors


@pytest.mark.ray
def test_system_worker_runs_in_the_drivers_interpreter(ray_cluster: None) -> None:
    # Also when the tests run under `uv run` (CI): Ray's uv-run hook, which init_ray turns off,
    # would give the worker a second environment built from an uploaded copy of the tree.
    cluster = RayVirtualCluster([1], use_gpus=False, name="rl-test-system")
    try:
        group = RayWorkerGroup(cluster, SYSTEM_WORKER_FQN, env_vars=WORKER_ENV)
        try:
            (description,) = group.run_all_workers_single_data("interpreter")
        finally:
            group.shutdown()
    finally:
        cluster.shutdown()
    assert description["executable"] == sys.executable
    assert description["prefix"] == sys.prefix


def _spawn_and_describe(cluster: RayVirtualCluster) -> tuple[dict[str, Any], dict[str, Any], int]:
    group = RayWorkerGroup(cluster, ISOLATED_WORKER_FQN, env_vars=WORKER_ENV)
    try:
        (description,) = group.run_all_workers_single_data("interpreter")
        marker_path = Path(description["prefix"]) / MARKER_NAME
        return description, json.loads(marker_path.read_text()), marker_path.stat().st_mtime_ns
    finally:
        group.shutdown()


@pytest.mark.ray
def test_worker_runs_in_isolated_venv_built_once(
    isolated_venv_root: Path,
    ray_cluster: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RL_SINGLE_VENV", "0")  # conftest makes single-venv the default
    monkeypatch.delenv("RL_FORCE_REBUILD_VENVS", raising=False)
    venv_dir = plan_venv(ISOLATED_ENV).venv_dir()
    cluster = RayVirtualCluster([1], use_gpus=False, name="rl-test-isolated")
    try:
        first, first_marker, first_mtime = _spawn_and_describe(cluster)
        assert first["prefix"] == str(venv_dir) and first["prefix"] != sys.prefix
        assert first["executable"] == str(venv_dir / "bin" / "python")
        assert first["ray_file"].startswith(f"{venv_dir}/lib/")  # ray imported from the venv,
        assert first["torch_origin"].startswith(f"{venv_dir}/lib/")  # and torch would be too
        assert venv_dir.parent == isolated_venv_root

        second, second_marker, second_mtime = _spawn_and_describe(cluster)
        assert second["prefix"] == str(venv_dir)
        assert (second_marker, second_mtime) == (first_marker, first_mtime)  # reused, not rebuilt

        monkeypatch.setenv("RL_FORCE_REBUILD_VENVS", "1")
        third, third_marker, _ = _spawn_and_describe(cluster)
        assert third["prefix"] == str(venv_dir)
        assert third_marker["spec_hash"] == first_marker["spec_hash"]
        assert third_marker["build_id"] != first_marker["build_id"]  # rebuilt
    finally:
        cluster.shutdown()
