"""Moving full (unsharded) weights from a trainer process into vLLM engines without files.

Three transports, one receiving path (`WeightSyncExtension.rl_load_weights`):

* Object store (CPU, and any setup without a shared device): the driver `ray.put`s each bucket
  of `{name: tensor}` once and every engine reads it.
* CUDA IPC (trainer and engine colocated on the same GPU): the trainer process exports handles
  to its GPU tensors (`cuda_ipc_handles`), keyed by the device's UUID; the engine on that GPU
  maps them (`tensors_from_ipc_handles`) and copies the weights in, with no host round trip.
  The trainer must keep the tensors alive until the engine reports the bucket loaded.
* Broadcast (trainer and engines on different devices): a process group of its own, separate
  from any default group either side already has (`WeightBroadcastGroup`), whose rank 0 is the
  trainer's sending rank and ranks 1.. the engine ranks; NCCL on GPUs, gloo on CPUs.

Everything here needs only torch, so a trainer's environment can use the sending half without
installing vLLM.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from rl_core.interfaces import WeightBucket

IpcHandle = tuple[Callable[..., torch.Tensor], tuple[Any, ...]]
IpcBucket = dict[str, dict[str, IpcHandle]]  # device UUID -> parameter name -> handle
WeightLayout = dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype name)

# Position of the device index among the arguments of torch's `rebuild_cuda_tensor`.
_IPC_DEVICE_ARG = 6

Payload = bytes


def to_payload(obj: Any) -> Payload:
    """`obj` pickled, to cross vLLM's RPC intact (see `rl_vllm.worker_extension`). Both ends
    are our own processes in the same venv."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def from_payload(payload: Payload | memoryview) -> Any:
    return pickle.loads(payload)


def cuda_device_uuid(device: torch.device | int | None = None) -> str:
    """The UUID of a CUDA device: the same GPU has the same UUID in every process, whatever its
    index under that process's CUDA_VISIBLE_DEVICES."""
    return str(
        torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device()).uuid
    )


def cuda_ipc_handles(bucket: WeightBucket) -> IpcBucket:
    """Sender side: IPC handles to the bucket's CUDA tensors, keyed by their device's UUID."""
    from torch.multiprocessing.reductions import reduce_tensor

    handles: IpcBucket = {}
    for name, tensor in bucket.items():
        if not tensor.is_cuda:
            raise ValueError(f"CUDA IPC needs CUDA tensors; {name!r} is on {tensor.device}")
        handles.setdefault(cuda_device_uuid(tensor.device), {})[name] = reduce_tensor(
            tensor.detach().contiguous()
        )
    return handles


def tensors_from_ipc_handles(handles: IpcBucket, device: torch.device) -> WeightBucket:
    """Receiver side: the tensors the sender on this process's GPU exported (zero-copy views)."""
    uuid = cuda_device_uuid(device)
    if uuid not in handles:
        raise RuntimeError(
            f"no CUDA IPC handles for this engine's GPU {uuid} (handles cover {sorted(handles)}); "
            "CUDA IPC needs the trainer and the engine on the same GPU"
        )
    tensors: WeightBucket = {}
    for name, (rebuild, args) in handles[uuid].items():
        local_args = list(args)
        local_args[_IPC_DEVICE_ARG] = device.index
        tensors[name] = rebuild(*local_args)
    return tensors


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} in the weight layout")
    return dtype


class WeightBroadcastGroup:
    """A process group of one sender (rank 0) and the engine ranks, for weight broadcasts.

    Built from its own TCP store at `address:port` (rank 0 hosts it), so it is independent of
    the default process group the trainer (FSDP) and vLLM (its tensor-parallel group) already
    use. Every member must construct it at the same time.
    """

    def __init__(
        self,
        address: str,
        port: int,
        rank: int,
        world_size: int,
        backend: Literal["nccl", "gloo"],
        timeout_s: float = 600.0,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the broadcast group of {world_size}")
        timeout = timedelta(seconds=timeout_s)
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
        if backend == "nccl":
            self._group: Any = dist.ProcessGroupNCCL(store, rank, world_size, dist.ProcessGroupNCCL.Options())
        elif backend == "gloo":
            self._group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        else:
            raise ValueError(f"unknown broadcast backend {backend!r}; use 'nccl' or 'gloo'")

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._group.broadcast([tensor], options).wait()

    def send(self, bucket: Mapping[str, torch.Tensor]) -> None:
        """Rank 0: broadcast the bucket's tensors, in the order of its keys."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 of a WeightBroadcastGroup sends")
        for tensor in bucket.values():
            self._broadcast(tensor.detach().contiguous())

    def receive(self, layout: WeightLayout, device: torch.device) -> WeightBucket:
        """Ranks > 0: receive the tensors `layout` describes, in its order, onto `device`."""
        if self.rank == 0:
            raise RuntimeError("rank 0 of a WeightBroadcastGroup sends; it does not receive")
        bucket: WeightBucket = {}
        for name, (shape, dtype) in layout.items():
            tensor = torch.empty(tuple(shape), dtype=_torch_dtype(dtype), device=device)
            self._broadcast(tensor)
            bucket[name] = tensor
        return bucket

    @staticmethod
    def layout_of(bucket: Mapping[str, torch.Tensor]) -> WeightLayout:
        """What the receivers need to know about a bucket before it is sent."""
        return {name: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket.items()}
