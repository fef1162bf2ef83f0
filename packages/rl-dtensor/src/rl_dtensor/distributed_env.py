"""Joining the worker group's torch.distributed process group from the launcher's env vars."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedEnv:
    rank: int
    world_size: int
    device: torch.device


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from exc


def init_distributed() -> DistributedEnv:
    """Initialise (once per process) the default process group from RANK / WORLD_SIZE /
    MASTER_ADDR / MASTER_PORT, as set by `RayWorkerGroup` or `torchrun`.

    Without those variables the process forms a 1-rank group on its own. CPU collectives use
    gloo; with CUDA, tensors on the GPU go through NCCL and CPU tensors through gloo.
    """
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        local_rank = _env_int("LOCAL_RANK", 0)
        # Ray gives each actor its own CUDA_VISIBLE_DEVICES, so the local index is usually 0.
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        rank = _env_int("RANK", 0)
        world_size = _env_int("WORLD_SIZE", 1)
        if world_size == 1 and "MASTER_PORT" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(_free_port())
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise RuntimeError(
                f"WORLD_SIZE={world_size} but {', '.join(missing)} is not set; the worker group launcher "
                "must set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
            )
        backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    return DistributedEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)
