"""Sharded checkpoints with torch.distributed.checkpoint (DCP), and conversion to HF format.

Layout (matches DESIGN.md §6's `policy/weights`, `policy/optimizer`):

    weights/    DCP shards of the model state dict (keys `model.<HF name>`) + config.json
    optimizer/  DCP shards of the optimiser state + `trainer_state_rank<r>.pt` (LR scheduler,
                RNG states of that rank)

DCP stores every rank's shards with their global offsets, so a checkpoint loads into any
number of ranks or a single process (the converter).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import PretrainedConfig

MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
HF_CONFIG_FILE = "config.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _trainer_state_file(optimizer_path: Path, rank: int) -> Path:
    return optimizer_path / f"trainer_state_rank{rank}.pt"


def save_sharded_checkpoint(
    model: nn.Module,
    weights_path: str | Path,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    optimizer_path: str | Path | None = None,
    hf_config: PretrainedConfig | None = None,
    extra_state: dict[str, Any] | None = None,
) -> None:
    """Save model (and optimiser, scheduler, RNG) state; a collective over all ranks.

    `extra_state` (per rank, e.g. the state of a sampling generator) is stored with the RNG
    states and handed back by `load_sharded_checkpoint`.
    """
    weights_dir = Path(weights_path)
    dcp.save({MODEL_KEY: get_model_state_dict(model)}, checkpoint_id=str(weights_dir))
    if hf_config is not None and _rank() == 0:
        hf_config.to_json_file(str(weights_dir / HF_CONFIG_FILE))
    if optimizer_path is None:
        return
    if optimizer is None:
        raise ValueError("optimizer_path was given but the worker has no optimizer")
    optim_dir = Path(optimizer_path)
    dcp.save({OPTIMIZER_KEY: get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(optim_dir))
    trainer_state = {
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": rng_state(),
        "extra": extra_state or {},
    }
    torch.save(trainer_state, _trainer_state_file(optim_dir, _rank()))
    if dist.is_initialized():
        dist.barrier()


def require_checkpoint_dir(path: Path, what: str) -> None:
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{what} checkpoint {str(path)!r} not found (no DCP .metadata file there)")


def load_sharded_checkpoint(
    model: nn.Module,
    weights_path: str | Path,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    optimizer_path: str | Path | None = None,
) -> dict[str, Any]:
    """Load what `save_sharded_checkpoint` wrote into an already sharded model / optimiser.

    RNG states are restored, and this rank's `extra_state` returned, when the checkpoint has a
    file for this rank (same world size); otherwise the returned dict is empty.
    """
    weights_dir = Path(weights_path)
    require_checkpoint_dir(weights_dir, "model")
    model_state = {MODEL_KEY: get_model_state_dict(model)}
    dcp.load(model_state, checkpoint_id=str(weights_dir))
    set_model_state_dict(model, model_state[MODEL_KEY])
    if optimizer_path is None:
        return {}
    if optimizer is None:
        raise ValueError("optimizer_path was given but the worker has no optimizer")
    optim_dir = Path(optimizer_path)
    require_checkpoint_dir(optim_dir, "optimizer")
    optim_state = {OPTIMIZER_KEY: get_optimizer_state_dict(model, optimizer)}
    dcp.load(optim_state, checkpoint_id=str(optim_dir))
    set_optimizer_state_dict(model, optimizer, optim_state[OPTIMIZER_KEY])
    own = _trainer_state_file(optim_dir, _rank())
    state_file = own if own.is_file() else _trainer_state_file(optim_dir, 0)
    trainer_state = torch.load(state_file, weights_only=False)
    if scheduler is not None and trainer_state["scheduler"] is not None:
        scheduler.load_state_dict(trainer_state["scheduler"])
    if not own.is_file():
        return {}
    set_rng_state(trainer_state["rng"])
    extra: dict[str, Any] = trainer_state.get("extra") or {}
    return extra
