"""Token log-probs, masks and global normalisation shared by every loss; the NLL (SFT) loss."""

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
)

from rl_algos.losses import (
    LossBatch,
    LossInputError,
    NLLLossFn,
    as_normaliser,
    kl_estimate,
    reduce_per_token,
    token_logprobs,
)
from rl_core.interfaces import LossType


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_align_with_input_ids(temperature: float) -> None:
    logits, data = random_batch(seed=1)
    ids = data["input_ids"]
    got = token_logprobs(logits, ids, temperature=temperature)
    assert got.shape == ids.shape and got.dtype == torch.float64
    assert torch.equal(got[:, 0], torch.zeros(ids.shape[0], dtype=torch.float64))
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            expected = reference_logprob(logits / temperature, ids, b, t)
            assert math.isclose(float(got[b, t]), float(expected), abs_tol=TOL)


def test_token_logprobs_upcast_half_precision() -> None:
    logits, data = random_batch(seed=2)
    half = logits.to(torch.bfloat16)
    got = token_logprobs(half, data["input_ids"])
    assert got.dtype == torch.float32
    assert torch.equal(got, token_logprobs(half.float(), data["input_ids"]))


def test_valid_token_mask_sums_to_the_global_token_count() -> None:
    logits, data = random_batch(seed=3)
    mask = LossBatch("test", data, logits).valid_token_mask()
    assert float(data["token_mask"][0, 0]) == 1.0  # set by random_batch: must not count
    assert float(mask[:, 0].abs().sum()) == 0.0
    assert float(mask.sum()) == float(global_counts(data)[1])
    assert float(mask[1].sum()) == 0.0  # the filtered sample


def test_reduce_per_token_token_and_sequence_level() -> None:
    values = torch.tensor(
        [[9.0, 1.0, 2.0, 3.0], [9.0, 4.0, 9.0, 9.0], [9.0, 5.0, 6.0, 9.0]], dtype=torch.float64
    )
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 0]], dtype=torch.float64)
    sample_mask = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    mask = mask * sample_mask[:, None]
    # Pretend the global batch has 8 valid tokens and 4 valid sequences elsewhere included.
    token = reduce_per_token(
        values, mask, sample_mask, LossType.TOKEN_LEVEL, torch.tensor(4.0), torch.tensor(8.0)
    )
    assert float(token) == pytest.approx((1 + 2 + 3 + 4) / 8)
    sequence = reduce_per_token(
        values, mask, sample_mask, LossType.SEQUENCE_LEVEL, torch.tensor(4.0), torch.tensor(8.0)
    )
    assert float(sequence) == pytest.approx((2.0 + 4.0) / 4)


def test_zero_global_count_is_treated_as_one() -> None:
    like = torch.zeros(2, dtype=torch.float64)
    assert float(as_normaliser(0, like)) == 1.0
    assert float(as_normaliser(torch.tensor(7), like)) == 7.0
    with pytest.raises(LossInputError, match="scalar"):
        as_normaliser(torch.ones(2), like)


def test_kl_estimators_closed_form() -> None:
    p = torch.tensor([-0.5, -2.0, -0.1], dtype=torch.float64)
    q = torch.tensor([-1.0, -0.2, -0.1], dtype=torch.float64)
    x = (q - p).tolist()
    assert kl_estimate(p, q, "k1").tolist() == pytest.approx([-v for v in x])
    assert kl_estimate(p, q, "k2").tolist() == pytest.approx([v * v / 2 for v in x])
    assert kl_estimate(p, q, "k3").tolist() == pytest.approx([math.exp(v) - 1 - v for v in x])
    assert kl_estimate(p, q, "k1", input_clamp=1.0).tolist() == pytest.approx([0.5, -1.0, 0.0])
    assert kl_estimate(p, q, "k3", output_clamp=0.1).tolist() == pytest.approx([0.1, 0.1, 0.0])


def reference_nll(logits: torch.Tensor, data: dict[str, torch.Tensor], gvt: float) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for b in range(logits.shape[0]):
        for t in valid_positions(data, b):
            total = total - reference_logprob(logits, data["input_ids"], b, t)
    return total / gvt


def test_nll_matches_reference_and_splits_into_microbatches() -> None:
    logits, data = random_batch(seed=4)
    gvs, gvt = global_counts(data)
    loss_fn = NLLLossFn()
    assert loss_fn.loss_type is LossType.TOKEN_LEVEL
    assert_close_with_grad(
        lambda x: loss_fn(x, data, gvs, gvt)[0], lambda x: reference_nll(x, data, float(gvt)), logits
    )
    metrics = loss_fn(logits, data, gvs, gvt)[1]
    assert metrics["num_valid_tokens"] == float(gvt) and metrics["num_valid_samples"] == float(gvs)
    assert_microbatch_additivity(loss_fn, logits, data, boundaries=[2, 3])


def test_nll_ignores_prompt_tokens() -> None:
    """Changing the logits that predict prompt tokens changes nothing; the answer's do."""
    logits, data = random_batch(batch_size=1, seq_len=6, seed=5)
    data["token_mask"] = torch.tensor([[0, 0, 0, 1, 1, 0]], dtype=torch.float64)
    data["sample_mask"] = torch.ones(1, dtype=torch.float64)
    counts = global_counts(data)
    base = NLLLossFn()(logits, data, *counts)[0]
    prompt_changed = logits.clone()
    prompt_changed[0, :2] += torch.randn(2, logits.shape[-1], dtype=torch.float64)  # predict tokens 1, 2
    prompt_changed[0, 5] += 1.0  # the last position predicts nothing
    assert float(NLLLossFn()(prompt_changed, data, *counts)[0]) == float(base)
    answer_changed = logits.clone()
    answer_changed[0, 2, data["input_ids"][0, 3]] += 1.0  # predicts token 3, trained
    assert float(NLLLossFn()(answer_changed, data, *counts)[0]) < float(base)


def test_batch_errors_name_the_loss_and_the_field() -> None:
    logits, data = random_batch(seed=6)
    counts = global_counts(data)
    with pytest.raises(LossInputError, match=r"NLLLossFn: the batch has no 'token_mask'"):
        NLLLossFn()(logits, {k: v for k, v in data.items() if k != "token_mask"}, *counts)
    with pytest.raises(LossInputError, match=r"data\['sample_mask'\] has shape \(5,\), expected \[B\]"):
        NLLLossFn()(logits, dict(data, sample_mask=data["sample_mask"][:5]), *counts)
    with pytest.raises(LossInputError, match="must hold integers"):
        NLLLossFn()(logits, dict(data, input_ids=data["input_ids"].double()), *counts)
    with pytest.raises(LossInputError, match="input_ids"):
        NLLLossFn()(logits[:, :-1], data, *counts)
    with pytest.raises(LossInputError, match="mapping"):
        NLLLossFn()(logits, [data], *counts)  # type: ignore[arg-type]
