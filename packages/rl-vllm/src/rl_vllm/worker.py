"""vLLM generation workers (Ray actors, FQNs in `rl_core.distributed.actor_registry`).

* `VllmGenerationWorker`: the synchronous engine (`vllm.LLM`) in this process. With
  `tensor_parallel_size > 1` the ranks of one engine are consecutive workers of the group and
  run as SPMD peers (vLLM's `external_launcher`): every rank gets the same prompts and
  computes the same outputs, each on its shard of the model.
* `VllmAsyncGenerationWorker`: `vllm.v1.engine.async_llm.AsyncLLM` (continuous batching in
  an engine-core process); `generate_stream` yields each sample as soon as it finishes.

Both build requests and outputs with `rl_vllm.requests` and load weights through
`rl_vllm.worker_extension.WeightSyncExtension` (reached with `collective_rpc`), so they differ
only in how they talk to their engine. vLLM is imported when the engine starts, not when this
module is imported (the per-node initializer imports the class and should stay light).

The driver (`rl_vllm.generation.VllmGeneration`) constructs the workers, then calls
`init_engine` on every rank with its engine's rendezvous address.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import glob
import os
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import torch

from rl_core.data import BatchedDataDict
from rl_core.interfaces import WeightBucket
from rl_vllm.config import VllmConfig
from rl_vllm.refit import IpcBucket, WeightLayout, to_payload
from rl_vllm.requests import (
    NO_ROOM_TO_GENERATE,
    Completion,
    PromptRequest,
    assemble_output,
    completion_from_output,
    prompt_requests,
    sampling_params,
)

WORKER_EXTENSION = "rl_vllm.worker_extension.WeightSyncExtension"
# vLLM's CPU attention kernels exist for these head sizes only.
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def free_address() -> tuple[str, int]:
    """This node's IP and a port that is free on it."""
    import ray

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port = int(sock.getsockname()[1])
    return ray.util.get_node_ip_address(), port


def _check_cpu_head_size(model_name: str) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_name)
    text_config = getattr(config, "text_config", None) or config
    head_dim = (
        getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    )
    if head_dim not in CPU_ATTENTION_HEAD_SIZES:
        raise ValueError(
            f"model {model_name}: attention head size {head_dim} (hidden_size {text_config.hidden_size} / "
            f"{text_config.num_attention_heads} heads) is not supported by vLLM's CPU attention, which "
            f"supports {list(CPU_ATTENTION_HEAD_SIZES)}; use a model with one of those head sizes"
        )


def _rendezvous_by_tcp_for_external_launcher() -> None:
    """Make vLLM's external launcher rendezvous at `tcp://MASTER_ADDR:MASTER_PORT` (what its
    `env://` reads anyway) instead of `env://`.

    vLLM's CPU worker names its shared-memory all-reduce segments after the rendezvous URL; with
    `env://` every tensor-parallel engine on a node gets the same names, so two engines collide
    and segments a killed engine left behind make the next one fail ("create shm in SHMManager
    failed. errno: 17"). With the engine's own port in the URL the names are the engine's own.
    """
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    def distributed_args(self: Any) -> tuple[str, int, int]:
        address = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        return address, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])

    if not hasattr(ExecutorWithExternalLauncher, "_distributed_args"):
        raise RuntimeError(
            "this vLLM version's ExecutorWithExternalLauncher has no _distributed_args; rl-vllm's "
            "tensor-parallel CPU engines need updating for it"
        )
    ExecutorWithExternalLauncher._distributed_args = distributed_args  # type: ignore[method-assign]


