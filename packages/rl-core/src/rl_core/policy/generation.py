"""Driver-side generation engines that need no particular backend package.

* `WorkerGroupGeneration`: a `GenerationInterface` over a Ray group of generation workers named
  by fully-qualified class (e.g. `rl_dtensor.generation.HFGenerationWorker`); prompts are split
  evenly over the workers, and weights arrive through `update_weights` as full tensors by name.
* `ColocatedGeneration`: generation with the policy workers' own (sharded) model, so there is
  nothing to refit: the rollout backend for CPU runs and debugging.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from rl_core.data import BatchedDataDict
from rl_core.interfaces import GenerationInterface, WeightBucket
from rl_core.policy.config import HFGenerationConfig

if TYPE_CHECKING:
    from rl_core.distributed import RayVirtualCluster
    from rl_core.policy.lm_policy import Policy

HF_GENERATION_WORKER_FQN = "rl_dtensor.generation.HFGenerationWorker"



def _gather_outputs(results: list[BatchedDataDict[Any]], pad_token_id: int) -> BatchedDataDict[Any]:
    return BatchedDataDict.from_batches(results, pad_value_dict={"output_ids": pad_token_id})


class WorkerGroupGeneration(GenerationInterface):
    """Driver side of a group of generation workers; prompts are split evenly over them."""

    def __init__(
        self,
        cluster: RayVirtualCluster,
        config: HFGenerationConfig | Mapping[str, Any],
        name_prefix: str = "",
        env_vars: dict[str, str] | None = None,
        worker_fqn: str = HF_GENERATION_WORKER_FQN,
    ) -> None:
        from rl_core.distributed import RayWorkerGroup

        self.cfg = (
            config if isinstance(config, HFGenerationConfig) else HFGenerationConfig.model_validate(config)
        )
        self.worker_group = RayWorkerGroup(
            cluster,
            worker_fqn,
            init_kwargs={"config": self.cfg.to_dict()},
            env_vars=env_vars,
            name_prefix=name_prefix,
        )
        self.pad_token_id = int(self.worker_group.run_all_workers_single_data("get_pad_token_id")[0])

    def generate(self, data: Any, greedy: bool = False) -> BatchedDataDict[Any]:
        batch = BatchedDataDict.ensure(data)
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


class ColocatedGeneration(GenerationInterface):
    """Generation with a `Policy`'s own workers and weights (no refit needed)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def generate(self, data: Any, greedy: bool = False) -> BatchedDataDict[Any]:
        return self.policy.generate(BatchedDataDict.ensure(data), greedy=greedy)

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
