"""Per-token estimators of KL(p || q) from the log-probs of tokens sampled from p.

With `log_ratio = log q(x) - log p(x)` for x ~ p (Schulman, "Approximating KL divergence"):

- k1 = -log_ratio                        unbiased, high variance, can be negative
- k2 = log_ratio**2 / 2                  biased, low variance, >= 0
- k3 = exp(log_ratio) - 1 - log_ratio    unbiased, low variance, >= 0

Clamping the input log-ratio (and the output estimate) bounds the estimate, and its gradient,
on tokens where the two policies disagree wildly; clamped entries get no gradient.
"""

from __future__ import annotations

from typing import Literal

import torch

KLType = Literal["k1", "k2", "k3"]


def kl_estimate(
    logprobs_p: torch.Tensor,
    logprobs_q: torch.Tensor,
    kl_type: KLType,
    input_clamp: float | None = None,
    output_clamp: float | None = None,
) -> torch.Tensor:
    """Elementwise estimate of KL(p || q) for tokens sampled from p."""
    log_ratio = logprobs_q - logprobs_p
    if input_clamp is not None:
        log_ratio = log_ratio.clamp(min=-input_clamp, max=input_clamp)
    if kl_type == "k1":
        kl = -log_ratio
    elif kl_type == "k2":
        kl = 0.5 * log_ratio.square()
    elif kl_type == "k3":
        kl = torch.expm1(log_ratio) - log_ratio
    else:
        raise ValueError(f"unknown KL estimator {kl_type!r}; expected one of 'k1', 'k2', 'k3'")
    if output_clamp is not None:
        kl = kl.clamp(min=-output_clamp, max=output_clamp)
    return kl
