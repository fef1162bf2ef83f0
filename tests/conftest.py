"""Shared fixtures. Ray is started only by tests that ask for it (the `ray_cluster` fixture)."""

from __future__ import annotations

import os

import pytest

# Local test clusters need no auth token and must not reach for a dashboard.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tests run every worker in the driver's interpreter unless a test asks for an isolated venv.
os.environ.setdefault("RL_SINGLE_VENV", "1")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (marked gpu); none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by the whole test session (started once, ~6 s)."""
    from rl_core.distributed.ray_init import init_ray, shutdown_ray

    init_ray(num_cpus=8, num_gpus=0)
    yield
    shutdown_ray()
