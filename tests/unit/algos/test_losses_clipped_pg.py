"""ClippedPGLossFn against a plain per-token / per-sequence loop written from the formulas."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from loss_testing import (
    TOL,
    assert_close_with_grad,
    assert_microbatch_additivity,
    global_counts,
    make_near_policy,
    random_batch,
    reference_logprob,
    valid_positions,
    with_garbage,
)

from rl_algos.losses import ClippedPGLossConfig, ClippedPGLossFn, LossInputError
from rl_core.config import ConfigError
from rl_core.interfaces import LossFunction, LossType


def _kl(lp: torch.Tensor, ref: float, cfg: ClippedPGLossConfig) -> torch.Tensor:
    x = ref - lp
    if cfg.kl_input_clamp_value is not None:
        x = torch.clamp(x, -cfg.kl_input_clamp_value, cfg.kl_input_clamp_value)
    if cfg.reference_policy_kl_type == "k1":
        k = -x
    elif cfg.reference_policy_kl_type == "k2":
        k = x * x / 2
    else:
        k = torch.exp(x) - 1 - x
    if cfg.kl_output_clamp_value is not None:
        k = torch.clamp(k, -cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
    return k


def reference_clipped_pg(
    logits: torch.Tensor, data: dict[str, torch.Tensor], cfg: ClippedPGLossConfig, gvs: float, gvt: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """One token at a time. GSPO uses the GSPO-token ratio sg[s_i] * pi_t / sg[pi_t]."""
    eps_low, eps_high, c = cfg.ratio_clip_min, cfg.ratio_clip_max, cfg.ratio_clip_c
    beta = cfg.reference_policy_kl_penalty
    actor_total = torch.zeros((), dtype=torch.float64)
    kl_total = torch.zeros((), dtype=torch.float64)
    stats = dict.fromkeys(
        [
            "ratio",
            "clamped",
            "low",
            "high",
            "dual",
            "mult",
            "genkl",
            "entropy",
            "refkl",
            "weight",
            "truncated",
        ],
        0.0,
    )
    for b in range(data["input_ids"].shape[0]):
        positions = valid_positions(data, b)
        if not positions:
            continue

        def value(key: str, t: int, b: int = b) -> float:
            return float(data[key][b, t])

        lp = {t: reference_logprob(logits, data["input_ids"], b, t) for t in positions}
        if cfg.sequence_level_importance_ratios:
            mean_log_ratio = sum(float(lp[t].detach()) - value("prev_logprobs", t) for t in positions) / len(
                positions
            )
            ratio = {t: math.exp(mean_log_ratio) * torch.exp(lp[t] - lp[t].detach()) for t in positions}
            seq_weight = math.exp(
                sum(value("prev_logprobs", t) - value("generation_logprobs", t) for t in positions)
                / len(positions)
            )
        else:
            ratio = {t: torch.exp(lp[t] - value("prev_logprobs", t)) for t in positions}
        actor_terms, kl_terms = [], []
        for t in positions:
            adv, r = value("advantages", t), ratio[t]
            clamped = torch.clamp(r, 1 - eps_low, 1 + eps_high)
            stats["ratio"] += float(r.detach())
            stats["clamped"] += float(clamped.detach())
            if cfg.disable_ppo_ratio:
                pg = -adv * lp[t]
            else:
                unclipped, clipped = -adv * r, -adv * clamped
                pg = unclipped if float(unclipped.detach()) >= float(clipped.detach()) else clipped
                stats["low"] += float(adv < 0 and float(r.detach()) < 1 - eps_low)
                stats["high"] += float(adv > 0 and float(r.detach()) > 1 + eps_high)
                if c is not None and adv < 0:
                    stats["dual"] += float(float(r.detach()) > c)
                    pg = torch.clamp(pg, max=-c * adv)
            if cfg.use_importance_sampling_correction:
                if cfg.sequence_level_importance_ratios:
                    w = seq_weight
                else:
                    w = math.exp(value("prev_logprobs", t) - value("generation_logprobs", t))
                limit = cfg.truncated_importance_sampling_ratio
                if limit is not None:
                    stats["truncated"] += float(w > limit)
                    w = min(w, limit)
                stats["weight"] += w
                pg = pg * w
            actor_terms.append(pg)
            k = _kl(lp[t], value("reference_policy_logprobs", t), cfg)
            stats["refkl"] += float(k.detach())
            if cfg.use_on_policy_kl_approximation:
                k = k * math.exp(float(lp[t].detach()) - value("generation_logprobs", t))
            kl_terms.append(beta * k)
            gen, prev = value("generation_logprobs", t), value("prev_logprobs", t)
            stats["mult"] += math.exp(abs(gen - prev))
            stats["genkl"] += math.exp(prev - gen) - 1 - (prev - gen)
            stats["entropy"] += -math.exp(float(lp[t].detach()) - gen) * float(lp[t].detach())
        if cfg.token_level_loss:
            actor_total = actor_total + sum(actor_terms) / gvt
            kl_total = kl_total + sum(kl_terms) / gvt
        else:
            actor_total = actor_total + sum(actor_terms) / len(positions) / gvs
            kl_total = kl_total + sum(kl_terms) / len(positions) / gvs
    loss = actor_total + kl_total
    metrics = {
        "loss": float(loss.detach()),
        "actor_loss": float(actor_total.detach()),
        "kl_penalty": float(kl_total.detach()),
        "probs_ratio_mean": stats["ratio"] / gvt,
        "probs_ratio_clamped_mean": stats["clamped"] / gvt,
        "clip_fraction_lower": stats["low"] / gvt,
        "clip_fraction_upper": stats["high"] / gvt,
        "clip_fraction": (stats["low"] + stats["high"]) / gvt,
        "dual_clip_fraction": stats["dual"] / gvt,
        "token_mult_prob_error": stats["mult"] / gvt,
        "gen_kl_error": stats["genkl"] / gvt,
        "approx_entropy": stats["entropy"] / gvt,
        "reference_kl": stats["refkl"] / gvt,
        "num_valid_samples": float(data["sample_mask"].sum()),
        "num_valid_tokens": float(gvt),
    }
    if cfg.use_importance_sampling_correction:
        metrics["importance_weight_mean"] = stats["weight"] / gvt
        if cfg.truncated_importance_sampling_ratio is not None:
            metrics["importance_weight_truncated_fraction"] = stats["truncated"] / gvt
    return loss, metrics


CONFIGS: dict[str, dict[str, Any]] = {
    "grpo_token_level": {},
    "dapo_clip_higher_dual_clip_sequence_level_k3": {
        "ratio_clip_min": 0.2,
        "ratio_clip_max": 0.28,
        "ratio_clip_c": 1.3,
        "token_level_loss": False,
        "reference_policy_kl_penalty": 0.1,
    },
    "k1_with_active_clamps": {
        "reference_policy_kl_penalty": 0.5,
        "reference_policy_kl_type": "k1",
        "kl_input_clamp_value": 0.4,
        "kl_output_clamp_value": 0.3,
    },
    "k2_on_policy_kl_approximation": {
        "reference_policy_kl_penalty": 0.2,
        "reference_policy_kl_type": "k2",
        "use_on_policy_kl_approximation": True,
        "kl_input_clamp_value": None,
        "kl_output_clamp_value": None,
    },
    "reinforce_no_ratio": {"disable_ppo_ratio": True, "reference_policy_kl_penalty": 0.05},
    "gspo_sequence_level": {
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
        "ratio_clip_min": 3e-4,
        "ratio_clip_max": 4e-4,
    },
    "gspo_token_level_loss_dual_clip": {
        "sequence_level_importance_ratios": True,
        "ratio_clip_min": 0.02,
        "ratio_clip_max": 0.03,
        "ratio_clip_c": 1.05,
    },
    "truncated_importance_sampling": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_ratio": 1.1,
    },
    "untruncated_importance_sampling_sequence_level": {
        "use_importance_sampling_correction": True,
        "token_level_loss": False,
        "reference_policy_kl_penalty": 0.1,
    },
    "gspo_with_sequence_importance_weights": {
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
        "ratio_clip_min": 0.02,
        "ratio_clip_max": 0.03,
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_ratio": 1.05,
    },
}


def _near_policy_batch(seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits, data = random_batch(batch_size=16, seq_len=12, vocab=11, seed=seed)
    make_near_policy(logits, data, scale=0.45, seed=seed + 100)
    return logits, data


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_per_token_reference(name: str) -> None:
    cfg = ClippedPGLossConfig(**CONFIGS[name])
    loss_fn = ClippedPGLossFn(cfg)
    logits, data = _near_policy_batch(seed=len(name))
    gvs, gvt = global_counts(data)

    assert_close_with_grad(
        lambda x: loss_fn(x, data, gvs, gvt)[0],
        lambda x: reference_clipped_pg(x, data, cfg, float(gvs), float(gvt))[0],
        logits,
    )
    _, metrics = loss_fn(logits, data, gvs, gvt)
    _, expected = reference_clipped_pg(logits, data, cfg, float(gvs), float(gvt))
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert math.isclose(metrics[key], value, abs_tol=TOL), (key, metrics[key], value)


def test_the_configurations_exercise_every_branch() -> None:
    """Guards the reference comparison above against being vacuous (e.g. nothing ever clipped)."""

    def metrics_of(name: str) -> dict[str, float]:
        logits, data = _near_policy_batch(seed=len(name))
        return ClippedPGLossFn(CONFIGS[name])(logits, data, *global_counts(data))[1]

    dapo = metrics_of("dapo_clip_higher_dual_clip_sequence_level_k3")
    assert (
        dapo["clip_fraction_lower"] > 0 and dapo["clip_fraction_upper"] > 0 and dapo["dual_clip_fraction"] > 0
    )
    gspo = metrics_of("gspo_token_level_loss_dual_clip")
    assert gspo["clip_fraction"] > 0 and gspo["dual_clip_fraction"] > 0
    tis = metrics_of("truncated_importance_sampling")
    assert 0 < tis["importance_weight_truncated_fraction"] < 1
    assert 0 < metrics_of("gspo_with_sequence_importance_weights")["importance_weight_truncated_fraction"] < 1
    # With clamps at 0.4 / 0.3 some per-token KL estimates are clamped.
    logits, data = _near_policy_batch(seed=1)
    cfg = ClippedPGLossConfig(**CONFIGS["k1_with_active_clamps"])
    unclamped = cfg.model_copy(update={"kl_input_clamp_value": None, "kl_output_clamp_value": None})
    counts = global_counts(data)
    assert ClippedPGLossFn(cfg)(logits, data, *counts)[1]["reference_kl"] != pytest.approx(
        ClippedPGLossFn(unclamped)(logits, data, *counts)[1]["reference_kl"]
    )


def test_gspo_equals_the_paper_objective_for_sequence_advantages() -> None:
    """With one advantage per sample and sequence-level reduction, the GSPO-token form equals
    J = mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log(pi / pi_old)), in value and gradient."""
    eps_low, eps_high = 0.01, 0.015
    cfg = ClippedPGLossConfig(
        sequence_level_importance_ratios=True,
        token_level_loss=False,
        ratio_clip_min=eps_low,
        ratio_clip_max=eps_high,
    )
    logits, data = random_batch(batch_size=8, seq_len=7, vocab=9, seed=3)
    make_near_policy(logits, data, scale=0.05, seed=4)
    g = torch.Generator().manual_seed(5)
    per_sample = torch.randn(8, 1, generator=g, dtype=torch.float64)
    data["advantages"] = with_garbage(per_sample.expand(8, 7).clone(), data)
    gvs, gvt = global_counts(data)

    def paper(x: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for b in range(8):
            positions = valid_positions(data, b)
            if not positions:
                continue
            log_ratios = [
                reference_logprob(x, data["input_ids"], b, t) - data["prev_logprobs"][b, t] for t in positions
            ]
            s = torch.exp(torch.stack(log_ratios).mean())
            adv = float(per_sample[b])
            total = total + torch.maximum(-adv * s, -adv * torch.clamp(s, 1 - eps_low, 1 + eps_high))
        return total / gvs

    assert_close_with_grad(lambda x: ClippedPGLossFn(cfg)(x, data, gvs, gvt)[0], paper, logits)
    clip_fraction = ClippedPGLossFn(cfg)(logits, data, gvs, gvt)[1]["clip_fraction"]
    assert 0 < clip_fraction < 1


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_microbatches_sum_to_the_full_batch(name: str) -> None:
    logits, data = _near_policy_batch(seed=7)
    assert_microbatch_additivity(ClippedPGLossFn(CONFIGS[name]), logits, data, boundaries=[1, 4])


def test_zero_ratio_reduces_to_policy_gradient_and_on_policy_metrics() -> None:
    """On-policy (prev = gen = current logprobs): ratio 1, no clipping, gradient -A grad log pi."""
    logits, data = random_batch(seed=11)
    make_near_policy(logits, data, scale=0.0, seed=0)
    gvs, gvt = global_counts(data)
    loss_fn = ClippedPGLossFn({"ratio_clip_c": 3.0})
    reinforce = ClippedPGLossFn({"disable_ppo_ratio": True})
    # Adding the other loss on detached logits equalises the values, so this compares gradients.
    assert_close_with_grad(
        lambda x: loss_fn(x, data, gvs, gvt)[0] + reinforce(x.detach(), data, gvs, gvt)[0],
        lambda x: reinforce(x, data, gvs, gvt)[0] + loss_fn(x.detach(), data, gvs, gvt)[0],
        logits,
    )
    metrics = loss_fn(logits, data, gvs, gvt)[1]
    assert metrics["probs_ratio_mean"] == pytest.approx(1.0, abs=1e-12)
    assert metrics["clip_fraction"] == 0.0 and metrics["dual_clip_fraction"] == 0.0
    assert metrics["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-12)
    assert metrics["gen_kl_error"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["reference_kl"] == pytest.approx(0.0, abs=1e-12)


def test_low_precision_logits_are_upcast_to_float32() -> None:
    logits, data = random_batch(seed=2)
    make_near_policy(logits, data, scale=0.3, seed=2)
    data32 = {k: (v.float() if v.is_floating_point() else v) for k, v in data.items()}
    half = logits.to(torch.bfloat16)
    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.1})
    counts = global_counts(data32)
    from_bf16 = loss_fn(half, data32, *counts)[0]
    from_fp32 = loss_fn(half.float(), data32, *counts)[0]
    assert from_bf16.dtype == torch.float32
    assert torch.equal(from_bf16, from_fp32)


def test_sequence_and_token_level_normalisation_differ_and_report_their_type() -> None:
    logits, data = _near_policy_batch(seed=5)
    counts = global_counts(data)
    token = ClippedPGLossFn({"token_level_loss": True})
    sequence = ClippedPGLossFn({"token_level_loss": False})
    assert isinstance(token, LossFunction)
    assert token.loss_type is LossType.TOKEN_LEVEL and sequence.loss_type is LossType.SEQUENCE_LEVEL
    assert float(token(logits, data, *counts)[0]) != pytest.approx(float(sequence(logits, data, *counts)[0]))


def test_an_empty_global_batch_gives_zero_not_nan() -> None:
    logits, data = _near_policy_batch(seed=6)
    data["sample_mask"] = torch.zeros_like(data["sample_mask"])
    loss, metrics = ClippedPGLossFn({"reference_policy_kl_penalty": 0.1})(logits, data, *global_counts(data))
    assert float(loss) == 0.0
    assert all(math.isfinite(v) for v in metrics.values())


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="ratio_clip_maxx"):
        ClippedPGLossFn({"ratio_clip_maxx": 0.3})
    with pytest.raises(ConfigError, match="ratio_clip_c"):
        ClippedPGLossFn({"ratio_clip_c": 0.5})
    with pytest.raises(ConfigError, match="reference_policy_kl_type"):
        ClippedPGLossFn({"reference_policy_kl_type": "k4"})
    with pytest.raises(ValueError, match="use_importance_sampling_correction"):
        ClippedPGLossConfig(truncated_importance_sampling_ratio=2.0)
    with pytest.raises(ValueError, match="disable_ppo_ratio"):
        ClippedPGLossConfig(disable_ppo_ratio=True, sequence_level_importance_ratios=True)


def test_input_errors_name_the_field() -> None:
    logits, data = _near_policy_batch(seed=8)
    counts = global_counts(data)
    missing = {k: v for k, v in data.items() if k != "advantages"}
    with pytest.raises(LossInputError, match=r"ClippedPGLossFn: the batch has no 'advantages'"):
        ClippedPGLossFn()(logits, missing, *counts)
    no_reference = {k: v for k, v in data.items() if k != "reference_policy_logprobs"}
    ClippedPGLossFn()(logits, no_reference, *counts)  # beta = 0 does not need it
    with pytest.raises(LossInputError, match="reference_policy_logprobs"):
        ClippedPGLossFn({"reference_policy_kl_penalty": 0.1})(logits, no_reference, *counts)
    short = dict(data, prev_logprobs=data["prev_logprobs"][:, :-1])
    with pytest.raises(LossInputError, match=r"data\['prev_logprobs'\] has shape \(16, 11\)"):
        ClippedPGLossFn()(logits, short, *counts)
    out_of_vocab = dict(data, input_ids=data["input_ids"] + 100)
    with pytest.raises(LossInputError, match="outside"):
        ClippedPGLossFn()(logits, out_of_vocab, *counts)
