"""The rl-vllm unit tests need only its vLLM-free parts (config, requests, environment, refit)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# A development venv synced before rl-vllm joined the workspace's default dependencies lacks it;
# take it from the checkout then.
if importlib.util.find_spec("rl_vllm") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "packages" / "rl-vllm" / "src"))
