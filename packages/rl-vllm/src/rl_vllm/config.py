"""Typed configuration of the vLLM generation backend.

It crosses from the driver into the worker venv as a plain dict (`to_dict`), so it holds only
plain values. Sampling settings are the policy's (`SamplingConfig`): the trainer's log-probs
use the same temperature.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from rl_core.policy.config import DTypeName, SamplingConfig

LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]


class VllmConfig(SamplingConfig):
    """One vLLM generation backend: `cluster.world_size() / tensor_parallel_size` engines.

    `logprobs_mode`: `processed_logprobs` (default) reports log-probs of the temperature-scaled
    distribution, what the policy's `get_logprobs` computes (with top-k / top-p on, vLLM
    renormalises over the kept tokens first). `raw_logprobs` reports the untempered model's.
    `enforce_eager` None: eager on CPU (an engine starts in ~25 s instead of ~70 s on 2 cores,
    right for tests and short runs), CUDA graphs on GPU. Long CPU runs want False: compiled,
    the benchmark model decodes 5x faster (1094 vs 200 tokens/s). `colocated`: the engine shares GPUs with the trainer, so it sleeps
    (`sleep_level`) between rollouts and wakes for them.
    """

    model_name: str
    tokenizer_name: str | None = None
    dtype: DTypeName = "float32"
    max_total_sequence_length: int = Field(ge=2, description="prompt + generated tokens (vLLM max_model_len)")
    tensor_parallel_size: int = Field(default=1, ge=1)
    async_engine: bool = Field(default=False, description="AsyncLLM (continuous batching, generate_async)")
    gpu_memory_utilization: float = Field(default=0.6, gt=0.0, le=1.0)
    cpu_kv_cache_space_gib: int = Field(default=1, ge=1, description="KV cache of a CPU engine, GiB")
    enforce_eager: bool | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int | None = Field(default=None, ge=1)
    logprobs_mode: LogprobsMode = "processed_logprobs"
    colocated: bool = False
    sleep_level: Literal[1, 2] = 1
    seed: int = 0

    @model_validator(mode="after")
    def _supported_layout(self) -> Self:
        if self.async_engine and self.tensor_parallel_size > 1:
            raise ValueError(
                "async_engine with tensor_parallel_size > 1 is not supported: tensor-parallel engines run as "
                "SPMD ranks of the worker group, which only the synchronous engine supports; use "
                "async_engine: false or tensor_parallel_size: 1"
            )
        return self

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer_name or self.model_name
