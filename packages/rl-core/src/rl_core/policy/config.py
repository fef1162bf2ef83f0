"""Typed configuration of a policy (any training backend) and of Hugging Face generation.

The schema lives in rl-core so the driver validates a whole recipe without importing a
backend; each backend reads the sections it understands (`dtensor` for rl-dtensor).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from rl_core.config import RLConfig
from rl_core.policy.optim import check_optimizer_name, check_scheduler_name

DTypeName = Literal["float32", "bfloat16", "float16"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class SamplingConfig(RLConfig):
    """How tokens are sampled; `temperature` also scales the training log-probs.

    `top_k` None (or 0) and `top_p` 1.0 disable those filters. Log-probs are always those of the
    temperature-scaled *full* distribution (see `rl_dtensor.sampling`).
    """

    temperature: float = Field(default=1.0, gt=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    max_new_tokens: int | None = Field(default=None, ge=1)
    stop_token_ids: list[int] | None = None
    stop_strings: list[str] | None = None

    def sampling(self) -> SamplingConfig:
        """The sampling settings alone (a subclass's other fields dropped): what generation
        workers take."""
        return SamplingConfig(**{name: getattr(self, name) for name in SamplingConfig.model_fields})

    def with_overrides(self, overrides: SamplingConfig | Mapping[str, Any] | None) -> SamplingConfig:
        """These settings with `overrides` applied (validated; unknown keys are errors)."""
        base = self.sampling()
        if overrides is None:
            return base
        if isinstance(overrides, SamplingConfig):
            return overrides
        return SamplingConfig.model_validate({**base.model_dump(), **overrides})


class PolicyGenerationConfig(SamplingConfig):
    """A policy's sampling settings, plus the rollout engine's name where NeMo RL recipes put
    it (`policy.generation.backend`). Workers ignore `backend`; the algorithm's recipe reads it
    as its `generation.backend` (see `rl_algos.config.GenerationBackendConfig`)."""

    backend: str | None = None


class OptimizerConfig(RLConfig):
    name: str = "adamw"
    kwargs: dict[str, Any] = Field(default_factory=lambda: {"lr": 1e-5, "weight_decay": 0.0})

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        return check_optimizer_name(name)


class SchedulerConfig(RLConfig):
    """Linear warm-up, then `name`'s decay to `min_lr_ratio` at `total_steps`."""

    name: str = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    total_steps: int | None = Field(default=None, ge=1)
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        return check_scheduler_name(name)

    @model_validator(mode="after")
    def _decay_needs_total(self) -> SchedulerConfig:
        if self.name != "constant" and self.total_steps is None:
            raise ValueError(f"scheduler {self.name!r} needs total_steps")
        return self


class ParallelConfig(RLConfig):
    """Model parallelism inside one worker group. Data parallel size = world size / tp_size."""

    tp_size: int = Field(default=1, ge=1)
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    cpu_offload: bool = False


class DynamicBatchingConfig(RLConfig):
    """Padded micro-batches filled up to a token budget instead of a fixed number of rows."""

    enabled: bool = False
    train_mb_tokens: int = Field(default=4096, ge=1)
    logprob_mb_tokens: int = Field(default=4096, ge=1)
    sequence_length_round: int = Field(default=64, ge=1)


class SequencePackingConfig(RLConfig):
    """Sequences laid end to end in one row per micro-batch (no padding compute)."""

    enabled: bool = False
    train_mb_tokens: int = Field(default=4096, ge=1)
    logprob_mb_tokens: int = Field(default=4096, ge=1)
    algorithm: Literal[
        "first_fit_decreasing", "modified_first_fit_decreasing", "first_fit_shuffle", "ffd", "mffd", "ffs"
    ] = "modified_first_fit_decreasing"


ModelClass = Literal["causal_lm", "sequence_classification"]


class PolicyConfig(RLConfig):
    backend: Literal["dtensor"] = "dtensor"
    model_name: str
    # `sequence_classification` loads the checkpoint with a `num_labels`-way head on its last
    # hidden state (a reward model from a causal LM): `train` then hands the loss the head's
    # output at each sequence's last token, [B, num_labels], instead of per-token logits.
    model_class: ModelClass = "causal_lm"
    num_labels: int = Field(default=1, ge=1)
    tokenizer_name: str | None = None
    dtype: DTypeName = "float32"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = None
    max_total_sequence_length: int = Field(ge=2)
    train_global_batch_size: int = Field(ge=1)
    train_micro_batch_size: int = Field(ge=1)
    logprob_batch_size: int = Field(default=8, ge=1)
    generation: PolicyGenerationConfig = Field(default_factory=PolicyGenerationConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    max_grad_norm: float | None = Field(default=1.0, gt=0.0)
    dtensor: ParallelConfig = Field(default_factory=ParallelConfig)
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)
    sequence_packing: SequencePackingConfig = Field(default_factory=SequencePackingConfig)
    reference_model: bool = True
    refit_bucket_size_bytes: int = Field(default=256 * 1024**2, ge=1)
    seed: int = 42

    @model_validator(mode="after")
    def _one_batching_mode(self) -> PolicyConfig:
        if self.dynamic_batching.enabled and self.sequence_packing.enabled:
            raise ValueError("dynamic_batching and sequence_packing cannot both be enabled")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer_name or self.model_name


class HFGenerationConfig(SamplingConfig):
    """A standalone Hugging Face generation worker (its own copy of the model)."""

    model_name: str
    tokenizer_name: str | None = None
    dtype: DTypeName = "float32"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = None
    max_total_sequence_length: int = Field(ge=2)
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer_name or self.model_name
