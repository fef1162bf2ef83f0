"""Isolated Python environments for Ray actors.

Each actor class is registered with an environment (`rl_core.distributed.actor_registry`).
For every environment other than ``system`` this module builds a venv with ``uv`` holding
that environment's packages, constrained to the driver's own versions of the packages that
must match across processes (Ray requires the same ray version on both sides of a call;
torch must be the same build), and returns its interpreter for
``runtime_env={"py_executable": ...}``. An environment may leave some of those to its own
resolver (`EnvironmentSpec.unpinned`: a backend that pins them itself) and have distributions
removed once installed (`EnvironmentSpec.uninstall`).

Venvs live in ``$RL_VENV_DIR`` (default ``~/.cache/rl/venvs``) as ``<env>-<spec hash>``; a
change of packages, pins, Python, or of a workspace package's pyproject.toml gives a new
hash and so a new venv. Builds take an exclusive file lock per venv, so concurrent builders
(several actors, several processes) build once; a completion marker holding the spec hash is
written last, so a half-built venv is detected and rebuilt.

Environment variables:
    RL_SINGLE_VENV=1          run every actor in the driver's interpreter (tests, small runs)
    RL_VENV_DIR=path          where venvs are built
    RL_FORCE_REBUILD_VENVS=1  rebuild each venv once in this process even if it is complete
    RL_UV=path                the uv executable (default: ``uv`` on PATH)
    PIP_FIND_LINKS=dirs       extra wheel directories handed to uv (e.g. a local CPU torch)
    UV_*                      the driver's uv settings (index, offline, ...) apply on every node
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_core.distributed.actor_registry import SYSTEM_ENV, get_actor_environment, get_environment_spec

ENV_SINGLE_VENV = "RL_SINGLE_VENV"
ENV_VENV_DIR = "RL_VENV_DIR"
ENV_FORCE_REBUILD = "RL_FORCE_REBUILD_VENVS"
ENV_UV = "RL_UV"
ENV_FIND_LINKS = "PIP_FIND_LINKS"

DEFAULT_VENV_ROOT = "~/.cache/rl/venvs"
MARKER_NAME = ".rl-venv-complete.json"
CONSTRAINTS_NAME = "rl-constraints.txt"

# Distributions every worker venv must share with the driver, pinned to the driver's
# installed versions: ray (cross-process protocol), torch (same build: CPU vs CUDA) and the
# serialisation/config stack that crosses process boundaries.
SHARED_PINNED_DISTRIBUTIONS: tuple[str, ...] = ("torch", "ray", "numpy", "msgpack", "pydantic", "pyyaml")

_STDERR_TAIL_LINES = 40
_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")


class VenvBuildError(RuntimeError):
    """Building a worker venv failed; the message holds the command and its stderr tail."""


def _env_flag(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(
        f"environment variable {name}={os.environ[name]!r} is not a boolean; use 1/0, true/false"
    )


def is_single_venv_mode(single_venv: bool | None = None) -> bool:
    """True when every actor should use the driver's interpreter (arg wins over $RL_SINGLE_VENV)."""
    return _env_flag(ENV_SINGLE_VENV) if single_venv is None else single_venv


def default_venv_root() -> Path:
    return Path(os.environ.get(ENV_VENV_DIR) or DEFAULT_VENV_ROOT).expanduser()


