"""`VllmGeneration`: the driver-side `GenerationInterface` over a Ray group of vLLM engines.

The group's workers are laid out `dp x tp` (row-major: the tensor-parallel ranks of one engine
are consecutive). Prompts are split over the `dp` engines in contiguous shards and the results
concatenated back in input order; the ranks of one engine all get its shard and only rank 0's
result is kept. The workers run in the `vllm` environment's venv (`rl_vllm.environment`); this
module, like everything the driver imports, never imports vLLM.

Weights: `update_weights(buckets)` puts each bucket of full tensors into Ray's object store once
and every engine rank loads it, inside one update session per refit (see
`rl_vllm.worker_extension`); the time it took is in `last_refit_metrics` and the log. On GPUs
the same session can be fed from CUDA IPC handles (`update_weights_from_ipc_handles`) or from a
broadcast (`init_weight_broadcast` + `receive_weight_broadcast`), see `rl_vllm.refit`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import numpy as np
import ray

from rl_core import venvs
from rl_core.data import BatchedDataDict
from rl_core.distributed import NamedSharding, RayVirtualCluster, RayWorkerGroup
from rl_core.interfaces import GenerationInterface, WeightBucket
from rl_vllm.config import VllmConfig
from rl_vllm.environment import register_vllm_environment, vllm_importable_here, vllm_install_blocker
from rl_vllm.refit import IpcBucket, WeightLayout

logger = logging.getLogger(__name__)

SYNC_WORKER_FQN = "rl_vllm.worker.VllmGenerationWorker"
ASYNC_WORKER_FQN = "rl_vllm.worker.VllmAsyncGenerationWorker"


class VllmUnavailableError(RuntimeError):
    """vLLM cannot be installed for this machine; the message says why and what to change."""


def _bucket_bytes(bucket: WeightBucket) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in bucket.values())


class VllmGeneration(GenerationInterface):
    """`cluster.world_size() / tensor_parallel_size` vLLM engines on `cluster`'s bundles.

    Args:
        cluster: one bundle per engine rank (a GPU each on GPU clusters).
        config: `VllmConfig` (or a mapping of it).
        name_prefix: workers are named actors `{name_prefix}-{rank}`.
        env_vars: extra environment variables for the workers (e.g. `OMP_NUM_THREADS`).
    """

    def __init__(
        self,
        cluster: RayVirtualCluster,
        config: VllmConfig | Mapping[str, Any],
        name_prefix: str = "vllm",
        env_vars: dict[str, str] | None = None,
    ) -> None:
        self.cfg = config if isinstance(config, VllmConfig) else VllmConfig.model_validate(config)
        world_size = cluster.world_size()
        tp = self.cfg.tensor_parallel_size
        if world_size % tp:
            raise ValueError(
                f"the generation cluster's {world_size} bundles are not divisible by "
                f"tensor_parallel_size={tp}"
            )
        register_vllm_environment()
        # Single-venv mode runs workers in the driver's interpreter; that only works for vLLM
        # where the driver has it, so otherwise the workers still get the vllm venv.
        single_venv = venvs.is_single_venv_mode() and vllm_importable_here()
        if not single_venv:
            blocker = vllm_install_blocker()
            if blocker is not None:
                raise VllmUnavailableError(blocker)
        self.dp_size = world_size // tp
        self.sharding = NamedSharding(np.arange(world_size).reshape(self.dp_size, tp), ["dp", "tp"])
        worker_env = {"TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING", **(env_vars or {})}
        self.worker_group = RayWorkerGroup(
            cluster,
            ASYNC_WORKER_FQN if self.cfg.async_engine else SYNC_WORKER_FQN,
            sharding=self.sharding,
            init_kwargs={"config": self.cfg.to_dict()},
            env_vars=worker_env,
            name_prefix=name_prefix,
            single_venv=single_venv,
        )
        try:
            self.engine_info: list[dict[str, Any]] = self._start_engines()
            self.pad_token_id = int(self.worker_group.run_all_workers_single_data("get_pad_token_id")[0])
        except BaseException:
            self.worker_group.shutdown()
            raise
        self.last_refit_metrics: dict[str, float] = {}

    def _engine_leaders(self) -> list[int]:
        return [self.sharding.get_ranks(dp=d, tp=0)[0] for d in range(self.dp_size)]

    def _start_engines(self) -> list[dict[str, Any]]:
        tp = self.cfg.tensor_parallel_size
        workers = self.worker_group.workers
        if tp == 1:
            rendezvous: list[tuple[str, int]] = [("", 0)] * self.dp_size
        else:
            # Each engine's ranks meet at a free port on its rank 0's node.
            leaders = self._engine_leaders()
            rendezvous = self.worker_group.get_results(
                [workers[rank].node_address.remote() for rank in leaders], "node_address", leaders
            )
        refs = [worker.init_engine.remote(*rendezvous[rank // tp]) for rank, worker in enumerate(workers)]
        info: list[dict[str, Any]] = self.worker_group.get_results(refs, "init_engine")
        return info

    def _all(self, method: str, *args: Any) -> list[Any]:
        return self.worker_group.run_all_workers_single_data(method, *args)

    # ------------------------------------------------------------------------------ generation

    def _shards(self, data: Any) -> list[BatchedDataDict[Any]]:
        batch = BatchedDataDict.ensure(data)
        return batch.shard_by_batch_size(self.dp_size, allow_uneven_shards=True)

    def generate(self, data: Any, greedy: bool = False) -> BatchedDataDict[Any]:
        results = self.worker_group.run_all_workers_sharded_data(
            "generate",
            self._shards(data),
            in_sharded_axes=["dp"],
            replicate_on_axes=["tp"],
            output_is_replicated=["tp"],
            common_kwargs={"greedy": greedy},
        )
        return BatchedDataDict.from_batches(results, pad_value_dict={"output_ids": self.pad_token_id})

    async def generate_async(self, data: Any, greedy: bool = False) -> AsyncIterator[tuple[int, Any]]:
        """Yield `(index in data, one-row output)` as samples finish, across all engines.

        With the synchronous engine a whole shard finishes at once, so this falls back to
        `generate` (the interface's default).
        """
        if not self.cfg.async_engine:
            async for item in super().generate_async(data, greedy):
                yield item
            return
        shards = self._shards(data)
        offsets = np.cumsum([0] + [shard.size for shard in shards[:-1]]).tolist()
        workers = self.worker_group.workers
        streams: list[Any] = [
            workers[leader].generate_stream.options(num_returns="streaming").remote(shard, greedy)
            for leader, shard in zip(self._engine_leaders(), shards)
        ]

        async def next_result(stream: Any) -> tuple[int, BatchedDataDict[Any]] | None:
            try:
                ref = await stream.__anext__()
            except StopAsyncIteration:
                return None
            result: tuple[int, BatchedDataDict[Any]] = await ref
            return result

        pending = {asyncio.ensure_future(next_result(s)): engine for engine, s in enumerate(streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    engine = pending.pop(task)
                    result = task.result()
                    if result is None:
                        continue
                    row, output = result
                    yield offsets[engine] + row, output
                    pending[asyncio.ensure_future(next_result(streams[engine]))] = engine
        finally:
            for task in pending:
                task.cancel()

    # --------------------------------------------------------------------------------- weights

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def finish_weight_update(self) -> int:
        """End the update session; returns the number of tensors each engine rank loaded."""
        counts = self._all("finish_weight_update")
        if len(set(counts)) != 1:
            raise RuntimeError(f"engine ranks loaded different numbers of tensors: {counts}")
        return int(counts[0])

    def update_weights(self, buckets: Iterable[WeightBucket]) -> bool:
        """Load full weights by name into every engine through Ray's object store."""
        started = time.perf_counter()
        self.start_weight_update()
        num_buckets = num_bytes = 0
        for bucket in buckets:
            # One object-store copy, read by every engine rank.
            bucket_ref = ray.put(bucket)
            self._all("load_weight_bucket", bucket_ref)
            num_buckets += 1
            num_bytes += _bucket_bytes(bucket)
        tensors = self.finish_weight_update()
        self._record_refit(started, num_buckets, tensors, num_bytes, "object_store")
        return True

    def update_weights_from_ipc_handles(self, handle_buckets: Iterable[IpcBucket]) -> bool:
        """Colocated GPUs: load buckets the trainer exported as CUDA IPC handles
        (`rl_vllm.refit.cuda_ipc_handles`); each engine rank maps those of its own GPU."""
        started = time.perf_counter()
        self.start_weight_update()
        num_buckets = 0
        for handles in handle_buckets:
            self._all("load_weights_from_ipc_handles", handles)
            num_buckets += 1
        tensors = self.finish_weight_update()
        self._record_refit(started, num_buckets, tensors, 0, "cuda_ipc")
        return True

    def init_weight_broadcast(self, address: str, port: int, backend: str = "nccl") -> list[Any]:
        """Join every engine rank to a `rl_vllm.refit.WeightBroadcastGroup` at `address:port`
        as ranks 1..N; the sender (rank 0) must join concurrently. Returns the pending calls
        (wait for them after the sender has joined); the group size is `broadcast_world_size`."""
        world = self.broadcast_world_size
        return [
            worker.init_weight_broadcast.remote(address, port, world, rank + 1, backend)
            for rank, worker in enumerate(self.worker_group.workers)
        ]

    @property
    def broadcast_world_size(self) -> int:
        return 1 + self.worker_group.world_size

    def receive_weight_broadcast(self, layout: WeightLayout) -> list[Any]:
        """Start receiving one broadcast bucket on every engine rank (inside an update session);
        returns the pending calls, which finish once the sender has broadcast the bucket."""
        return self.worker_group.run_all_workers_single_data_async("receive_weight_broadcast", layout)

    def _record_refit(self, started: float, buckets: int, tensors: int, num_bytes: int, path: str) -> None:
        seconds = time.perf_counter() - started
        self.last_refit_metrics = {
            "refit_time_s": seconds,
            "refit_buckets": float(buckets),
            "refit_tensors": float(tensors),
            "refit_bytes": float(num_bytes),
        }
        logger.info(
            "vLLM refit (%s): %d tensors in %d buckets (%.1f MB) into %d engine rank(s) in %.3f s",
            path,
            tensors,
            buckets,
            num_bytes / 1e6,
            self.worker_group.world_size,
            seconds,
        )

    def invalidate_kv_cache(self) -> bool:
        return all(self._all("invalidate_kv_cache"))

    # ---------------------------------------------------------------------------------- phases

    def prepare_for_generation(self, **kwargs: Any) -> bool:
        return all(self._all("prepare_for_generation"))

    def finish_generation(self, **kwargs: Any) -> bool:
        return all(self._all("finish_generation"))

    def shutdown(self) -> bool:
        return self.worker_group.shutdown(cleanup_method="shutdown")
