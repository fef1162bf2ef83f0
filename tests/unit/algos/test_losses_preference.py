"""DPO and Bradley–Terry (reward model) losses against per-pair reference loops."""

from __future__ import annotations

import math

import pytest
import torch
from loss_testing import (
    TOL,
    assert_close_with_grad,
    assert_microbatch_additivity,
    global_counts,
    random_batch,
    reference_logprob,
    valid_positions,
    with_garbage,
)

from rl_algos.losses import DPOLossConfig, DPOLossFn, LossInputError, PreferenceLossFn
from rl_core.interfaces import LossType


def _neg_log_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.log1p(torch.exp(-x))


def paired_batch(seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """16 sequences = 8 chosen/rejected pairs; pair 1 is filtered out."""
    logits, data = random_batch(batch_size=16, seq_len=8, vocab=10, seed=seed)
    data["sample_mask"] = torch.ones(16, dtype=torch.float64)
    data["sample_mask"][2:4] = 0.0
    g = torch.Generator().manual_seed(seed + 1)
    reference = -3.0 * torch.rand(16, 8, generator=g, dtype=torch.float64)
    data["reference_policy_logprobs"] = with_garbage(reference, data)
    return logits, data


def reference_dpo(
    logits: torch.Tensor, data: dict[str, torch.Tensor], cfg: DPOLossConfig, gvs: float
) -> tuple[torch.Tensor, dict[str, float]]:
    num_pairs = gvs / 2

    def sequence_logprob(b: int, average: bool, policy: bool) -> torch.Tensor:
        positions = valid_positions(data, b)
        terms = [
            reference_logprob(logits, data["input_ids"], b, t)
            if policy
            else torch.tensor(float(data["reference_policy_logprobs"][b, t]), dtype=torch.float64)
            for t in positions
        ]
        total = sum(terms, torch.zeros((), dtype=torch.float64))
        return total / len(terms) if average and terms else total

    loss = torch.zeros((), dtype=torch.float64)
    sums = dict.fromkeys(["pref", "sft", "acc", "margin", "rc", "rr", "lc", "lr"], 0.0)
    for pair in range(logits.shape[0] // 2):
        chosen, rejected = 2 * pair, 2 * pair + 1
        if float(data["sample_mask"][chosen]) == 0.0:
            continue
        avg = cfg.preference_average_log_probs
        policy_c, policy_r = sequence_logprob(chosen, avg, True), sequence_logprob(rejected, avg, True)
        reward_c = cfg.beta * (policy_c - sequence_logprob(chosen, avg, False))
        reward_r = cfg.beta * (policy_r - sequence_logprob(rejected, avg, False))
        preference = _neg_log_sigmoid(reward_c - reward_r)
        sft = -sequence_logprob(chosen, cfg.sft_average_log_probs, True)
        loss = loss + preference + cfg.sft_loss_weight * sft
        margin = float(reward_c.detach() - reward_r.detach())
        for key, value in (
            ("pref", float(preference.detach())),
            ("sft", float(sft.detach())),
            ("acc", float(margin > 0)),
            ("margin", margin),
            ("rc", float(reward_c.detach())),
            ("rr", float(reward_r.detach())),
            ("lc", float(policy_c.detach())),
            ("lr", float(policy_r.detach())),
        ):
            sums[key] += value
    metrics = {
        "loss": float(loss.detach()) / num_pairs,
        "preference_loss": sums["pref"] / num_pairs,
        "sft_loss": sums["sft"] / num_pairs,
        "accuracy": sums["acc"] / num_pairs,
        "margin": sums["margin"] / num_pairs,
        "rewards_chosen_mean": sums["rc"] / num_pairs,
        "rewards_rejected_mean": sums["rr"] / num_pairs,
        "logprobs_chosen_mean": sums["lc"] / num_pairs,
        "logprobs_rejected_mean": sums["lr"] / num_pairs,
        "num_valid_samples": gvs,
        "num_valid_pairs": num_pairs,
    }
    return loss / num_pairs, metrics


DPO_CONFIGS = [
    {"beta": 0.1},
    {"beta": 0.5, "preference_average_log_probs": True},
    {"beta": 0.2, "sft_loss_weight": 0.3},
    {
        "beta": 0.2,
        "sft_loss_weight": 1.0,
        "sft_average_log_probs": True,
        "preference_average_log_probs": True,
    },
]


@pytest.mark.parametrize("overrides", DPO_CONFIGS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_dpo_matches_reference(overrides: dict[str, object]) -> None:
    cfg = DPOLossConfig.model_validate(overrides)
    loss_fn = DPOLossFn(cfg)
    assert loss_fn.loss_type is LossType.SEQUENCE_LEVEL
    logits, data = paired_batch(seed=3)
    gvs, gvt = global_counts(data)
    assert_close_with_grad(
        lambda x: loss_fn(x, data, gvs, gvt)[0], lambda x: reference_dpo(x, data, cfg, float(gvs))[0], logits
    )
    metrics = loss_fn(logits, data, gvs, gvt)[1]
    expected = reference_dpo(logits, data, cfg, float(gvs))[1]
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert math.isclose(metrics[key], value, abs_tol=TOL), (key, metrics[key], value)
    assert 0 < metrics["accuracy"] < 1  # both outcomes occur in this batch


@pytest.mark.parametrize("overrides", DPO_CONFIGS[2:])
def test_dpo_microbatches_of_whole_pairs_sum_to_the_full_batch(overrides: dict[str, object]) -> None:
    logits, data = paired_batch(seed=4)
    assert_microbatch_additivity(DPOLossFn(overrides), logits, data, boundaries=[2, 6, 12])


def test_dpo_rejects_split_pairs() -> None:
    logits, data = paired_batch(seed=5)
    counts = global_counts(data)
    with pytest.raises(LossInputError, match="odd number of samples"):
        DPOLossFn()(logits[:3], {k: v[:3] for k, v in data.items()}, *counts)
    split_pair = data["sample_mask"].clone()
    split_pair[1] = 0.0
    bad = dict(data, sample_mask=split_pair)
    with pytest.raises(LossInputError, match=r"sample_mask differs within pair 0 \(samples 0 and 1"):
        DPOLossFn()(logits, bad, *counts)
    with pytest.raises(LossInputError, match="reference_policy_logprobs"):
        DPOLossFn()(logits, {k: v for k, v in data.items() if k != "reference_policy_logprobs"}, *counts)


def reference_bradley_terry(scores: torch.Tensor, sample_mask: torch.Tensor, gvs: float) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for pair in range(scores.shape[0] // 2):
        if float(sample_mask[2 * pair]) != 0.0:
            total = total + _neg_log_sigmoid(scores[2 * pair].reshape(()) - scores[2 * pair + 1].reshape(()))
    return total / (gvs / 2)


@pytest.mark.parametrize("shape", [(8,), (8, 1)])
def test_bradley_terry_matches_reference(shape: tuple[int, ...]) -> None:
    scores = torch.tensor([2.0, -1.0, 5.0, 5.0, 0.3, 0.9, -0.2, -1.5], dtype=torch.float64).reshape(shape)
    sample_mask = torch.tensor([1, 1, 0, 0, 1, 1, 1, 1], dtype=torch.float64)
    data = {"sample_mask": sample_mask}
    gvs = sample_mask.sum()
    loss_fn = PreferenceLossFn()
    assert loss_fn.loss_type is LossType.SEQUENCE_LEVEL
    assert_close_with_grad(
        lambda x: loss_fn(x, data, gvs, 0)[0], lambda x: reference_bradley_terry(x, sample_mask, 6.0), scores
    )
    metrics = loss_fn(scores, data, gvs, 0)[1]
    # Pairs (2, -1), (0.3, 0.9), (-0.2, -1.5) count; the (5, 5) pair is filtered out.
    assert metrics["accuracy"] == pytest.approx(2 / 3)
    assert metrics["margin"] == pytest.approx((3.0 - 0.6 + 1.3) / 3)
    assert metrics["rewards_chosen_mean"] == pytest.approx((2.0 + 0.3 - 0.2) / 3)
    assert metrics["rewards_rejected_mean"] == pytest.approx((-1.0 + 0.9 - 1.5) / 3)
    assert metrics["num_valid_pairs"] == 3 and metrics["num_valid_samples"] == 6
    assert_microbatch_additivity(loss_fn, scores, data, boundaries=[2, 4], counts=(gvs, torch.tensor(0.0)))


def test_bradley_terry_ties_are_not_accurate_and_bad_shapes_are_named() -> None:
    scores = torch.tensor([1.0, 1.0], dtype=torch.float64)
    loss, metrics = PreferenceLossFn()(scores, {"sample_mask": torch.ones(2)}, 2, 0)
    assert metrics["accuracy"] == 0.0 and float(loss) == pytest.approx(math.log(2))
    with pytest.raises(LossInputError, match=r"\[B\] or \[B, 1\]; got \(2, 3, 5\)"):
        PreferenceLossFn()(torch.zeros(2, 3, 5), {"sample_mask": torch.ones(2)}, 2, 0)
