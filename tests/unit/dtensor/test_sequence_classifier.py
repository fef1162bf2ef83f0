"""`policy.model_class: sequence_classification` on one gloo rank: the loss receives one score per
sequence (the head at its last token), equal to Hugging Face's own classifier, in padded and
packed micro-batches; a Bradley–Terry SGD step equals the same step on a plain model; the export
is a `...ForSequenceClassification` directory that scores like the trained worker."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from dtensor_testing import make_batch, policy_config, run_ranks
from transformers import AutoModelForSequenceClassification

from rl_algos.losses import PreferenceLossFn
from rl_core.data import BatchedDataDict, SequencePackingArgs
from rl_core.interfaces import LossType

SEED = 5
LR = 0.5
# Four sequences = two chosen/rejected pairs, right-padded to width 12.
LENGTHS = [9, 12, 5, 7]


class ScoreCapture:
    """Returns each row's score as a metric named by its `row_id` (a zero loss)."""

    loss_type = LossType.SEQUENCE_LEVEL

    def __call__(
        self, logits: torch.Tensor, data: Mapping[str, Any], global_valid_seqs: Any, global_valid_toks: Any
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        assert logits.shape == (data["input_ids"].shape[0], 1), logits.shape
        metrics = {f"score_{int(i)}": float(s) for i, s in zip(data["row_id"], logits[:, 0])}
        return logits.sum() * 0.0, metrics


def _batch(vocab_size: int) -> BatchedDataDict[Any]:
    batch = make_batch(vocab_size, LENGTHS, [3, 3, 2, 2], [1, 1, 1, 1], width=12, seed=3)
    batch["row_id"] = torch.arange(len(LENGTHS))
    return batch


def _scores(worker: Any, data: BatchedDataDict[Any], gbs: int, mbs: int | None = None) -> list[float]:
    metrics = worker.train(data, ScoreCapture(), eval_mode=True, gbs=gbs, mbs=mbs)
    return [metrics[f"score_{i}"][0] for i in range(len(LENGTHS))]


def classifier_rank(model_dir: str, work_dir: str) -> dict[str, Any]:
    from rl_dtensor.worker import DTensorPolicyWorker

    common = {
        "model_class": "sequence_classification",
        "reference_model": False,
        "seed": SEED,
        "optimizer": {"name": "sgd", "kwargs": {"lr": LR}},
    }
    out: dict[str, Any] = {}
    worker = DTensorPolicyWorker(policy_config(model_dir, **common))
    batch = _batch(worker.hf_config.vocab_size)
    out["scores_before"] = _scores(worker, batch, gbs=4)
    try:
        worker.get_logprobs(batch)
    except RuntimeError as exc:
        out["logprobs_error"] = str(exc)
    out["step"] = worker.train(batch, PreferenceLossFn(), gbs=4, mbs=2)
    out["scores_after"] = _scores(worker, batch, gbs=4)
    out["export"] = worker.export_hf(str(Path(work_dir) / "reward_model"))
    worker.shutdown()

    packing = {"enabled": True, "train_mb_tokens": 24, "algorithm": "ffd"}
    packed = DTensorPolicyWorker(policy_config(model_dir, sequence_packing=packing, **common))
    (shard,), _ = batch.shard_by_batch_size(1, 4, sequence_packing_args=SequencePackingArgs(24, "ffd"))
    out["packed_microbatches"] = shard.get_microbatch_iterator_for_packable_sequences_len()
    out["packed_scores"] = _scores(packed, shard, gbs=4)
    packed.shutdown()
    return out


@pytest.fixture(scope="module")
def results(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("classifier")
    (result,) = run_ranks(classifier_rank, 1, str(tiny_model_dir), str(work))
    return result


def _plain_classifier(model_dir: Path | str) -> torch.nn.Module:
    """Hugging Face's own classifier, its new head initialised from the same seed as the worker's."""
    torch.manual_seed(SEED)
    model = AutoModelForSequenceClassification.from_pretrained(
        str(model_dir), num_labels=1, dtype=torch.float32
    )
    model.config.pad_token_id = 0
    return model


def _plain_scores(model: torch.nn.Module, batch: BatchedDataDict[Any]) -> torch.Tensor:
    mask = (torch.arange(batch["input_ids"].shape[1])[None, :] < batch["input_lengths"][:, None]).long()
    # HF pools at the last non-padding token, which is input_lengths - 1 for these rows.
    return model(input_ids=batch["input_ids"], attention_mask=mask).logits[:, 0]


def test_scores_are_the_classifier_head_at_the_last_token(results, tiny_model_dir) -> None:
    plain = _plain_classifier(tiny_model_dir)
    batch = _batch(plain.config.vocab_size)
    with torch.no_grad():
        expected = _plain_scores(plain, batch)
    assert results["scores_before"] == pytest.approx(expected.tolist(), abs=1e-5)
    assert len(set(results["scores_before"])) == 4  # distinct sequences, distinct scores
    # Packed micro-batches (two of them here) give the same scores as padded ones.
    assert results["packed_microbatches"] >= 2
    assert results["packed_scores"] == pytest.approx(results["scores_before"], abs=1e-5)


def test_bradley_terry_step_equals_a_plain_sgd_step(results, tiny_model_dir) -> None:
    plain = _plain_classifier(tiny_model_dir)
    batch = _batch(plain.config.vocab_size)
    scores = _plain_scores(plain, batch)
    loss = -torch.nn.functional.logsigmoid(scores[0::2] - scores[1::2]).mean()
    loss.backward()
    # policy_config trains without clipping (max_grad_norm None): the norm is only measured.
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), float("inf"))
    with torch.no_grad():
        for param in plain.parameters():
            param -= LR * param.grad
        expected_after = _plain_scores(plain, batch)
    step = results["step"]
    assert step["loss"][0] == pytest.approx(float(loss.detach()), abs=1e-6)
    assert step["grad_norm"][0] == pytest.approx(float(norm), rel=1e-5)
    assert step["accuracy"][0] == float(((scores[0::2] - scores[1::2]) > 0).float().mean())
    assert results["scores_after"] == pytest.approx(expected_after.tolist(), abs=1e-5)


def test_export_is_a_sequence_classifier_with_the_trained_scores(results, tiny_model_dir) -> None:
    exported = AutoModelForSequenceClassification.from_pretrained(results["export"], dtype=torch.float32)
    assert type(exported).__name__ == "Qwen2ForSequenceClassification"
    assert exported.config.num_labels == 1
    batch = _batch(exported.config.vocab_size)
    with torch.no_grad():
        scores = _plain_scores(exported, batch)
    assert scores.tolist() == pytest.approx(results["scores_after"], abs=1e-5)


def test_token_level_methods_refuse_a_classifier(results) -> None:
    assert "model_class='sequence_classification'" in results["logprobs_error"]