class _VllmWorkerBase:
    """Configuration, engine arguments and request handling common to both engines."""

    def __init__(self, config: VllmConfig | Mapping[str, Any]) -> None:
        self.cfg = config if isinstance(config, VllmConfig) else VllmConfig.model_validate(config)
        # The group's layout (set by RayWorkerGroup): consecutive ranks form one engine.
        self.group_rank = int(os.environ.get("RANK", "0"))
        tp = self.cfg.tensor_parallel_size
        self.dp_rank, self.tp_rank = divmod(self.group_rank, tp)
        self.on_cuda = torch.cuda.is_available()
        # Settings vLLM reads from the environment, before it is imported.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.cfg.cpu_kv_cache_space_gib))
        # `LLM` then runs its engine in this actor; `AsyncLLM` always has an engine-core process,
        # and this keeps the model in it (on CPU vLLM would otherwise add a worker process).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.cfg.tokenizer_path)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = int(pad or 0)
        self.sleeping = False

    # ------------------------------------------------------------------------------ engine

    def node_address(self) -> tuple[str, int]:
        """Rendezvous address for this worker's engine (asked of its tensor-parallel rank 0)."""
        return free_address()

    def _engine_kwargs(self, master_address: str, master_port: int) -> dict[str, Any]:
        cfg = self.cfg
        if not self.on_cuda:
            _check_cpu_head_size(cfg.model_name)
        spmd = cfg.tensor_parallel_size > 1
        if spmd:
            # vLLM's external launcher reads the torch.distributed rendezvous of its own ranks.
            os.environ.update(
                RANK=str(self.tp_rank),
                LOCAL_RANK="0",  # each worker sees only its own device
                WORLD_SIZE=str(cfg.tensor_parallel_size),
                MASTER_ADDR=master_address,
                MASTER_PORT=str(master_port),
            )
            if not self.on_cuda:
                _rendezvous_by_tcp_for_external_launcher()
                self._shm_prefix = str(master_port)
        enforce_eager = cfg.enforce_eager if cfg.enforce_eager is not None else not self.on_cuda
        kwargs: dict[str, Any] = {
            "model": cfg.model_name,
            "tokenizer": cfg.tokenizer_path,
            "dtype": cfg.dtype,
            "max_model_len": cfg.max_total_sequence_length,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "seed": cfg.seed + self.dp_rank,  # engines of one group sample independently
            "enforce_eager": enforce_eager,
            "enable_prefix_caching": cfg.enable_prefix_caching,
            "logprobs_mode": cfg.logprobs_mode,
            "worker_extension_cls": WORKER_EXTENSION,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "enable_sleep_mode": cfg.colocated and self.on_cuda,
            "disable_log_stats": True,
        }
        if spmd:
            kwargs["distributed_executor_backend"] = "external_launcher"
        else:
            # The model in the engine process itself (the actor for `LLM`, the engine-core process
            # for `AsyncLLM`): no further worker process, and RPC arguments (weights) are used
            # where they arrive instead of being pickled on to another process.
            kwargs["distributed_executor_backend"] = "uni"
        if cfg.max_num_seqs is not None:
            kwargs["max_num_seqs"] = cfg.max_num_seqs
        return kwargs

    def describe(self) -> dict[str, Any]:
        """Plain facts about this process and its engine (safe to return to any driver)."""
        import vllm

        return {
            "python": sys.executable,
            "prefix": sys.prefix,
            "pid": os.getpid(),
            "vllm_version": str(vllm.__version__),
            "group_rank": self.group_rank,
            "dp_rank": self.dp_rank,
            "tp_rank": self.tp_rank,
            "device": "cuda" if self.on_cuda else "cpu",
        }

    def get_pad_token_id(self) -> int:
        return self.pad_token_id

    # ---------------------------------------------------------------------------- requests

    def _requests(self, data: Mapping[str, Any]) -> list[PromptRequest]:
        return prompt_requests(data, self.cfg)

    def _output(
        self, data: Mapping[str, Any], requests: list[PromptRequest], completions: list[Completion]
    ) -> BatchedDataDict[Any]:
        width = int(data["input_ids"].shape[1])
        return BatchedDataDict(assemble_output(requests, completions, self.pad_token_id, width))

    def _remove_shared_memory(self) -> None:
        """Unlink this rank's CPU shared-memory all-reduce segments, which vLLM leaves behind."""
        prefix = getattr(self, "_shm_prefix", "")
        if prefix:
            pattern = f"{glob.escape(prefix)}-*-cpushm_{self.tp_rank}"
            for path in glob.glob(os.path.join("/dev/shm", pattern)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def _check_awake(self) -> None:
        if self.sleeping:
            raise RuntimeError("the vLLM engine is asleep: call prepare_for_generation before generating")

    def _should_sleep(self) -> bool:
        # Sleeping frees accelerator memory for a colocated trainer; a CPU engine has none to free.
        return self.cfg.colocated and self.on_cuda


class VllmGenerationWorker(_VllmWorkerBase):
    """The synchronous engine, in this process (see the module docstring)."""

    def init_engine(self, master_address: str = "", master_port: int = 0) -> dict[str, Any]:
        from vllm import LLM

        self.llm = LLM(**self._engine_kwargs(master_address, master_port))
        return self.describe()

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        return list(self.llm.collective_rpc(method, args=args))

    def generate(self, data: Mapping[str, Any], greedy: bool = False) -> BatchedDataDict[Any]:
        """Generate for every row of `data` (see `rl_core.interfaces.GenerationInterface`)."""
        from vllm.inputs import TokensPrompt

        self._check_awake()
        requests = self._requests(data)
        completions: list[Completion] = [NO_ROOM_TO_GENERATE] * len(requests)
        rows = [row for row, r in enumerate(requests) if r.max_new_tokens > 0]
        if rows:
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=requests[row].token_ids) for row in rows],
                [sampling_params(self.cfg, requests[row], greedy) for row in rows],
                use_tqdm=False,
            )
            for row, output in zip(rows, outputs):
                completions[row] = completion_from_output(output)
        return self._output(data, requests, completions)

    # ------------------------------------------------------------------------------ weights

    def start_weight_update(self) -> bool:
        return all(self._rpc("rl_start_weight_update"))

    def load_weight_bucket(self, bucket: WeightBucket) -> int:
        return int(self._rpc("rl_load_weights", to_payload(bucket))[0])

    def load_weights_from_ipc_handles(self, handles: IpcBucket) -> int:
        return int(self._rpc("rl_load_weights_from_ipc", to_payload(handles))[0])

    def init_weight_broadcast(
        self, address: str, port: int, world_size: int, rank: int, backend: str
    ) -> bool:
        return all(self._rpc("rl_init_weight_broadcast", address, port, world_size, rank, backend))

    def receive_weight_broadcast(self, layout: WeightLayout) -> int:
        return int(self._rpc("rl_receive_weight_broadcast", to_payload(layout))[0])

    def finish_weight_update(self) -> int:
        return int(self._rpc("rl_finish_weight_update")[0])

    def invalidate_kv_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    # ------------------------------------------------------------------------------- phases

    def prepare_for_generation(self) -> bool:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False
        return True

    def finish_generation(self) -> bool:
        if self._should_sleep() and not self.sleeping:
            self.llm.reset_prefix_cache()
            self.llm.sleep(level=self.cfg.sleep_level)
            self.sleeping = True
        return True

    def shutdown(self) -> bool:
        if hasattr(self, "llm"):
            del self.llm
            gc.collect()
        self._remove_shared_memory()
        return True


