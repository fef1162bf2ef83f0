"""Config sections shared by the training loops: cluster, datasets, generation backend.

Each loop's master config (e.g. `rl_algos.grpo.GRPOMasterConfig`) composes these with its
own algorithm section, the policy, logger and checkpointing sections.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self

from pydantic import Discriminator, Field, Tag, model_validator

from rl_algos.data.arithmetic import ArithmeticDatasetSpec
from rl_algos.data.loading import DatasetSpec
from rl_algos.data.processors import PromptFormat
from rl_core.config import RLConfig


def _dataset_kind(value: Any) -> str:
    """Which dataset model a YAML mapping describes: `source: arithmetic` picks the built-in task."""
    source = value.get("source") if isinstance(value, dict) else getattr(value, "source", None)
    return "ArithmeticDatasetSpec" if source == "arithmetic" else "DatasetSpec"


# Tags are the class names so that config errors inside a dataset section name the user's keys
# (rl_core's error formatter drops union tags that equal a member's class name).
DatasetSection = Annotated[
    Annotated[DatasetSpec, Tag("DatasetSpec")]
    | Annotated[ArithmeticDatasetSpec, Tag("ArithmeticDatasetSpec")],
    Discriminator(_dataset_kind),
]


class ClusterConfig(RLConfig):
    """The Ray cluster slice the policy workers run on (one worker per GPU, or per CPU bundle)."""

    num_nodes: int = Field(default=1, ge=1)
    workers_per_node: int = Field(
        default=1, ge=1, description="policy workers (one GPU each when use_gpus) per node"
    )
    use_gpus: bool = False
    cpus_per_worker: float = Field(
        default=1.0, gt=0, description="CPUs reserved per worker; on CPU-only runs also its torch threads"
    )
    # Sizes a local Ray cluster when none is running (ignored when joining RAY_ADDRESS);
    # None lets Ray count this machine's CPUs.
    num_cpus: int | None = Field(default=None, ge=1)
    # Run every worker in the driver's interpreter instead of its backend's own venv
    # (what RL_SINGLE_VENV=1 does): the simple choice for one machine and small runs.
    single_venv: bool = False

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.workers_per_node


class VllmSettings(RLConfig):
    """Settings of the vLLM generation backend (rl-vllm); `num_workers` engines of
    `tensor_parallel_size` ranks each."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    gpu_memory_utilization: float = Field(default=0.6, gt=0.0, le=1.0)
    max_model_len: int | None = Field(
        default=None, ge=1, description="null: policy.max_total_sequence_length"
    )
    enforce_eager: bool | None = Field(default=None, description="null: eager on CPU (fast start-up; false compiles, ~5x faster decoding), CUDA graphs on GPU")
    async_engine: bool = False
    precision: Literal["bfloat16", "float16", "float32"] | None = Field(
        default=None, description="null: the policy's dtype (so generation and training log-probs agree)"
    )


class GenerationBackendConfig(RLConfig):
    """Which engine produces rollouts. Sampling settings (temperature, top-p/k, max_new_tokens,
    stop strings) live in `policy.generation`, because the trainer's log-probs must use the
    same temperature."""

    backend: Literal["hf", "vllm"] = "hf"
    # Colocated: generation shares the policy's workers and devices. With `hf` it is the
    # policy's own model, so weights never need a refit.
    colocated: bool = True
    # Workers of a non-colocated engine (on their own CPU bundles / GPUs).
    num_workers: int = Field(default=1, ge=1)
    vllm: VllmSettings = Field(default_factory=VllmSettings)

    @property
    def shares_policy_weights(self) -> bool:
        return self.backend == "hf" and self.colocated



def apply_backend_alias(data: Any) -> Any:
    """Raw recipe data with `policy.generation.backend` (where NeMo RL recipes name the rollout
    engine) copied to `generation.backend`, for a recipe model's `mode="before"` validator.
    Both set to different engines is an error."""
    if not isinstance(data, Mapping):
        return data
    policy = data.get("policy")
    sampling = policy.get("generation") if isinstance(policy, Mapping) else None
    alias = sampling.get("backend") if isinstance(sampling, Mapping) else None
    if alias is None:
        return data
    section = data.get("generation")
    generation = dict(section) if isinstance(section, Mapping) else {}
    if generation.get("backend", alias) != alias:
        raise ValueError(
            f"policy.generation.backend is {alias!r} but generation.backend is {generation['backend']!r}; "
            "set one of them"
        )
    return {**data, "generation": {**generation, "backend": alias}}


class PromptDataConfig(RLConfig):
    """Prompt datasets of an RL run: each record becomes a conversation the policy answers, and
    its answer goes to the environment of `task_name`."""

    train: DatasetSection
    validation: DatasetSection | None = None
    prompt: PromptFormat = Field(default_factory=PromptFormat)
    task_name: str = Field(default="math", description="the env section that scores these prompts")
    shuffle: bool = True

    @model_validator(mode="after")
    def _arithmetic_formats(self) -> Self:
        for name, spec in (("train", self.train), ("validation", self.validation)):
            if isinstance(spec, ArithmeticDatasetSpec) and spec.format != "prompt_answer":
                raise ValueError(
                    f"data.{name}: an RL dataset needs prompt/answer records; set format: prompt_answer "
                    f"(got {spec.format!r})"
                )
        return self