def find_uv() -> str:
    explicit = os.environ.get(ENV_UV)
    if explicit:
        return explicit
    candidates = [shutil.which("uv"), str(Path(sys.executable).parent / "uv")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise VenvBuildError(
        "cannot build worker venvs: the `uv` executable was not found on PATH or next to "
        f"{sys.executable}. Install uv, set {ENV_UV}=/path/to/uv, or set {ENV_SINGLE_VENV}=1 "
        "to run all actors in the driver's interpreter"
    )


def normalize_distribution_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _parse_requirement(requirement: str) -> tuple[str, tuple[str, ...]]:
    match = _REQUIREMENT_NAME.match(requirement)
    if match is None:
        raise ValueError(f"cannot parse requirement {requirement!r}")
    extras = tuple(e.strip() for e in (match.group(2) or "").split(",") if e.strip())
    return normalize_distribution_name(match.group(1)), extras


# --------------------------------------------------------------------------- workspace


@dataclass(frozen=True)
class WorkspacePackage:
    name: str
    path: Path
    dependencies: tuple[str, ...]
    pyproject_sha256: str


def find_workspace_root() -> Path | None:
    """The uv workspace this rl_core was imported from, if it runs from a checkout."""
    import rl_core

    # rl_core/__init__.py -> rl_core -> src -> rl-core -> packages -> <workspace root>
    parents = Path(rl_core.__file__).resolve().parents
    if len(parents) < 5:
        return None
    root = parents[4]
    if (root / "packages" / "rl-core" / "pyproject.toml").is_file() and (root / "pyproject.toml").is_file():
        return root
    return None


def _workspace_packages(root: Path) -> dict[str, WorkspacePackage]:
    packages: dict[str, WorkspacePackage] = {}
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        raw = pyproject.read_bytes()
        try:
            project = tomllib.loads(raw.decode())["project"]
        except (tomllib.TOMLDecodeError, KeyError) as exc:
            raise VenvBuildError(f"{pyproject}: cannot read [project] table: {exc}") from exc
        name = normalize_distribution_name(project["name"])
        packages[name] = WorkspacePackage(
            name=name,
            path=pyproject.parent,
            dependencies=tuple(project.get("dependencies", [])),
            pyproject_sha256=hashlib.sha256(raw).hexdigest(),
        )
    return packages


def _workspace_closure(
    requested: list[tuple[str, tuple[str, ...]]], packages: dict[str, WorkspacePackage], root: Path
) -> dict[str, set[str]]:
    """Requested workspace packages plus the workspace packages they depend on, with extras.

    Workspace dependencies must come from the checkout too: left to the resolver, ``rl-core``
    would be fetched from the registry instead of the code the driver runs.
    """
    selected: dict[str, set[str]] = {}
    pending = list(requested)
    while pending:
        name, extras = pending.pop()
        if name not in packages:
            raise VenvBuildError(
                f"package {name!r} is not in the workspace at {root}; workspace packages: {sorted(packages)}"
            )
        first_visit = name not in selected
        known = selected.setdefault(name, set())
        if not first_visit and set(extras) <= known:
            continue
        known.update(extras)
        for dependency in packages[name].dependencies:
            dep_name, dep_extras = _parse_requirement(dependency)
            if dep_name in packages:
                pending.append((dep_name, dep_extras))
    return selected


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class VenvPlan:
    """Everything needed to build one environment's venv; plain data, sent to Ray tasks."""

    env_name: str
    install_args: tuple[str, ...]  # arguments for `uv pip install` (requirements, -e paths)
    constraints: tuple[str, ...]  # `name==version` pins of the driver's shared distributions
    python: str  # interpreter the venv is created from
    find_links: tuple[str, ...]
    venv_root: str | None  # None: the building node's default (RL_VENV_DIR or ~/.cache/rl/venvs)
    spec_hash: str
    uv_env: tuple[tuple[str, str], ...] = ()  # the driver's UV_* settings; not part of the hash
    uninstall: tuple[str, ...] = ()  # distributions removed after the install

    def venv_dir(self) -> Path:
        root = Path(self.venv_root).expanduser() if self.venv_root else default_venv_root()
        return root / f"{self.env_name}-{self.spec_hash[:16]}"


@dataclass(frozen=True)
class VenvInfo:
    env_name: str
    venv_dir: str
    python: str
    built: bool  # False when an existing complete venv was reused
    build_id: str
    spec_hash: str


def shared_distribution_pins(unpinned: tuple[str, ...] = ()) -> tuple[str, ...]:
    """``name==version`` of the driver's shared distributions, less those in ``unpinned``."""
    skipped = {normalize_distribution_name(name) for name in unpinned}
    pins = []
    for name in SHARED_PINNED_DISTRIBUTIONS:
        if name in skipped:
            continue
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue  # the driver lacks it, so nothing to match
    return tuple(pins)


def _installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def plan_venv(env_name: str, *, workspace_root: Path | str | None = "auto") -> VenvPlan:
    """Resolve environment ``env_name`` into a build plan (what to install, pins, hash).

    Packages come from the workspace checkout (editable) when the driver runs from one,
    else from the registry as ``name==<driver's installed version>`` (or unpinned when the
    driver does not have them).
    """
    spec = get_environment_spec(env_name)
    if spec.name == SYSTEM_ENV:
        raise ValueError(f"environment {SYSTEM_ENV!r} is the driver's interpreter; it has no venv to build")
    root = (
        find_workspace_root()
        if workspace_root == "auto"
        else (Path(workspace_root) if workspace_root else None)
    )
    requested = [_parse_requirement(p) for p in spec.packages]
    install_args: list[str] = []
    fingerprint: dict[str, Any] = {}
    if root is not None:
        packages = _workspace_packages(root)
        closure = _workspace_closure(requested, packages, root)
        for name in sorted(closure):
            extras_suffix = f"[{','.join(sorted(closure[name]))}]" if closure[name] else ""
            install_args += ["-e", f"{packages[name].path}{extras_suffix}"]
        fingerprint["workspace_pyprojects"] = {n: packages[n].pyproject_sha256 for n in sorted(closure)}
    else:
        for requirement, (name, extras) in zip(spec.packages, requested):
            version = _installed_version(name)
            extras_text = f"[{','.join(extras)}]" if extras else ""
            install_args.append(f"{name}{extras_text}=={version}" if version else requirement)
    install_args += list(spec.extra_requirements)
    constraints = shared_distribution_pins(_checked_unpinned(spec.name, spec.unpinned))
    find_links = tuple(os.environ.get(ENV_FIND_LINKS, "").split())
    fingerprint.update(
        env=spec.name,
        install_args=install_args,
        constraints=constraints,
        python=[sys.implementation.name, sys.version, sys.platform],
        find_links=find_links,
        uninstall=list(spec.uninstall),
    )
    spec_hash = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
    return VenvPlan(
        env_name=spec.name,
        install_args=tuple(install_args),
        constraints=constraints,
        python=sys.executable,
        find_links=find_links,
        venv_root=os.environ.get(ENV_VENV_DIR) or None,
        spec_hash=spec_hash,
        uv_env=tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("UV_"))),
        uninstall=spec.uninstall,
    )


