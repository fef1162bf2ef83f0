"""Which Python environment each Ray actor class runs in.

Actor classes are named by fully-qualified name (``package.module.Class``) so the driver
never has to import a backend. Each class maps to an *environment* name; each environment
says which of our workspace packages and which extra pip requirements its venv holds
(`rl_core.venvs` builds it). ``system`` is the driver's own interpreter.

Environment classes of ``rl_envs`` are registered as ``system``: ``rl-algos`` (which the
driver always has) depends on ``rl-envs``, so the driver's interpreter can already import
them, and a separate venv would only cost build time. The ``envs`` environment is still
defined for deployments that want them isolated (``register_actor(fqn, "envs", replace=True)``).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

SYSTEM_ENV = "system"

_FQN_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")
_ENV_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class UnregisteredActorError(KeyError):
    """The actor class was never mapped to an environment."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class UnknownEnvironmentError(KeyError):
    """No environment of that name was registered."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class EnvironmentSpec:
    """What a worker venv contains.

    Attributes:
        name: environment name (``dtensor``, ``vllm``, ...).
        packages: our workspace packages (distribution names, extras allowed:
            ``"rl-envs[reward-model]"``). Installed from the workspace checkout when the
            driver runs from one, else from the registry.
        extra_requirements: further pip requirement strings (``"vllm>=0.10"``).
        unpinned: distributions of ``rl_core.venvs.SHARED_PINNED_DISTRIBUTIONS`` this venv
            resolves for itself instead of pinning them to the driver's versions, for
            backends that pin their own (vLLM pins numpy below the driver's; its CUDA wheels
            pin torch). ``ray`` cannot be unpinned: both sides of a call need the same one.
        uninstall: distributions removed after installing, e.g. optional dependencies that
            arrive in a build that breaks the backend's import.
    """

    name: str
    packages: tuple[str, ...] = ()
    extra_requirements: tuple[str, ...] = ()
    unpinned: tuple[str, ...] = ()
    uninstall: tuple[str, ...] = ()


# The data tables. Backends that need hardware-specific builds (vLLM CPU vs GPU) refine
# their entry at import time with register_environment(..., replace=True).
_DEFAULT_ENVIRONMENTS: tuple[EnvironmentSpec, ...] = (
    EnvironmentSpec(SYSTEM_ENV),
    # Policy workers unpickle the loss objects the loops send them, so their venvs hold rl-algos.
    EnvironmentSpec("dtensor", packages=("rl-dtensor", "rl-algos")),
    EnvironmentSpec("vllm", packages=("rl-vllm",), extra_requirements=("vllm",)),
    EnvironmentSpec("sglang", packages=("rl-sglang",), extra_requirements=("sglang",)),
    EnvironmentSpec("megatron", packages=("rl-megatron", "rl-algos"), extra_requirements=("megatron-core",)),
    EnvironmentSpec("envs", packages=("rl-envs[reward-model]",)),
)

_DEFAULT_ACTORS: dict[str, str] = {
    "rl_dtensor.worker.DTensorPolicyWorker": "dtensor",
    "rl_dtensor.generation.HFGenerationWorker": "dtensor",
    "rl_vllm.worker.VllmGenerationWorker": "vllm",
    "rl_vllm.worker.VllmAsyncGenerationWorker": "vllm",
    "rl_sglang.worker.SGLangGenerationWorker": "sglang",
    "rl_megatron.worker.MegatronPolicyWorker": "megatron",
    "rl_envs.math.MathEnvironment": SYSTEM_ENV,
    "rl_envs.code.CodeEnvironment": SYSTEM_ENV,
    "rl_envs.reward_model.RewardModelEnvironment": SYSTEM_ENV,
    "rl_envs.sliding_puzzle.SlidingPuzzleEnvironment": SYSTEM_ENV,
    "rl_envs.tools.ToolEnvironment": SYSTEM_ENV,
}

_lock = threading.Lock()
_environments: dict[str, EnvironmentSpec] = {spec.name: spec for spec in _DEFAULT_ENVIRONMENTS}
_actors: dict[str, str] = dict(_DEFAULT_ACTORS)


def register_environment(
    name: str,
    packages: list[str] | tuple[str, ...],
    extra_requirements: list[str] | tuple[str, ...] = (),
    *,
    unpinned: list[str] | tuple[str, ...] = (),
    uninstall: list[str] | tuple[str, ...] = (),
    replace: bool = False,
) -> EnvironmentSpec:
    """Define (or, with ``replace=True``, redefine) the contents of environment ``name``
    (fields as in `EnvironmentSpec`)."""
    if not isinstance(name, str) or not _ENV_NAME_PATTERN.match(name):
        raise ValueError(f"invalid environment name {name!r}: use letters, digits, '_', '-', '.'")
    if name == SYSTEM_ENV:
        raise ValueError(
            f"environment {SYSTEM_ENV!r} is the driver's own interpreter and cannot be redefined"
        )
    fields = {
        "packages": packages,
        "extra_requirements": extra_requirements,
        "unpinned": unpinned,
        "uninstall": uninstall,
    }
    for field_name, values in fields.items():
        if isinstance(values, str) or not all(isinstance(v, str) and v.strip() for v in values):
            raise ValueError(
                f"register_environment({name!r}): {field_name} must be a list of non-empty strings, got {values!r}"
            )
    spec = EnvironmentSpec(
        name, tuple(packages), tuple(extra_requirements), tuple(unpinned), tuple(uninstall)
    )
    with _lock:
        existing = _environments.get(name)
        if existing is not None and existing != spec and not replace:
            raise ValueError(
                f"environment {name!r} is already registered as {existing}; pass replace=True to redefine it"
            )
        _environments[name] = spec
    return spec


def get_environment_spec(name: str) -> EnvironmentSpec:
    with _lock:
        spec = _environments.get(name)
        known = sorted(_environments)
    if spec is None:
        raise UnknownEnvironmentError(
            f"unknown environment {name!r}; registered environments: {known}. "
            f"Define it with rl_core.distributed.actor_registry.register_environment({name!r}, packages=[...])"
        )
    return spec


def list_environments() -> list[str]:
    with _lock:
        return sorted(_environments)


def register_actor(fqn: str, env: str, *, replace: bool = False) -> None:
    """Run actor class ``fqn`` (``package.module.Class``) in environment ``env``."""
    if not isinstance(fqn, str) or not _FQN_PATTERN.match(fqn):
        raise ValueError(
            f"invalid actor class name {fqn!r}: expected a fully-qualified 'package.module.Class'"
        )
    get_environment_spec(env)  # the environment must exist: catches typos at registration
    with _lock:
        existing = _actors.get(fqn)
        if existing is not None and existing != env and not replace:
            raise ValueError(
                f"actor class {fqn!r} is already registered to environment {existing!r}; "
                f"pass replace=True to move it to {env!r}"
            )
        _actors[fqn] = env


def unregister_actor(fqn: str) -> None:
    with _lock:
        _actors.pop(fqn, None)


def get_actor_environment(fqn: str) -> str:
    """The environment registered for actor class ``fqn``; raises UnregisteredActorError."""
    with _lock:
        env = _actors.get(fqn)
        known_envs = sorted(_environments)
    if env is None:
        raise UnregisteredActorError(
            f"actor class {fqn!r} is not registered with an environment. Register it before "
            f"spawning it, e.g. rl_core.distributed.actor_registry.register_actor({fqn!r}, 'system') "
            f"to run it in the driver's interpreter (known environments: {known_envs})"
        )
    return env


def registered_actors() -> dict[str, str]:
    with _lock:
        return dict(_actors)
