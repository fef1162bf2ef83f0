"""The one module of rl-algos that chooses how a policy and its rollout engine are built.

Every loop builds its policy and rollout engine through `make_policy` / `make_generation`
and types its policy config as `PolicyConfig`. The driver-side objects come from rl-core,
which names the backend's workers by fully-qualified class (DESIGN.md §1-2): rl-algos never
imports a backend package. The Ray-facing modules are imported inside the functions, so
validating a recipe imports only the config schema.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rl_core.config import ConfigError
from rl_core.policy.config import HFGenerationConfig, PolicyConfig, SamplingConfig

if TYPE_CHECKING:
    from rl_algos.config import GenerationBackendConfig
    from rl_core.distributed import RayVirtualCluster
    from rl_core.interfaces import GenerationInterface
    from rl_core.policy import Policy

__all__ = [
    "HFGenerationConfig",
    "Policy",
    "PolicyConfig",
    "SamplingConfig",
    "make_generation",
    "make_model_generation",
    "make_policy",
    "make_vllm_generation",
]


def make_policy(
    cluster: RayVirtualCluster,
    config: PolicyConfig | Mapping[str, Any],
    *,
    weights_path: str | None = None,
    optimizer_path: str | None = None,
    init_optimizer: bool = True,
    name_prefix: str = "",
    env_vars: dict[str, str] | None = None,
) -> Policy:
    """Start the policy's workers on `cluster` (loading a checkpoint when paths are given)."""
    from rl_core.policy import Policy

    return Policy(
        cluster,
        config,
        name_prefix=name_prefix,
        weights_path=weights_path,
        optimizer_path=optimizer_path,
        init_optimizer=init_optimizer,
        env_vars=env_vars,
    )


def make_generation(
    policy: Policy,
    policy_config: PolicyConfig,
    backend: GenerationBackendConfig,
    cluster_factory: Callable[[int], RayVirtualCluster] | None = None,
    env_vars: dict[str, str] | None = None,
) -> GenerationInterface:
    """The rollout engine `backend` names.

    `hf` + colocated generates with the policy's own workers (no weight transfer); `hf`
    standalone starts `backend.num_workers` Hugging Face generation workers on a cluster made
    by `cluster_factory(num_workers)`; they get the policy's weights through `update_weights`.
    """
    if backend.backend == "vllm":
        if cluster_factory is None:
            raise ValueError("a vLLM engine needs a cluster_factory")
        return make_vllm_generation(policy_config, backend, cluster_factory, env_vars)
    if backend.colocated:
        from rl_core.policy import ColocatedGeneration

        return ColocatedGeneration(policy)
    if cluster_factory is None:
        raise ValueError("a standalone generation engine needs a cluster_factory")
    return make_model_generation(
        cluster_factory(backend.num_workers),
        HFGenerationConfig(
            **policy_config.generation.sampling().model_dump(),
            model_name=policy_config.model_name,
            tokenizer_name=policy_config.tokenizer_name,
            dtype=policy_config.dtype,
            max_total_sequence_length=policy_config.max_total_sequence_length,
            seed=policy_config.seed,
        ),
        env_vars=env_vars,
    )


def make_model_generation(
    cluster: RayVirtualCluster,
    config: HFGenerationConfig,
    env_vars: dict[str, str] | None = None,
    name_prefix: str = "generation",
) -> GenerationInterface:
    """Hugging Face generation workers (one per bundle of `cluster`) holding their own copy of the
    model `config` names: rollouts of a policy (weights arrive by `update_weights`) or generation
    from a model directory alone (evaluation)."""
    from rl_core.policy import WorkerGroupGeneration

    return WorkerGroupGeneration(cluster, config, name_prefix=name_prefix, env_vars=env_vars)


def make_vllm_generation(
    policy_config: PolicyConfig,
    backend: GenerationBackendConfig,
    cluster_factory: Callable[[int], RayVirtualCluster],
    env_vars: dict[str, str] | None = None,
) -> GenerationInterface:
    """`backend.num_workers` vLLM engines of `generation.vllm.tensor_parallel_size` ranks each, on
    bundles of their own, sampling as `policy.generation` says; they get the policy's weights
    through `update_weights`. The driver needs rl-vllm's driver side only (it does not import
    vLLM); vLLM itself is installed into the workers' own venv."""
    try:
        from rl_vllm.generation import VllmGeneration
    except ImportError as exc:
        raise ConfigError(
            "generation.backend: 'vllm' needs the rl-vllm package in the driver's environment "
            f"(`pip install rl-vllm`; vLLM itself goes into the workers' own venv): {exc}"
        ) from exc
    settings = backend.vllm
    if settings.pipeline_parallel_size != 1:
        raise ConfigError(
            f"generation.vllm.pipeline_parallel_size: {settings.pipeline_parallel_size} is not supported; "
            "rl-vllm engines are tensor-parallel only (use 1)"
        )
    config = {
        **policy_config.generation.sampling().model_dump(),
        "model_name": policy_config.model_name,
        "tokenizer_name": policy_config.tokenizer_name,
        "dtype": settings.precision or policy_config.dtype,
        "max_total_sequence_length": settings.max_model_len or policy_config.max_total_sequence_length,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "async_engine": settings.async_engine,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "enforce_eager": settings.enforce_eager,
        "seed": policy_config.seed,
    }
    cluster = cluster_factory(backend.num_workers * settings.tensor_parallel_size)
    return VllmGeneration(cluster, config, name_prefix="generation", env_vars=env_vars)
