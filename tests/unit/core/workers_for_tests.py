"""Actor classes for the worker-group tests, named to Ray by string (never imported by the driver's code).

Workers get this directory on PYTHONPATH through the worker group's ``env_vars`` (see
``WORKER_ENV``), so the module imports the same way in the driver's venv and in an isolated one.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

WORKERS_DIR = str(Path(__file__).resolve().parent)
WORKER_ENV = {"PYTHONPATH": WORKERS_DIR}
MODULE = "workers_for_tests"
SYSTEM_WORKER_FQN = f"{MODULE}.EnvReportingWorker"
ISOLATED_WORKER_FQN = f"{MODULE}.IsolatedEnvReportingWorker"

DISTRIBUTED_ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


class EnvReportingWorker:
    """Records the distributed environment it was constructed in; echoes payloads with its rank."""

    def __init__(self, tag: str = "", fail_on_rank: int | None = None) -> None:
        # Read at construction: the contract is that these exist before __init__ runs.
        self.env_at_init = {key: os.environ.get(key) for key in DISTRIBUTED_ENV_KEYS}
        self.rank = int(os.environ["RANK"])
        self.tag = tag
        self.cleaned_up = False
        if fail_on_rank == self.rank:
            raise ValueError(f"constructor told to fail on rank {self.rank}")

    def report_env(self) -> dict[str, Any]:
        return {**self.env_at_init, "tag": self.tag}

    def interpreter(self) -> dict[str, Any]:
        import ray

        torch_spec = importlib.util.find_spec("torch")
        return {
            "prefix": sys.prefix,
            "executable": sys.executable,
            "ray_file": ray.__file__,
            "torch_origin": torch_spec.origin if torch_spec else None,
            "placement_group_id": ray.get_runtime_context().get_placement_group_id(),
        }

    def all_reduce_rank_sum(self) -> float:
        """A real gloo rendezvous through MASTER_ADDR/MASTER_PORT: sum of (rank + 1) over workers."""
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://")
        try:
            value = torch.tensor([float(self.rank + 1)])
            dist.all_reduce(value)
            return float(value.item())
        finally:
            dist.destroy_process_group()

    def echo(self, payload: Any, offset: int = 0) -> dict[str, Any]:
        return {"rank": self.rank, "payload": payload, "offset": offset}

    def fail_on(self, bad_rank: int) -> int:
        if self.rank == bad_rank:
            raise RuntimeError(f"deliberate failure on rank {self.rank}")
        return self.rank

    def cleanup(self) -> int:
        self.cleaned_up = True
        return self.rank


class IsolatedEnvReportingWorker(EnvReportingWorker):
    """Same behaviour, registered to an isolated venv environment by the venv tests."""
