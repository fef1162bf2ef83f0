"""On-policy distillation end to end on real Ray workers: a tiny student (hidden 64) learns from a
larger teacher (hidden 96, 3 layers, trained on the arithmetic task) through the teacher's top-k
logits on the student's own answers, and the KL on held-out prompts falls; restoring a checkpoint
(sampling state included) gives the same next step again. Vocabulary checks refuse a teacher with
another tokenizer or wider logits."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from algo_testing import (
    assert_same_step_metrics,
    build_arithmetic_tokenizer,
    build_model,
    load_recipe,
    metrics_by_step,
    run_overrides,
    sft_in_process,
)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rl_algos import distill
from rl_algos.models.tiny import arithmetic_corpus, build_tokenizer
from rl_algos.training import ResumePoint, restore_from_checkpoint, run_loop, shutdown_run
from rl_core.checkpoint import CheckpointManager
from rl_core.config import ConfigError

STEPS = 24
PERIOD = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distill_models")
    tokenizer = build_arithmetic_tokenizer(root / "tokenizer")
    student = build_model(tokenizer, root / "student")
    teacher_init = build_model(tokenizer, root / "teacher_init", hidden_size=96, num_layers=3, seed=3)
    return {"student": student, "teacher": sft_in_process(teacher_init, root / "teacher", steps=40)}


def test_teacher_with_another_vocabulary_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    student = str(models["student"])
    other_tokenizer = build_tokenizer(arithmetic_corpus(200), 300, tmp_path / "other_tokenizer")
    other = build_model(tmp_path / "other_tokenizer", tmp_path / "other")
    assert len(other_tokenizer) != len(AutoTokenizer.from_pretrained(student))
    with pytest.raises(ConfigError, match=r"teacher\.model_name: .*differ in \d+ token\(s\)") as error:
        distill.check_shared_vocabulary(student, student, distill.TeacherConfig(model_name=str(other)))
    assert str(other) in str(error.value) and student in str(error.value)

    # Same tokenizer, but 64 more logits than the student has: top-k ids could fall outside.
    config = AutoConfig.from_pretrained(student)
    config.vocab_size += 64
    wide = tmp_path / "wide"
    AutoModelForCausalLM.from_config(config).save_pretrained(wide)
    AutoTokenizer.from_pretrained(student).save_pretrained(wide)
    with pytest.raises(ConfigError, match=rf"{config.vocab_size} logits per position but the student"):
        distill.check_shared_vocabulary(student, student, distill.TeacherConfig(model_name=str(wide)))
    # The teacher itself passes.
    distill.check_shared_vocabulary(
        student, student, distill.TeacherConfig(model_name=str(models["teacher"]))
    )


@pytest.mark.ray
def test_student_approaches_the_teacher_and_resumes(
    ray_cluster: None, models: dict[str, Path], tmp_path: Path
) -> None:
    cfg = load_recipe(
        "distill_tiny_cpu.yaml",
        distill.DistillMasterConfig,
        [
            *run_overrides(tmp_path, models["student"], drop_base_model=False),
            f"teacher.model_name={models['teacher']}",
            f"distill.max_num_steps={STEPS}",
            f"distill.val_period={PERIOD}",
            "distill.max_val_samples=16",
            "distill.export_hf_dir=null",
            f"checkpointing.save_period={PERIOD}",
            "checkpointing.keep_top_k=null",
        ],
    )
    run = distill.setup(cfg)
    try:
        result = run_loop(run, partial(distill.distill_step, run), partial(distill.validate, run))
        checkpoint = tmp_path / "checkpoints" / f"step_{PERIOD}"
        restore_from_checkpoint(
            run, ResumePoint(checkpoint, CheckpointManager.load_training_info(checkpoint))
        )
        replayed = distill.distill_step(run, PERIOD + 1)
    finally:
        shutdown_run(run)

    validation = metrics_by_step(tmp_path / "run" / "logs", "validation")
    start, end = validation[0], validation[STEPS]
    # Forward KL to the teacher's top-16 (zero outside it) on the student's greedy answers.
    assert end["loss"] < 0.6 * start["loss"], (start["loss"], end["loss"])
    assert end["student_topk_mass"] > start["student_topk_mass"] + 0.2
    assert [step for step, _ in result.validation_history] == [0, PERIOD, STEPS]
    train = metrics_by_step(tmp_path / "run" / "logs", "train")
    assert all(0 < train[s]["mean_generation_length"] <= 16 for s in train)
    # The step after the restore samples the same answers and takes the same update.
    assert_same_step_metrics(train[PERIOD + 1], replayed)


def test_student_sequences_mask_only_the_generated_tokens() -> None:
    """The training batch built from a generation output: prompt tokens are not trained on."""

    class FixedGeneration:
        def prepare_for_generation(self) -> bool:
            return True

        def finish_generation(self) -> bool:
            return True

        def generate(self, data, greedy=False):  # type: ignore[no-untyped-def]
            # Prompts of 3 and 2 tokens; answers of 2 and 4 tokens; right-padded with 0.
            return {
                "output_ids": torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 10, 11, 12, 13]]),
                "generation_lengths": torch.tensor([2, 4]),
                "unpadded_sequence_lengths": torch.tensor([5, 6]),
            }

    run = type("Run", (), {"generation": FixedGeneration(), "generation_weights_stale": False})()
    prompts = {"input_ids": torch.tensor([[5, 6, 7], [5, 6, 0]]), "input_lengths": torch.tensor([3, 2])}
    batch = distill.student_sequences(run, prompts, greedy=True)  # type: ignore[arg-type]
    assert batch["token_mask"].tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch["input_lengths"].tolist() == [5, 6]
    assert batch["sample_mask"].tolist() == [1.0, 1.0]
