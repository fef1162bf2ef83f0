"""`Policy`: the driver-side `PolicyInterface` over a Ray group of policy workers.

The worker class is chosen by `config.backend` and named by fully-qualified class, so the
driver never imports the backend (`rl_dtensor.worker.DTensorPolicyWorker` for "dtensor").

Workers are laid out `dp x tp` (row-major: the TP ranks of one replica are adjacent). Batches
are cut per optimiser step and split over `dp` with `BatchedDataDict.shard_by_batch_size`
(dynamic batching / sequence packing plans included); the TP ranks of a replica receive the same
shard, and results come back in the original row order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from rl_core.data import BatchedDataDict
from rl_core.distributed import NamedSharding, RayVirtualCluster, RayWorkerGroup
from rl_core.interfaces import LossFunction, PolicyInterface, WeightBucket
from rl_core.policy.batching import Purpose, sharding_args
from rl_core.policy.config import PolicyConfig, SamplingConfig
from rl_core.policy.refit import RefitInfo, plan_buckets

# Workers are named, never imported: the driver needs no backend package (DESIGN.md §2).
POLICY_WORKER_FQNS: dict[str, str] = {"dtensor": "rl_dtensor.worker.DTensorPolicyWorker"}



class Policy(PolicyInterface):
    """A policy trained by `cluster.world_size()` Ray workers of the configured backend."""

    def __init__(
        self,
        cluster: RayVirtualCluster,
        config: PolicyConfig | Mapping[str, Any],
        name_prefix: str = "",
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
        env_vars: dict[str, str] | None = None,
    ) -> None:
        self.cfg = (
            config if isinstance(config, PolicyConfig) else PolicyConfig.model_validate(config)
        )
        world_size = cluster.world_size()
        tp = self.cfg.dtensor.tp_size
        if world_size % tp != 0:
            raise ValueError(f"the cluster's {world_size} workers are not divisible by dtensor.tp_size={tp}")
        self.dp_size = world_size // tp
        sharding = NamedSharding(np.arange(world_size).reshape(self.dp_size, tp), ["dp", "tp"])
        self.worker_group = RayWorkerGroup(
            cluster,
            POLICY_WORKER_FQNS[self.cfg.backend],
            sharding=sharding,
            init_kwargs={
                "config": self.cfg.to_dict(),
                "weights_path": weights_path,
                "optimizer_path": optimizer_path,
                "init_optimizer": init_optimizer,
            },
            env_vars=env_vars,
            name_prefix=name_prefix,
        )
        self.pad_token_id = int(self.worker_group.run_all_workers_single_data("get_pad_token_id")[0])

    # ------------------------------------------------------------------------------- dispatch

    def _shard(
        self, data: BatchedDataDict[Any], purpose: Purpose, batch_size: int | None
    ) -> tuple[list[BatchedDataDict[Any]], list[int] | None]:
        dynamic, packing = sharding_args(self.cfg, purpose)
        uneven = purpose != "train"
        if dynamic is not None:
            return data.shard_by_batch_size(
                self.dp_size, batch_size, allow_uneven_shards=uneven, dynamic_batching_args=dynamic
            )
        if packing is not None:
            return data.shard_by_batch_size(
                self.dp_size, batch_size, allow_uneven_shards=uneven, sequence_packing_args=packing
            )
        return data.shard_by_batch_size(self.dp_size, batch_size, allow_uneven_shards=uneven), None

    def _run_sharded(self, method: str, shards: list[BatchedDataDict[Any]], **kwargs: Any) -> list[Any]:
        return self.worker_group.run_all_workers_sharded_data(
            method,
            shards,
            in_sharded_axes=["dp"],
            replicate_on_axes=["tp"],
            output_is_replicated=["tp"],
            common_kwargs=kwargs,
        )

    def _per_row(
        self,
        method: str,
        data: Any,
        purpose: Purpose,
        pad_values: Mapping[str, float] | None = None,
        **kwargs: Any,
    ) -> BatchedDataDict[Any]:
        """Run a per-row method on the dp shards and reassemble its outputs in input order."""
        shards, sorted_indices = self._shard(BatchedDataDict.ensure(data), purpose, None)
        results = self._run_sharded(method, shards, **kwargs)
        out = BatchedDataDict.from_batches(results, pad_value_dict=pad_values)
        return out.reorder_data(sorted_indices) if sorted_indices is not None else out

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.worker_group.run_all_workers_single_data(method, *args, **kwargs)

    # ------------------------------------------------------------------------------ inference

    def get_logprobs(self, data: Any, micro_batch_size: int | None = None) -> BatchedDataDict[Any]:
        return self._per_row("get_logprobs", data, "logprob", micro_batch_size=micro_batch_size)

    def get_reference_policy_logprobs(
        self, data: Any, micro_batch_size: int | None = None
    ) -> BatchedDataDict[Any]:
        return self._per_row(
            "get_reference_policy_logprobs", data, "logprob", micro_batch_size=micro_batch_size
        )

    def get_topk_logits(self, data: Any, k: int, micro_batch_size: int | None = None) -> BatchedDataDict[Any]:
        return self._per_row("get_topk_logits", data, "logprob", k=k, micro_batch_size=micro_batch_size)

    def generate(
        self, data: Any, greedy: bool = False, sampling: SamplingConfig | Mapping[str, Any] | None = None
    ) -> BatchedDataDict[Any]:
        """Generate with the policy's own workers (see `ColocatedGeneration`)."""
        batch = BatchedDataDict.ensure(data)
        shards = batch.shard_by_batch_size(self.dp_size, allow_uneven_shards=True)
        overrides = sampling.model_dump() if isinstance(sampling, SamplingConfig) else sampling
        results = self._run_sharded("generate", shards, greedy=greedy, sampling=overrides)
        return BatchedDataDict.from_batches(results, pad_value_dict={"output_ids": self.pad_token_id})

    # -------------------------------------------------------------------------------- training

    def train(
        self,
        data: Any,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """Optimiser steps over `data` (one per `gbs` rows); metrics as `DTensorPolicyWorker.train`."""
        batch = BatchedDataDict.ensure(data)
        gbs = gbs or self.cfg.train_global_batch_size
        shards, _ = self._shard(batch, "train", gbs)
        results = self._run_sharded("train", shards, loss_fn=loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs)
        # Every worker returns the metrics already reduced over the data-parallel ranks.
        metrics: dict[str, Any] = results[0]
        return metrics

    def prepare_for_training(self) -> None:
        self._all("prepare_for_training")

    def prepare_for_lp_inference(self) -> None:
        self._all("prepare_for_lp_inference")

    def finish_training(self) -> None:
        self._all("finish_training")

    def offload_before_refit(self) -> None:
        self._all("offload_before_refit")

    def offload_after_refit(self) -> None:
        self._all("offload_after_refit")

    # ------------------------------------------------------------------------- weights out

    def prepare_refit_info(self) -> RefitInfo:
        info: RefitInfo = self._all("prepare_refit_info")[0]
        return {name: (tuple(shape), dtype) for name, (shape, dtype) in info.items()}

    def stream_weights(self, bucket_size_bytes: int | None = None) -> Iterator[WeightBucket]:
        """Full weights, bucket by bucket: every worker joins each gather, rank 0's copy is sent."""
        bucket_size = bucket_size_bytes or self.cfg.refit_bucket_size_bytes
        for names in plan_buckets(self.prepare_refit_info(), bucket_size):
            bucket: WeightBucket = self._all("gather_weights", names)[0]
            yield bucket

    # ---------------------------------------------------------------------------- checkpoints

    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        self._all("save_checkpoint", weights_path, optimizer_path, tokenizer_path)

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        self._all("load_checkpoint", weights_path, optimizer_path)

    def export_hf(self, out_dir: str) -> str:
        path: str = self._all("export_hf", out_dir)[0]
        return path

    def shutdown(self) -> bool:
        return self.worker_group.shutdown(cleanup_method="shutdown")
