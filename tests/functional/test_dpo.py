"""DPO end to end on real Ray workers: on a synthetic preference set (a direct answer preferred to
a refusal) held-out reward accuracy goes from 0 to above 0.9 and the margin grows; the loop's
validation loss equals an independent plain-PyTorch DPO computation with the trained weights;
restoring a checkpoint gives the same next step again."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from algo_testing import (
    assert_same_step_metrics,
    build_arithmetic_tokenizer,
    build_model,
    load_recipe,
    metrics_by_step,
    run_overrides,
    write_style_preferences,
)
from transformers import AutoModelForCausalLM

from rl_algos import dpo
from rl_algos.data.collate import collate_preference
from rl_algos.pairwise import pairwise_step, validate_pairwise
from rl_algos.training import ResumePoint, restore_from_checkpoint, run_loop, shutdown_run, training_fields
from rl_core.checkpoint import CheckpointManager

pytestmark = pytest.mark.ray

STEPS = 12
PERIOD = 6
BETA = 0.5
SFT_WEIGHT = 0.1


def sequence_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum over each row's trained tokens of log p(token | prefix), from a plain forward."""
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    attention = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits.float()
    picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (picked * batch["token_mask"][:, 1:]).sum(-1)


def reference_dpo_loss(
    policy: torch.nn.Module, reference: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> float:
    """DPO with an SFT term, written out: mean over pairs of
    -log σ(β[(π_c − ref_c) − (π_r − ref_r)]) + w · (−π_c)."""
    pi, ref = sequence_logprobs(policy, batch), sequence_logprobs(reference, batch)
    margin = BETA * ((pi[0::2] - ref[0::2]) - (pi[1::2] - ref[1::2]))
    return float((-F.logsigmoid(margin) + SFT_WEIGHT * -pi[0::2]).mean())


def test_dpo_learns_the_preference_matches_reference_and_resumes(ray_cluster: None, tmp_path: Path) -> None:
    model_dir = build_model(build_arithmetic_tokenizer(tmp_path / "tokenizer"), tmp_path / "model")
    train = write_style_preferences(tmp_path / "train.jsonl", 256, "train", seed=1)
    validation = write_style_preferences(tmp_path / "validation.jsonl", 32, "validation", seed=0)
    cfg = load_recipe(
        "dpo_tiny_cpu.yaml",
        dpo.DPOMasterConfig,
        [
            *run_overrides(tmp_path, model_dir),
            f"data.train={{path: {train}}}",
            f"data.validation={{path: {validation}}}",
            f"dpo.max_num_steps={STEPS}",
            f"dpo.val_period={PERIOD}",
            "dpo.export_hf_dir=null",
            "dpo.val_batch_size=12",  # 32 pairs in chunks of 12, 12, 8: a pair-weighted mean
            f"checkpointing.save_period={PERIOD}",
            "checkpointing.keep_top_k=null",
            f"loss_fn.beta={BETA}",
            f"loss_fn.sft_loss_weight={SFT_WEIGHT}",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=8",
            "policy.optimizer.kwargs.lr=1.0e-3",
        ],
    )
    run = dpo.setup(cfg)
    try:
        result = run_loop(run, partial(pairwise_step, run), partial(validate_pairwise, run))
        validation_metrics = metrics_by_step(tmp_path / "run" / "logs", "validation")
        # An independent DPO loss on the validation pairs with the trained weights.
        trained = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        weights = {name: t for bucket in run.policy.stream_weights() for name, t in bucket.items()}
        trained.load_state_dict(weights, strict=False)
        initial = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        assert run.validation is not None
        pairs = training_fields(collate_preference(run.validation.datums, run.pad_token_id))
        expected_loss = reference_dpo_loss(trained.eval(), initial.eval(), pairs)

        # Restore the step-6 checkpoint into the same workers: step 7 must come out the same.
        checkpoint = tmp_path / "checkpoints" / f"step_{PERIOD}"
        restore_from_checkpoint(
            run, ResumePoint(checkpoint, CheckpointManager.load_training_info(checkpoint))
        )
        assert run.state.step == PERIOD
        replayed = pairwise_step(run, PERIOD + 1)
    finally:
        shutdown_run(run)

    start, end = validation_metrics[0], validation_metrics[STEPS]
    # At the start the policy is its own reference: every implicit reward is exactly 0.
    assert start["accuracy"] == 0.0 and start["margin"] == 0.0
    assert end["accuracy"] > 0.9, end
    assert end["margin"] > start["margin"] + 1.0
    assert end["logprobs_chosen_mean"] > start["logprobs_chosen_mean"]
    assert end["logprobs_rejected_mean"] < start["logprobs_rejected_mean"]
    assert result.validation_history[-1] == (STEPS, end["accuracy"])
    assert end["loss"] == pytest.approx(expected_loss, rel=1e-4)

    assert_same_step_metrics(metrics_by_step(tmp_path / "run" / "logs", "train")[PERIOD + 1], replayed)
