"""`rl eval` as a user runs it (a subprocess joining the test's Ray cluster): a briefly trained tiny
model answers arithmetic prompts 4 times each; the command prints the metrics table and writes a
JSON file whose pass@k / cons@k agree with its per-prompt outcomes (closed form, majority vote)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import ray
from algo_testing import build_arithmetic_tokenizer, build_model, sft_in_process

pytestmark = pytest.mark.ray

N = 4
KS = (1, 2, 4)


def majority_correct(answers: list[str | None], rewards: list[float], k: int) -> float:
    votes = Counter(a.strip() for a in answers[:k] if a is not None and a.strip())
    if not votes:
        return 0.0
    top = max(votes.values())
    winner = next(a.strip() for a in answers[:k] if a is not None and votes.get(a.strip()) == top)
    index = next(i for i, a in enumerate(answers[:k]) if a is not None and a.strip() == winner)
    return 1.0 if rewards[index] >= 1.0 else 0.0


def test_rl_eval_prints_table_and_writes_json(ray_cluster: None, tmp_path: Path) -> None:
    initial = build_model(build_arithmetic_tokenizer(tmp_path / "tokenizer"), tmp_path / "initial")
    model = sft_in_process(initial, tmp_path / "model", steps=80)
    output = tmp_path / "out" / "results.json"
    command = [
        sys.executable,
        "-m",
        "rl_algos.cli",
        "eval",
        f"model.model_name={model}",
        "model.max_new_tokens=24",
        "model.temperature=0.6",
        f"eval.num_tests_per_prompt={N}",
        f"eval.pass_k=[{', '.join(map(str, KS))}]",
        f"eval.output_file={output}",
        "data.dataset={source: arithmetic, split: train, num_samples: 12, levels: [1], seed: 99}",
    ]
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "RL_SINGLE_VENV": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]

    data = json.loads(output.read_text())
    assert data["num_prompts"] == 12 and data["num_tests_per_prompt"] == N
    assert data["model"] == str(model)
    outcomes = data["per_prompt"]
    assert len(outcomes) == 12 and all(len(o["rewards"]) == N == len(o["answers"]) for o in outcomes)
    metrics = data["metrics"]
    for k in KS:
        expected = sum(1 - math.comb(N - o["num_correct"], k) / math.comb(N, k) for o in outcomes) / 12
        assert metrics[f"pass@{k}"] == pytest.approx(expected, abs=1e-9)
        votes = sum(majority_correct(o["answers"], o["rewards"], k) for o in outcomes) / 12
        assert metrics[f"cons@{k}"] == pytest.approx(votes, abs=1e-9)
    assert metrics["mean_reward"] == pytest.approx(sum(sum(o["rewards"]) for o in outcomes) / (12 * N))
    # The trained model solves some problems, not all at every try.
    assert 0.0 < metrics["pass@1"] <= metrics["pass@2"] <= metrics["pass@4"]

    table = [line.split() for line in result.stdout.splitlines()]
    for name in (*(f"pass@{k}" for k in KS), *(f"cons@{k}" for k in KS), "mean_reward"):
        assert [name, f"{metrics[name]:.4f}"] in table, name
    assert f"results: {output}" in result.stdout
