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
    gpu_items = [item for item in items if "gpu" in item.keywords]
    # Importing torch only to answer this costs seconds; skip it when no gpu test was collected.
    if not gpu_items or _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (marked gpu); none on this machine")
    for item in gpu_items:
        item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by the whole test session (started once, ~6 s)."""
    from rl_core.distributed.ray_init import init_ray, shutdown_ray

    init_ray(num_cpus=8, num_gpus=0)
    yield
    shutdown_ray()


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory):
    """A byte-level BPE tokenizer (384 entries, chat template) trained locally on a tiny corpus."""
    from rl_algos.models.tiny import arithmetic_corpus, build_tokenizer

    out = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tokenizer(arithmetic_corpus(), vocab_size=384, out_dir=out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_tokenizer_dir, tmp_path_factory: pytest.TempPathFactory):
    """A randomly initialised 2-layer Qwen2 (hidden 64, untied embeddings) + tokenizer, < 1 MB."""
    from rl_algos.models.tiny import build_tiny_causal_lm

    return build_tiny_causal_lm(tiny_tokenizer_dir, tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2")


@pytest.fixture(scope="session")
def tiny_llama_tied_dir(tiny_tokenizer_dir, tmp_path_factory: pytest.TempPathFactory):
    """Like `tiny_model_dir` but Llama with tied input/output embeddings."""
    from rl_algos.models.tiny import build_tiny_causal_lm

    return build_tiny_causal_lm(
        tiny_tokenizer_dir,
        tmp_path_factory.mktemp("tiny_llama_tied"),
        arch="llama",
        tie_word_embeddings=True,
        seed=1,
    )
