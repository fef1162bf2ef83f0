"""Distillation from a teacher's top-k logits: forward, reverse or mixed KL per position.

The batch carries `teacher_topk_logits` and `teacher_topk_indices`, [B, T, k], aligned with the
logits (position t predicts token t + 1); a position counts when the token it predicts is a
valid token (`token_mask * sample_mask`), so the global normaliser is `global_valid_toks`.
Both the teacher and the student logits are divided by `temperature`. Let K be the teacher's
top-k set at a position and p the teacher's distribution renormalised over K (the teacher's
mass outside K is unknown from top-k logits).

- `zero_outside_topk = False` (default): the student is renormalised over K as well,
  q = softmax(student logits at K), and the KL compares the two distributions on K only.
- `zero_outside_topk = True`: the student keeps its full-vocabulary distribution q, and the
  teacher is taken as p on K and zero outside. Forward KL(p || q) = sum_K p (log p - log q)
  then pushes the student's tail mass into K. Reverse KL(q || p) would be infinite with any
  student mass outside K, so each token outside K gets the teacher log-prob
  `outside_topk_teacher_logprob` (a large negative floor), adding
  sum_{v not in K} q_v (log q_v - floor) = -H_tail(q) - floor * q(not K).

`kl_type = "mixed"` is `mixed_kl_weight * forward + (1 - mixed_kl_weight) * reverse`. The teacher
indices at one position are assumed distinct (as any top-k is).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from rl_algos.losses.common import LossBatch, LossInputError, as_normaliser, global_token_mean, to_floats
from rl_algos.losses.config import coerce_config
from rl_core.config import RLConfig
from rl_core.interfaces import LossType


class DistillationLossConfig(RLConfig):
    kl_type: Literal["forward", "reverse", "mixed"] = "forward"
    mixed_kl_weight: float = Field(
        default=0.5, ge=0.0, le=1.0, description="weight of the forward KL in 'mixed'"
    )
    temperature: float = Field(default=1.0, gt=0.0)
    zero_outside_topk: bool = Field(
        default=False, description="full-vocabulary student vs teacher zero outside top-k"
    )
    outside_topk_teacher_logprob: float = Field(
        default=-100.0,
        lt=0.0,
        description="teacher log-prob assumed per token outside top-k (reverse KL only)",
    )


class DistillationLossFn:
    """Token-level KL between the student and the teacher's top-k; see the module docstring.

    Needs `input_ids`, `token_mask`, `sample_mask`, `teacher_topk_logits`, `teacher_topk_indices`.
    Metrics: `loss` and `student_topk_mass` (the student's full-vocabulary probability of the
    teacher's top-k; 1 when the student has learnt the teacher's support), as contributions to
    means over the global valid tokens; `num_valid_tokens`, `num_valid_samples`.
    """

    loss_type = LossType.TOKEN_LEVEL

    def __init__(self, cfg: DistillationLossConfig | Mapping[str, Any] | None = None) -> None:
        self.cfg = coerce_config(cfg, DistillationLossConfig)

    def __call__(
        self,
        logits: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = self.cfg
        name = type(self).__name__
        batch = LossBatch(name, data, logits)
        if logits.ndim != 3:
            raise LossInputError(f"{name}: logits must be [B, T, V], got shape {tuple(logits.shape)}")
        teacher_logits, teacher_indices = self._teacher(batch, logits)
        # Position t predicts token t + 1: its weight is the validity of token t + 1.
        position_mask = batch.valid_token_mask()[:, 1:]

        student = logits[:, :-1].to(batch.dtype) / cfg.temperature
        # Positions that do not count may hold anything (e.g. NaN padding); keep them out of autograd.
        teacher_scores = torch.where(
            position_mask.unsqueeze(-1) > 0, teacher_logits[:, :-1].to(batch.dtype), 0.0
        )
        teacher_logp = F.log_softmax(teacher_scores / cfg.temperature, dim=-1)
        student_topk = student.gather(-1, teacher_indices[:, :-1])
        student_full_logp_topk = student_topk - torch.logsumexp(student, dim=-1, keepdim=True)
        if cfg.zero_outside_topk:
            student_logp = student_full_logp_topk
        else:
            student_logp = F.log_softmax(student_topk, dim=-1)

        def forward_kl() -> torch.Tensor:
            return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)

        def reverse_kl() -> torch.Tensor:
            student_p = student_logp.exp()
            kl = (student_p * (student_logp - teacher_logp)).sum(-1)
            if cfg.zero_outside_topk:
                full_logp = F.log_softmax(student, dim=-1)
                tail_neg_entropy = (full_logp.exp() * full_logp).sum(-1) - (student_p * student_logp).sum(-1)
                tail_mass = (1.0 - student_p.sum(-1)).clamp(min=0.0)
                kl = kl + tail_neg_entropy - cfg.outside_topk_teacher_logprob * tail_mass
            return kl

        if cfg.kl_type == "forward":
            per_position = forward_kl()
        elif cfg.kl_type == "reverse":
            per_position = reverse_kl()
        else:
            per_position = cfg.mixed_kl_weight * forward_kl() + (1.0 - cfg.mixed_kl_weight) * reverse_kl()

        num_toks = as_normaliser(global_valid_toks, position_mask)
        loss = global_token_mean(per_position, position_mask, num_toks)
        with torch.no_grad():
            topk_mass = global_token_mean(student_full_logp_topk.exp().sum(-1), position_mask, num_toks)
        return loss, to_floats(
            {
                "loss": loss,
                "student_topk_mass": topk_mass,
                "num_valid_tokens": position_mask.sum(),
                "num_valid_samples": batch.sample_mask().sum(),
            }
        )

    @staticmethod
    def _teacher(batch: LossBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        name = batch.loss_name
        indices = batch.raw("teacher_topk_indices", "[B, T, k] int64 token ids")
        if indices.ndim != 3 or indices.shape[-1] < 1:
            raise LossInputError(
                f"{name}: data['teacher_topk_indices'] has shape {tuple(indices.shape)}, expected [B, T, k] with k >= 1"
            )
        shape = (*logits.shape[:2], indices.shape[-1])
        indices = batch.indexed("teacher_topk_indices", shape, "[B, T, k] like the logits' [B, T]")
        if indices.dtype.is_floating_point or indices.dtype == torch.bool:
            raise LossInputError(
                f"{name}: data['teacher_topk_indices'] must hold integers, got {indices.dtype}"
            )
        vocab = logits.shape[-1]
        if int(indices.min()) < 0 or int(indices.max()) >= vocab:
            raise LossInputError(
                f"{name}: data['teacher_topk_indices'] holds ids outside the student's vocabulary [0, {vocab}) "
                f"(min {int(indices.min())}, max {int(indices.max())}); do teacher and student share a tokenizer?"
            )
        teacher_logits = batch.indexed("teacher_topk_logits", shape, "[B, T, k] like teacher_topk_indices")
        return teacher_logits, indices.long()
