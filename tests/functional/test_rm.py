"""Reward-model training end to end on real Ray workers: a sequence-classification head on a tiny
causal LM learns a synthetic preference (a direct answer over a refusal) to > 0.9 held-out
pairwise accuracy; the exported model scores conversations in `RewardModelEnvironment` with the
trained scores; restoring a checkpoint gives the same next step again."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
from algo_testing import (
    assert_same_step_metrics,
    build_arithmetic_tokenizer,
    build_model,
    load_recipe,
    metrics_by_step,
    run_overrides,
    write_style_preferences,
)

from rl_algos import rm
from rl_algos.pairwise import pairwise_step, validate_pairwise
from rl_algos.training import ResumePoint, restore_from_checkpoint, run_loop, shutdown_run
from rl_core.checkpoint import CheckpointManager
from rl_envs.reward_model import RewardModelEnvironment

pytestmark = pytest.mark.ray

STEPS = 12
PERIOD = 6


def test_reward_model_learns_exports_and_resumes(ray_cluster: None, tmp_path: Path) -> None:
    model_dir = build_model(build_arithmetic_tokenizer(tmp_path / "tokenizer"), tmp_path / "model")
    train = write_style_preferences(tmp_path / "train.jsonl", 256, "train", seed=2)
    validation = write_style_preferences(tmp_path / "validation.jsonl", 32, "validation", seed=0)
    export_dir = tmp_path / "reward_model"
    cfg = load_recipe(
        "rm_tiny_cpu.yaml",
        rm.RMMasterConfig,
        [
            *run_overrides(tmp_path, model_dir),
            f"data.train={{path: {train}}}",
            f"data.validation={{path: {validation}}}",
            f"rm.max_num_steps={STEPS}",
            f"rm.val_period={PERIOD}",
            f"rm.export_hf_dir={export_dir}",
            f"checkpointing.save_period={PERIOD}",
            "checkpointing.keep_top_k=null",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=8",
            "policy.optimizer.kwargs.lr=1.0e-3",
        ],
    )
    run = rm.setup(cfg)
    try:
        result = run_loop(run, partial(pairwise_step, run), partial(validate_pairwise, run))
        checkpoint = tmp_path / "checkpoints" / f"step_{PERIOD}"
        restore_from_checkpoint(
            run, ResumePoint(checkpoint, CheckpointManager.load_training_info(checkpoint))
        )
        replayed = pairwise_step(run, PERIOD + 1)
    finally:
        shutdown_run(run)

    validation_metrics = metrics_by_step(tmp_path / "run" / "logs", "validation")
    start, end = validation_metrics[0], validation_metrics[STEPS]
    assert end["accuracy"] > 0.9, end
    assert end["margin"] > start["margin"] + 1.0
    assert end["loss"] < 0.5 * start["loss"]
    assert result.export_path == export_dir

    # The exported directory is what the reward-model environment loads; it scores each
    # conversation (prompt + response) with the trained head.
    env = RewardModelEnvironment({"model_path": str(export_dir), "batch_size": 8})
    records = [json.loads(line) for line in validation.read_text().splitlines()]

    def conversation(record: dict[str, str], response: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": response}]

    chosen = env.score([conversation(r, r["chosen"]) for r in records])
    rejected = env.score([conversation(r, r["rejected"]) for r in records])
    env.shutdown()
    assert float((chosen > rejected).float().mean()) > 0.9
    # Same tokens, same weights: the environment's scores are the workers' validation rewards.
    assert float(chosen.mean()) == pytest.approx(end["rewards_chosen_mean"], abs=1e-4)
    assert float(rejected.mean()) == pytest.approx(end["rewards_rejected_mean"], abs=1e-4)

    assert_same_step_metrics(metrics_by_step(tmp_path / "run" / "logs", "train")[PERIOD + 1], replayed)