class VllmAsyncGenerationWorker(_VllmWorkerBase):
    """`AsyncLLM`: requests are served as they come, each sample returned when it finishes."""

    async def init_engine(self, master_address: str = "", master_port: int = 0) -> dict[str, Any]:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**self._engine_kwargs(master_address, master_port))
        self.engine = AsyncLLM.from_engine_args(args)
        return self.describe()

    async def _rpc(self, method: str, *args: Any) -> list[Any]:
        return list(await self.engine.collective_rpc(method, args=args))

    async def _complete(self, request: PromptRequest, greedy: bool) -> Completion:
        from vllm.inputs import TokensPrompt

        if request.max_new_tokens <= 0:
            return NO_ROOM_TO_GENERATE
        final = None
        async for output in self.engine.generate(
            TokensPrompt(prompt_token_ids=request.token_ids),
            sampling_params(self.cfg, request, greedy, final_output_only=True),
            request_id=uuid.uuid4().hex,
        ):
            final = output
        if final is None or not final.finished:
            raise RuntimeError("vLLM's AsyncLLM ended a request without a final output")
        return completion_from_output(final)

    async def generate(self, data: Mapping[str, Any], greedy: bool = False) -> BatchedDataDict[Any]:
        """Generate for every row of `data`; returns when all rows are done."""
        self._check_awake()
        requests = self._requests(data)
        completions = await asyncio.gather(*(self._complete(r, greedy) for r in requests))
        return self._output(data, requests, list(completions))

    async def generate_stream(
        self, data: Mapping[str, Any], greedy: bool = False
    ) -> AsyncIterator[tuple[int, BatchedDataDict[Any]]]:
        """Yield `(row, one-row output)` for each row of `data` in the order the rows finish."""
        self._check_awake()
        requests = self._requests(data)
        width = int(data["input_ids"].shape[1])

        async def run(row: int) -> tuple[int, Completion]:
            return row, await self._complete(requests[row], greedy)

        for finished in asyncio.as_completed([run(row) for row in range(len(requests))]):
            row, completion = await finished
            one = assemble_output([requests[row]], [completion], self.pad_token_id, width)
            yield row, BatchedDataDict(one)

    # ------------------------------------------------------------------------------ weights

    async def start_weight_update(self) -> bool:
        return all(await self._rpc("rl_start_weight_update"))

    async def load_weight_bucket(self, bucket: WeightBucket) -> int:
        return int((await self._rpc("rl_load_weights", to_payload(bucket)))[0])

    async def load_weights_from_ipc_handles(self, handles: IpcBucket) -> int:
        return int((await self._rpc("rl_load_weights_from_ipc", to_payload(handles)))[0])

    async def init_weight_broadcast(
        self, address: str, port: int, world_size: int, rank: int, backend: str
    ) -> bool:
        return all(await self._rpc("rl_init_weight_broadcast", address, port, world_size, rank, backend))

    async def receive_weight_broadcast(self, layout: WeightLayout) -> int:
        return int((await self._rpc("rl_receive_weight_broadcast", to_payload(layout)))[0])

    async def finish_weight_update(self) -> int:
        return int((await self._rpc("rl_finish_weight_update"))[0])

    async def invalidate_kv_cache(self) -> bool:
        return bool(await self.engine.reset_prefix_cache())

    # ------------------------------------------------------------------------------- phases

    async def prepare_for_generation(self) -> bool:
        if self.sleeping:
            await self.engine.wake_up()
            self.sleeping = False
        return True

    async def finish_generation(self) -> bool:
        if self._should_sleep() and not self.sleeping:
            await self.engine.reset_prefix_cache()
            await self.engine.sleep(level=self.cfg.sleep_level)
            self.sleeping = True
        return True

    async def shutdown(self) -> bool:
        if hasattr(self, "engine"):
            self.engine.shutdown()
            del self.engine
        self._remove_shared_memory()
        return True
