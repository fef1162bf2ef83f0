"""GRPO end to end on CPU: real Ray, the DTensor policy worker, the math environment actor and a
locally built and warm-started tiny model. Two steps, a checkpoint, and a resumed run whose
third step matches the uninterrupted run's; a checkpoint of another model is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from rl_algos.cli import packaged_recipe
from rl_algos.grpo import GRPOMasterConfig, grpo_train, setup
from rl_algos.training import shutdown_run
from rl_core.checkpoint import CheckpointIncompatibleError
from rl_core.config import load_validated_config

pytestmark = pytest.mark.ray

# Metrics of a step that depend on the weights, the optimizer state, the sampled tokens and the
# data position: a resumed run reproduces them only if all of those were restored.
COMPARED = (
    "reward",
    "shaped_reward",
    "mean_response_length",
    "advantage_abs_mean",
    "loss",
    "actor_loss",
    "kl_penalty",
    "reference_kl",
    "grad_norm",
    "approx_entropy",
    "probs_ratio_mean",
    "token_mult_prob_error",
)


def tiny_config(root: Path, run: str, *extra: str) -> GRPOMasterConfig:
    overrides = [
        f"base_model.cache_dir={root / 'models'}",
        "base_model.model.vocab_size=300",
        "base_model.model.hidden_size=32",
        "base_model.model.intermediate_size=64",
        "base_model.model.tokenizer_corpus_size=200",
        "base_model.warm_start.num_steps=30",
        "base_model.warm_start.batch_size=32",
        "base_model.warm_start.micro_batch_size=32",
        "base_model.warm_start.log_every=15",
        "base_model.warm_start.data={source: arithmetic, format: sft, num_samples: 256, levels: [1]}",
        "data.train={source: arithmetic, num_samples: 64, levels: [1], seed: 1}",
        "data.validation=null",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.max_num_steps=3",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        # Response lengths vary between samples, so the overlong shaping gives every group
        # reward differences (non-zero advantages) even where the answers score alike.
        "grpo.reward_shaping={enabled: true, overlong_buffer_length: 12, max_response_length: 16}",
        "loss_fn.reference_policy_kl_penalty=0.01",
        "policy.max_total_sequence_length=64",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=16",
        "policy.generation.max_new_tokens=16",
        "policy.optimizer.kwargs={lr: 1.0e-3, weight_decay: 0.0}",
        f"logger.log_dir={root / run / 'logs'}",
        "logger.console=false",
        f"checkpointing.checkpoint_dir={root / run / 'checkpoints'}",
        "checkpointing.save_period=2",
        "checkpointing.keep_top_k=null",
        "checkpointing.metric_name=null",
        "cluster.cpus_per_worker=1",
        *extra,
    ]
    return load_validated_config(packaged_recipe("grpo_tiny_cpu.yaml"), GRPOMasterConfig, overrides)


def train_metrics(log_dir: Path) -> dict[int, dict[str, Any]]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        r["step"]: {k.removeprefix("train/"): v for k, v in r.items()}
        for r in records
        if r["prefix"] == "train"
    }


def run(cfg: GRPOMasterConfig) -> None:
    run = setup(cfg)
    try:
        grpo_train(run)
    finally:
        shutdown_run(run)


def test_grpo_trains_checkpoints_and_resumes_exactly(ray_cluster: None, tmp_path: Path) -> None:
    uninterrupted = tiny_config(tmp_path, "a", "logger.tensorboard=true")
    run(uninterrupted)
    steps = train_metrics(tmp_path / "a" / "logs")
    assert sorted(steps) == [1, 2, 3]
    # The same metrics went to TensorBoard.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "a" / "logs" / "tensorboard"))
    events.Reload()
    rewards = events.Scalars("train/reward")
    assert [s.step for s in rewards] == [1, 2, 3]
    assert [s.value for s in rewards] == pytest.approx([steps[i]["reward"] for i in (1, 2, 3)], rel=1e-6)
    for metrics in steps.values():
        assert metrics["num_trained_samples"] == 16 and metrics["optimizer_steps"] == 1
        assert metrics["advantage_abs_mean"] > 0 and metrics["grad_norm"] > 0
        # Colocated generation uses the trainer's own model: the log-probs agree.
        assert metrics["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-4)
        assert abs(metrics["gen_kl_error"]) < 1e-5
        assert 0.0 <= metrics["reward"] <= 1.0
    # Step 1 starts from the reference weights: no KL yet; the update moves the policy away.
    assert steps[1]["reference_kl"] == pytest.approx(0.0, abs=1e-6)
    assert steps[3]["reference_kl"] > 0

    checkpoints = tmp_path / "a" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_2", "step_3"]
    step_2 = checkpoints / "step_2"
    info = json.loads((step_2 / "training_info.json").read_text())
    assert info["step"] == 2 and info["consumed_samples"] == 8
    for part in ("policy/weights", "policy/optimizer", "policy/tokenizer", "dataloader.pt", "config.yaml"):
        assert (step_2 / part).exists(), part

    # Resume from step 2 in a fresh run: step 3 must be the uninterrupted run's step 3.
    resumed = tiny_config(tmp_path, "b")
    shutil.copytree(step_2, tmp_path / "b" / "checkpoints" / "step_2")
    run(resumed)
    resumed_steps = train_metrics(tmp_path / "b" / "logs")
    assert sorted(resumed_steps) == [3]
    for key in COMPARED:
        assert resumed_steps[3][key] == pytest.approx(steps[3][key], rel=1e-5, abs=1e-7), key

    # A checkpoint written for another model is refused before anything starts.
    foreign = tmp_path / "c" / "checkpoints" / "step_2"
    shutil.copytree(step_2, foreign)
    saved = yaml.safe_load((foreign / "config.yaml").read_text())
    saved["policy"]["model_name"] = "some/other-model"
    (foreign / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(CheckpointIncompatibleError, match=r"policy\.model_name"):
        setup(tiny_config(tmp_path, "c"))