def _checked_unpinned(env_name: str, unpinned: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(normalize_distribution_name(name) for name in unpinned)
    unknown = sorted(set(names) - set(SHARED_PINNED_DISTRIBUTIONS))
    if unknown:
        raise ValueError(
            f"environment {env_name!r}: unpinned={list(unpinned)} names {unknown}, which are not shared "
            f"distributions; only {list(SHARED_PINNED_DISTRIBUTIONS)} are pinned to the driver's versions"
        )
    if "ray" in names:
        raise ValueError(
            f"environment {env_name!r}: ray cannot be unpinned; the driver and its actors must run the "
            "same ray version"
        )
    return names


# --------------------------------------------------------------------------- building


def _read_marker(venv_dir: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((venv_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _write_marker(venv_dir: Path, content: dict[str, Any]) -> None:
    tmp = venv_dir / f"{MARKER_NAME}.tmp"
    tmp.write_text(json.dumps(content, indent=1))
    os.replace(tmp, venv_dir / MARKER_NAME)


def _venv_python(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def venv_lock_path(venv_dir: Path) -> Path:
    """The lock file guarding ``venv_dir`` (beside it: the directory is deleted on rebuild)."""
    return venv_dir.with_name(venv_dir.name + ".lock")


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path, what: str) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _progress(f"waiting for another process building {what} (lock {lock_path})")
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _progress(message: str) -> None:
    print(f"[rl.venvs pid {os.getpid()}] {message}", file=sys.stderr, flush=True)


def _run_build_command(command: list[str], cwd: Path, plan: VenvPlan) -> None:
    env_name = plan.env_name
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONHOME")}
    env.update(plan.uv_env)
    try:
        result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise VenvBuildError(
            f"building venv for environment {env_name!r}: cannot run {shlex.join(command)}: {exc}"
        ) from exc
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-_STDERR_TAIL_LINES:])
        raise VenvBuildError(
            f"building venv for environment {env_name!r} failed (exit {result.returncode}).\n"
            f"command: {shlex.join(command)}\nstderr (last {_STDERR_TAIL_LINES} lines):\n{tail}"
        )


def build_venv(plan: VenvPlan, rebuild_id: str | None = None) -> VenvInfo:
    """Build the venv of ``plan`` unless a complete one exists; safe to call concurrently.

    ``rebuild_id`` forces a rebuild unless the existing venv was built for that very id, so
    several builders answering one rebuild request (actors, nodes) rebuild once.
    """
    venv_dir = plan.venv_dir()
    python = _venv_python(venv_dir)
    with _exclusive_lock(venv_lock_path(venv_dir), f"venv {venv_dir}"):
        marker = _read_marker(venv_dir)
        complete = marker is not None and marker.get("spec_hash") == plan.spec_hash and python.exists()
        if complete and marker is not None and (rebuild_id is None or marker.get("build_id") == rebuild_id):
            return VenvInfo(
                plan.env_name, str(venv_dir), str(python), False, str(marker["build_id"]), plan.spec_hash
            )
        reason = (
            "forced rebuild"
            if complete
            else ("incomplete build found" if venv_dir.exists() else "not built yet")
        )
        _progress(
            f"building venv for environment {plan.env_name!r} at {venv_dir} ({reason}); this can take a while"
        )
        started = time.monotonic()
        shutil.rmtree(venv_dir, ignore_errors=True)
        uv = find_uv()
        # The driver's interpreter path may not exist on another node; the builder's own
        # interpreter there is the same Python (the plan's hash pins the version).
        base_python = plan.python if Path(plan.python).exists() else sys.executable
        try:
            _run_build_command(
                [uv, "venv", "--quiet", "--python", base_python, str(venv_dir)],
                venv_dir.parent,
                plan,
            )
            install = [uv, "pip", "install", "--python", str(python)]
            if plan.constraints:
                constraints_file = venv_dir / CONSTRAINTS_NAME
                constraints_file.write_text("\n".join(plan.constraints) + "\n")
                install += ["--constraint", str(constraints_file)]
            for directory in plan.find_links:
                install += ["--find-links", directory]
            if plan.install_args:
                _run_build_command([*install, *plan.install_args], venv_dir.parent, plan)
            if plan.uninstall:
                _run_build_command(
                    [uv, "pip", "uninstall", "--python", str(python), *plan.uninstall], venv_dir.parent, plan
                )
            build_id = rebuild_id or uuid.uuid4().hex
            _write_marker(
                venv_dir,
                {
                    "spec_hash": plan.spec_hash,
                    "build_id": build_id,
                    "env": plan.env_name,
                    "built_at": time.time(),
                },
            )
        except BaseException:
            shutil.rmtree(venv_dir, ignore_errors=True)
            raise
        _progress(f"built venv for environment {plan.env_name!r} in {time.monotonic() - started:.1f} s")
        return VenvInfo(plan.env_name, str(venv_dir), str(python), True, build_id, plan.spec_hash)


# A forced rebuild ($RL_FORCE_REBUILD_VENVS) happens once per venv per driver process: every
# later request in the process carries the same id and so reuses that fresh build.
_process_rebuild_ids: dict[str, str] = {}
_rebuild_ids_lock = threading.Lock()


def _rebuild_request_id(plan: VenvPlan, force_rebuild: bool | None) -> str | None:
    if force_rebuild is None:
        if not _env_flag(ENV_FORCE_REBUILD):
            return None
        with _rebuild_ids_lock:
            return _process_rebuild_ids.setdefault(plan.spec_hash, uuid.uuid4().hex)
    return uuid.uuid4().hex if force_rebuild else None


def ensure_venv(env_name: str, *, force_rebuild: bool | None = None) -> VenvInfo:
    """Build (or reuse) environment ``env_name``'s venv on this machine.

    ``force_rebuild=None`` follows $RL_FORCE_REBUILD_VENVS (once per process); True always
    rebuilds; False never forces.
    """
    plan = plan_venv(env_name)
    return build_venv(plan, _rebuild_request_id(plan, force_rebuild))


def get_actor_python_executable(
    fqn: str, *, single_venv: bool | None = None, force_rebuild: bool | None = None
) -> str:
    """Interpreter for actor class ``fqn``: the driver's for ``system`` or single-venv mode,
    else its environment's venv python (built here on first use)."""
    env_name = get_actor_environment(fqn)
    if env_name == SYSTEM_ENV or is_single_venv_mode(single_venv):
        return sys.executable
    return ensure_venv(env_name, force_rebuild=force_rebuild).python


def _build_venv_task(plan: VenvPlan, rebuild_id: str | None) -> VenvInfo:
    return build_venv(plan, rebuild_id)


def ensure_venv_on_all_nodes(env_name: str, *, force_rebuild: bool | None = None) -> dict[str, VenvInfo]:
    """Build environment ``env_name``'s venv on every alive Ray node; returns node id -> venv.

    Runs the builder as a zero-CPU Ray task pinned to each node, so it also runs while
    placement groups hold every CPU.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    plan = plan_venv(env_name)
    rebuild_id = _rebuild_request_id(plan, force_rebuild)
    builder = ray.remote(num_cpus=0, max_retries=0)(_build_venv_task)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = [
        builder.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False),
            name=f"rl-build-venv-{env_name}",
        ).remote(plan, rebuild_id)
        for n in nodes
    ]
    venvs: dict[str, VenvInfo] = {}
    for node, ref in zip(nodes, refs):
        try:
            result = ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            raise VenvBuildError(
                f"building venv for environment {env_name!r} on node {node.get('NodeManagerAddress')} "
                f"({node['NodeID']}) failed:\n{exc}"
            ) from exc
        venvs[node["NodeID"]] = result
    return venvs
