"""Numerical building blocks shared by the training backends and the losses.

Keeping these in rl-core means a backend's `get_logprobs` and the losses compute log-probs
with one code path, so `prev_logprobs` and the training-time log-probs cannot drift apart.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision inputs, the input dtype when it is already wider."""
    return torch.promote_types(dtype, torch.float32)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of `input_ids` under `logits`, aligned with `input_ids`.

    `logits` is [B, T, V] with position t predicting token t + 1; the result is [B, T] in at
    least float32, with `result[:, t] = log softmax(logits[:, t - 1] / temperature)[input_ids[:, t]]`
    and `result[:, 0] = 0`. It gathers the target logit and subtracts the log-sum-exp instead of
    materialising a second [B, T, V] log-softmax tensor.
    """
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if input_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"input_ids has shape {tuple(input_ids.shape)} but logits are {tuple(logits.shape)}; "
            "expected input_ids [B, T] matching logits [B, T, V]"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scores = logits[:, :-1].to(compute_dtype(logits.dtype))
    if temperature != 1.0:
        scores = scores / temperature
    targets = input_ids[:, 1:].to(device=logits.device, dtype=torch.long)
    vocab = logits.shape[-1]
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(
            f"input_ids holds token ids outside [0, {vocab}) (min {int(targets.min())}, "
            f"max {int(targets.max())}); the logits have vocabulary size {vocab}"
        )
    picked = scores.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    shifted = picked - torch.logsumexp(scores, dim=-1)
    return torch.nn.functional.pad(shifted, (1, 0), value=0.0)
