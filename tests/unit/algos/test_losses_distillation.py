"""DistillationLossFn against per-position loops over the teacher's top-k and the full vocabulary."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from loss_testing import (
    assert_close_with_grad,
    assert_microbatch_additivity,
    global_counts,
    random_batch,
    valid_positions,
)

from rl_algos.losses import DistillationLossConfig, DistillationLossFn, LossInputError
from rl_core.config import ConfigError

TOP_K = 4


def distillation_batch(seed: int, vocab: int = 12) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits, data = random_batch(batch_size=6, seq_len=8, vocab=vocab, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    batch_size, seq_len = data["input_ids"].shape
    indices = torch.stack(
        [torch.randperm(vocab, generator=g)[:TOP_K] for _ in range(batch_size * seq_len)]
    ).reshape(batch_size, seq_len, TOP_K)
    teacher = 2.0 * torch.randn(batch_size, seq_len, TOP_K, generator=g, dtype=torch.float64)
    # Positions predicting a token that does not count carry garbage.
    counts_at = torch.zeros(batch_size, seq_len, dtype=torch.bool)
    for b in range(batch_size):
        for t in valid_positions(data, b):
            counts_at[b, t - 1] = True
    teacher[~counts_at] = math.nan
    data["teacher_topk_logits"] = teacher
    data["teacher_topk_indices"] = indices
    return logits, data


def reference_distillation(
    logits: torch.Tensor, data: dict[str, torch.Tensor], cfg: DistillationLossConfig, gvt: float
) -> torch.Tensor:
    tau = cfg.temperature
    total = torch.zeros((), dtype=torch.float64)
    for b in range(logits.shape[0]):
        for token in valid_positions(data, b):
            t = token - 1  # the logits at t predict the token at t + 1
            student = logits[b, t] / tau
            teacher = data["teacher_topk_logits"][b, t] / tau
            topk = [int(i) for i in data["teacher_topk_indices"][b, t]]
            teacher_norm = sum(math.exp(float(x)) for x in teacher)
            p = [math.exp(float(x)) / teacher_norm for x in teacher]
            if cfg.zero_outside_topk:
                denominator = torch.exp(student).sum()
                q_full = [torch.exp(student[v]) / denominator for v in range(student.shape[0])]
                q = [q_full[v] for v in topk]
                forward = sum(p[j] * (math.log(p[j]) - torch.log(q[j])) for j in range(TOP_K))
                reverse = sum(
                    q_full[v]
                    * (
                        torch.log(q_full[v])
                        - (math.log(p[topk.index(v)]) if v in topk else cfg.outside_topk_teacher_logprob)
                    )
                    for v in range(student.shape[0])
                )
            else:
                denominator = torch.stack([torch.exp(student[v]) for v in topk]).sum()
                q = [torch.exp(student[v]) / denominator for v in topk]
                forward = sum(p[j] * (math.log(p[j]) - torch.log(q[j])) for j in range(TOP_K))
                reverse = sum(q[j] * (torch.log(q[j]) - math.log(p[j])) for j in range(TOP_K))
            if cfg.kl_type == "forward":
                total = total + forward
            elif cfg.kl_type == "reverse":
                total = total + reverse
            else:
                total = total + cfg.mixed_kl_weight * forward + (1 - cfg.mixed_kl_weight) * reverse
    return total / gvt


CONFIGS: list[dict[str, Any]] = [
    {
        "kl_type": kl_type,
        "zero_outside_topk": zero_outside,
        "temperature": temperature,
        "mixed_kl_weight": 0.3,
    }
    for kl_type in ("forward", "reverse", "mixed")
    for zero_outside in (False, True)
    for temperature in (1.0, 2.0)
]


def _id(cfg: dict[str, Any]) -> str:
    return f"{cfg['kl_type']}-{'full' if cfg['zero_outside_topk'] else 'renorm'}-T{cfg['temperature']}"


@pytest.mark.parametrize("overrides", CONFIGS, ids=_id)
def test_matches_reference_loop(overrides: dict[str, Any]) -> None:
    cfg = DistillationLossConfig.model_validate(overrides)
    loss_fn = DistillationLossFn(cfg)
    logits, data = distillation_batch(seed=2)
    gvs, gvt = global_counts(data)
    assert_close_with_grad(
        lambda x: loss_fn(x, data, gvs, gvt)[0],
        lambda x: reference_distillation(x, data, cfg, float(gvt)),
        logits,
    )


@pytest.mark.parametrize("overrides", CONFIGS[::5], ids=_id)
def test_microbatches_sum_to_the_full_batch(overrides: dict[str, Any]) -> None:
    logits, data = distillation_batch(seed=3)
    assert_microbatch_additivity(DistillationLossFn(overrides), logits, data, boundaries=[1, 3])


def test_matching_the_teacher_gives_zero_and_full_topk_mass() -> None:
    """A student equal to the teacher on the top-k and -inf-like elsewhere has zero KL of every kind."""
    logits, data = distillation_batch(seed=4)
    student = torch.full_like(logits, -1e4)
    teacher = torch.nan_to_num(data["teacher_topk_logits"], nan=0.0)
    student.scatter_(-1, data["teacher_topk_indices"], teacher)
    counts = global_counts(data)
    for kl_type in ("forward", "reverse", "mixed"):
        for zero_outside in (False, True):
            loss, metrics = DistillationLossFn({"kl_type": kl_type, "zero_outside_topk": zero_outside})(
                student, data, *counts
            )
            assert abs(float(loss)) < 1e-9, (kl_type, zero_outside, float(loss))
            assert metrics["student_topk_mass"] == pytest.approx(1.0, abs=1e-9)
    # The renormalised variant ignores the student's tail mass; the full-vocabulary one does not.
    student[..., 0] = 5.0
    student.scatter_(-1, data["teacher_topk_indices"], teacher)
    renorm = DistillationLossFn({"kl_type": "forward"})(student, data, *counts)[0]
    full = DistillationLossFn({"kl_type": "forward", "zero_outside_topk": True})(student, data, *counts)[0]
    assert abs(float(renorm)) < 1e-9 < float(full)


def test_bad_teacher_inputs_are_named() -> None:
    logits, data = distillation_batch(seed=5, vocab=12)
    counts = global_counts(data)
    with pytest.raises(LossInputError, match="outside the student's vocabulary"):
        DistillationLossFn()(logits[..., :6], data, *counts)
    with pytest.raises(LossInputError, match=r"teacher_topk_logits'\] has shape \(6, 8, 3\)"):
        DistillationLossFn()(
            logits, dict(data, teacher_topk_logits=data["teacher_topk_logits"][..., :3]), *counts
        )
    with pytest.raises(LossInputError, match="the batch has no 'teacher_topk_indices'"):
        DistillationLossFn()(logits, {k: v for k, v in data.items() if k != "teacher_topk_indices"}, *counts)
    with pytest.raises(ConfigError, match="mixed_kl_weight"):
        DistillationLossFn({"mixed_kl_weight": 1.5})
    with pytest.raises(ConfigError, match="kl_type"):
        DistillationLossFn({"kl_type": "jsd"})
