"""SFT end to end on real Ray workers: a tiny model learns the arithmetic task's worked solutions
(validation loss down, greedy accuracy up, scored by the math environment through `evaluate`),
and a run cut off after a checkpoint resumes to the same next-step metrics."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
from algo_testing import (
    assert_same_step_metrics,
    build_arithmetic_tokenizer,
    build_model,
    drop_checkpoints_after,
    load_recipe,
    metrics_by_step,
    run_overrides,
)
from transformers import AutoTokenizer

from rl_algos import sft
from rl_algos.data.arithmetic import generate_problems
from rl_algos.data.processors import PromptAnswerProcessor, PromptFormat, process_records
from rl_algos.eval import EvalConfig, evaluate
from rl_algos.training import run_loop, shutdown_run
from rl_core.policy import ColocatedGeneration
from rl_envs.registry import create_environments
from rl_envs.router import EnvironmentRouter

pytestmark = pytest.mark.ray

STEPS = 120
SAVE_PERIOD = 60


def greedy_accuracy(run: sft.SFTRun, model_dir: Path, environments: EnvironmentRouter) -> float:
    """Greedy pass@1 on 32 arithmetic problems (the policy generates with its own workers)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    problems = generate_problems(32, split="train", levels=[1], seed=99, validation_fraction=0.2)
    datums = process_records(
        [p.to_record() for p in problems], PromptAnswerProcessor(tokenizer, PromptFormat())
    )
    result = evaluate(
        ColocatedGeneration(run.policy), tokenizer, datums.datums, environments, EvalConfig(greedy=True), 96
    )
    return result.metrics["pass@1"]


def test_sft_learns_arithmetic_and_resumes(ray_cluster: None, tmp_path: Path) -> None:
    model_dir = build_model(build_arithmetic_tokenizer(tmp_path / "tokenizer"), tmp_path / "model")
    settings = [
        f"sft.max_num_steps={STEPS}",
        f"sft.val_period={SAVE_PERIOD}",
        "sft.export_hf_dir=null",
        f"checkpointing.save_period={SAVE_PERIOD}",
        "checkpointing.keep_top_k=null",
        "policy.generation.max_new_tokens=24",
        # One-digit additions: a 64-wide model learns their format and many of the sums in 120 steps.
        "data.train={source: arithmetic, format: sft, num_samples: 2560, levels: [1], validation_fraction: 0.2}",
        "data.validation={source: arithmetic, format: sft, split: validation, num_samples: 16, levels: [1], "
        "validation_fraction: 0.2}",
    ]
    cfg = load_recipe(
        "sft_tiny_cpu.yaml", sft.SFTMasterConfig, [*run_overrides(tmp_path, model_dir), *settings]
    )
    environments = EnvironmentRouter(create_environments({"math": {"num_workers": 1}}))
    run = sft.setup(cfg)
    try:
        accuracy_before = greedy_accuracy(run, model_dir, environments)
        result = run_loop(run, partial(sft.sft_step, run), partial(sft.validate, run))
        accuracy_after = greedy_accuracy(run, model_dir, environments)
    finally:
        shutdown_run(run)
        environments.shutdown()

    history = dict(result.validation_history)
    assert sorted(history) == [0, SAVE_PERIOD, STEPS]
    assert history[STEPS] < 0.25 * history[0], history  # from ~5.7 (random) to well under 1
    assert history[SAVE_PERIOD] > history[STEPS]
    assert accuracy_before == 0.0
    assert accuracy_after >= 0.25, accuracy_after
    train = metrics_by_step(tmp_path / "run" / "logs", "train")
    assert sorted(train) == list(range(1, STEPS + 1))
    # Each step trains on exactly the completion tokens of 32 samples (the prompt is masked).
    assert all(train[s]["num_trained_tokens"] == train[s]["num_valid_tokens"] for s in train)

    # Cut the run off after step 40 and resume: step 41 must be the same step again.
    drop_checkpoints_after(tmp_path / "checkpoints", SAVE_PERIOD)
    resumed_cfg = load_recipe(
        "sft_tiny_cpu.yaml",
        sft.SFTMasterConfig,
        [
            *run_overrides(tmp_path, model_dir, tag="resumed"),
            *settings,
            f"sft.max_num_steps={SAVE_PERIOD + 1}",
            f"policy.scheduler.total_steps={STEPS}",
            "sft.val_at_end=false",
        ],
    )
    resumed = sft.setup(resumed_cfg)
    try:
        assert resumed.state.step == SAVE_PERIOD
        assert resumed.state.validation_history == [(0, history[0]), (SAVE_PERIOD, history[SAVE_PERIOD])]
        run_loop(resumed, partial(sft.sft_step, resumed), partial(sft.validate, resumed))
    finally:
        shutdown_run(resumed)
    again = metrics_by_step(tmp_path / "resumed" / "logs", "train")
    assert sorted(again) == [SAVE_PERIOD + 1]
    assert_same_step_metrics(train[SAVE_PERIOD + 1], again[SAVE_PERIOD + 1])
