"""Hugging Face generation backend: standalone workers, and generation with the policy's own model.

* `HFGenerationWorker` (Ray actor FQN `rl_dtensor.generation.HFGenerationWorker`): an
  unsharded copy of the model per worker; workers are independent data-parallel replicas.
* `HFGeneration`: the driver-side `GenerationInterface` over a group of those workers; weights
  arrive through `update_weights` as full tensors by name.
* `ColocatedHFGeneration`: a `GenerationInterface` that generates with the policy workers'
  own (sharded) model, so there is nothing to refit: the rollout backend for CPU runs.

All three sample with `rl_dtensor.sampling.generate_batch`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from rl_core.data import BatchedDataDict
from rl_core.interfaces import GenerationInterface, WeightBucket
from rl_dtensor.config import HFGenerationConfig, SamplingConfig
from rl_dtensor.model_loading import choose_attn_implementation, load_causal_lm, load_tokenizer, move_module
from rl_dtensor.sampling import generate_batch
from rl_dtensor.weights import load_weights

if TYPE_CHECKING:
    from rl_core.distributed import RayVirtualCluster
    from rl_dtensor.policy import DTensorPolicy

GENERATION_WORKER_FQN = "rl_dtensor.generation.HFGenerationWorker"


def _as_batch(data: Mapping[str, Any]) -> BatchedDataDict[Any]:
    return data if isinstance(data, BatchedDataDict) else BatchedDataDict(data)


class HFGenerationWorker:
    """One generation replica: a plain Hugging Face model on this process's device."""

    def __init__(self, config: HFGenerationConfig | Mapping[str, Any]) -> None:
        self.cfg = (
            config if isinstance(config, HFGenerationConfig) else HFGenerationConfig.model_validate(config)
        )
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.tokenizer = load_tokenizer(self.cfg.tokenizer_path)
        attn = choose_attn_implementation(self.cfg.attn_implementation, packing=False)
        self.model = load_causal_lm(self.cfg.model_name, self.cfg.torch_dtype, attn, self.device)
        self.model.eval()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.cfg.seed + int(os.environ.get("RANK", "0")))

    def get_pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id or 0)

    def generate(
        self,
        data: Mapping[str, Any],
        greedy: bool = False,
        sampling: SamplingConfig | Mapping[str, Any] | None = None,
    ) -> BatchedDataDict[Any]:

        batch = _as_batch(data)
        out = generate_batch(
            self.model,
            self.tokenizer,
            batch["input_ids"].to(self.device),
            batch["input_lengths"].to(self.device),
            self.cfg.with_overrides(sampling),
            self.cfg.max_total_sequence_length,
            greedy=greedy,
            stop_strings=batch.get("stop_strings"),
            generator=self.generator,
        )
        return BatchedDataDict(out)

    def update_weights(self, weights: WeightBucket) -> bool:

        load_weights(self.model, {name: tensor.to(self.device) for name, tensor in weights.items()})
        return True

    def prepare_for_generation(self) -> bool:

        move_module(self.model, self.device)
        return True

    def finish_generation(self) -> bool:
        """Move the weights off the accelerator so a colocated trainer can use it."""

        if self.device.type == "cuda":
            move_module(self.model, "cpu")
            torch.cuda.empty_cache()
        return True

    def shutdown(self) -> bool:
        if hasattr(self, "model"):
            del self.model
        return True


def _gather_outputs(results: list[BatchedDataDict[Any]], pad_token_id: int) -> BatchedDataDict[Any]:
    return BatchedDataDict.from_batches(results, pad_value_dict={"output_ids": pad_token_id})


class HFGeneration(GenerationInterface):
    """Driver side of a group of `HFGenerationWorker`s; prompts are split evenly over them."""

    def __init__(
        self,
        cluster: RayVirtualCluster,
        config: HFGenerationConfig | Mapping[str, Any],
        name_prefix: str = "",
        env_vars: dict[str, str] | None = None,
    ) -> None:
        from rl_core.distributed import RayWorkerGroup

        self.cfg = (
            config if isinstance(config, HFGenerationConfig) else HFGenerationConfig.model_validate(config)
        )
        self.worker_group = RayWorkerGroup(
            cluster,
            GENERATION_WORKER_FQN,
            init_kwargs={"config": self.cfg.to_dict()},
            env_vars=env_vars,
            name_prefix=name_prefix,
        )
        self.pad_token_id = int(self.worker_group.run_all_workers_single_data("get_pad_token_id")[0])

    def generate(self, data: Any, greedy: bool = False) -> BatchedDataDict[Any]:
        batch = _as_batch(data)
        shards = batch.shard_by_batch_size(self.worker_group.world_size, allow_uneven_shards=True)
        results = self.worker_group.run_all_workers_sharded_data(
            "generate", shards, in_sharded_axes=["dp"], replicate_on_axes=[], common_kwargs={"greedy": greedy}
        )
        return _gather_outputs(results, self.pad_token_id)

    def prepare_for_generation(self, **kwargs: Any) -> bool:
        return all(self.worker_group.run_all_workers_single_data("prepare_for_generation"))

    def finish_generation(self, **kwargs: Any) -> bool:
        return all(self.worker_group.run_all_workers_single_data("finish_generation"))

    def update_weights(self, buckets: Iterable[WeightBucket]) -> bool:
        return all(
            all(self.worker_group.run_all_workers_single_data("update_weights", bucket)) for bucket in buckets
        )

    def shutdown(self) -> bool:
        return self.worker_group.shutdown(cleanup_method="shutdown")


class ColocatedHFGeneration(GenerationInterface):
    """Generation with a `DTensorPolicy`'s own workers and weights (no refit needed)."""

    def __init__(self, policy: DTensorPolicy) -> None:
        self.policy = policy

    def generate(self, data: Any, greedy: bool = False) -> BatchedDataDict[Any]:
        return self.policy.generate(_as_batch(data), greedy=greedy)

    def prepare_for_generation(self, **kwargs: Any) -> bool:
        self.policy.prepare_for_lp_inference()
        return True

    def finish_generation(self, **kwargs: Any) -> bool:
        return True

    def update_weights(self, buckets: Iterable[WeightBucket]) -> bool:
        # The policy's model is the generation model: its weights are always current.
        return True

    def shutdown(self) -> bool:
        # The policy owns the workers; shutting this view down leaves them running.
        return True
