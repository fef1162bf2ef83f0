"""DTensorPolicyWorker on real gloo process groups (1 and 2 spawned ranks) against
single-process references: a plain Hugging Face forward and a plain PyTorch SGD step.

The spawned scenarios (`dtensor_scenarios`) run once per module; each test checks one claim.
SGD with lr = 1 makes the parameter update equal to the gradient, so "same update" checks are
"same gradient" checks (Adam's first step, ~lr * sign(grad), would hide a scale error).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dtensor_scenarios import one_rank, two_ranks
from dtensor_testing import (
    NLLLoss,
    load_plain_model,
    make_batch,
    max_param_diff,
    mean_token_mult_prob_error,
    plain_logits,
    plain_logprobs,
    plain_sgd_step,
    run_ranks,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_core.data import BatchedDataDict
from rl_dtensor.convert import convert_checkpoint_to_hf, main

LENGTHS = [24, 17, 9, 5, 20, 12, 3, 22]
PROMPT_LENGTHS = [2, 4, 3, 2, 6, 1, 1, 5]
# Row 3 is filtered out; ranks 0 and 1 (rows 0-3, 4-7) hold different numbers of valid tokens,
# so normalising per rank or per micro-batch instead of globally would change the update.
SAMPLE_MASK = [1, 1, 1, 0, 1, 1, 1, 1]


@pytest.fixture(scope="module")
def batch(tiny_model_dir: Path) -> BatchedDataDict[Any]:
    vocab = len(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    return make_batch(vocab, LENGTHS, PROMPT_LENGTHS, SAMPLE_MASK, seed=3)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> BatchedDataDict[Any]:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    texts = ["What is 12 + 7?", "Q: 3 + 4", "If you have 5 apples and"]
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    return BatchedDataDict(input_ids=encoded["input_ids"], input_lengths=encoded["attention_mask"].sum(-1))


@pytest.fixture(scope="module")
def reference_step(
    tiny_model_dir: Path, batch: BatchedDataDict[Any]
) -> tuple[dict[str, torch.Tensor], float, float]:
    return plain_sgd_step(tiny_model_dir, batch, lr=1.0, max_grad_norm=None)


@pytest.fixture(scope="module")
def initial_params(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in load_plain_model(tiny_model_dir).named_parameters()}


@pytest.fixture(scope="module")
def one_rank_results(
    tiny_model_dir: Path,
    tiny_llama_tied_dir: Path,
    batch: BatchedDataDict[Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("one_rank")
    (result,) = run_ranks(one_rank, 1, str(tiny_model_dir), str(tiny_llama_tied_dir), batch, str(work))
    result["work_dir"] = work
    return result


@pytest.fixture(scope="module")
def two_rank_results(
    tiny_model_dir: Path,
    batch: BatchedDataDict[Any],
    prompts: BatchedDataDict[Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Any], dict[str, Any], Path]:
    work = tmp_path_factory.mktemp("two_ranks")
    rank0, rank1 = run_ranks(two_ranks, 2, str(tiny_model_dir), batch, prompts, str(work))
    return rank0, rank1, work


def _valid(batch: BatchedDataDict[Any]) -> torch.Tensor:
    return torch.arange(batch["input_ids"].shape[1])[None, :] < batch["input_lengths"][:, None]


# ------------------------------------------------------------------------------------- log-probs


def test_fsdp_dp2_logprobs_equal_plain_hf_forward(two_rank_results, tiny_model_dir, batch):
    rank0, rank1, _ = two_rank_results
    got = torch.cat([rank0["dp2_logprobs"], rank1["dp2_logprobs"]])
    expected = plain_logprobs(load_plain_model(tiny_model_dir), batch["input_ids"], batch["input_lengths"])
    assert got.shape == expected.shape == (8, 24)
    assert float((got - expected).abs().max()) < 1e-5
    assert float(got[:, 0].abs().max()) == 0.0
    assert float(got[~_valid(batch)].abs().max()) == 0.0


def test_uneven_shards_with_different_microbatch_counts(two_rank_results, tiny_model_dir, batch):
    rank0, rank1, _ = two_rank_results
    got = torch.cat([rank0["uneven_logprobs"], rank1["uneven_logprobs"]])
    sub = batch.slice(0, 3)
    expected = plain_logprobs(load_plain_model(tiny_model_dir), sub["input_ids"], sub["input_lengths"])
    assert float((got - expected).abs().max()) < 1e-5


def test_reference_logprobs_use_the_initial_weights(two_rank_results, tiny_model_dir, batch):
    rank0, rank1, _ = two_rank_results
    got = torch.cat([rank0["reference_logprobs_after_step"], rank1["reference_logprobs_after_step"]])
    initial = plain_logprobs(load_plain_model(tiny_model_dir), batch["input_ids"], batch["input_lengths"])
    assert float((got - initial).abs().max()) < 1e-5
    # The worker had trained a step by then: its current log-probs are different.
    assert float((rank0["export_logprobs"] - initial[:4]).abs().max()) > 1e-3


# ------------------------------------------------------------------------- global normalisation


def test_one_step_same_for_mbs1_mbs8_dp2_and_plain_loop(
    one_rank_results, two_rank_results, reference_step, initial_params
):
    rank0, rank1, _ = two_rank_results
    ref_params, ref_loss, _ = reference_step
    candidates = {
        "mbs=1": one_rank_results["mbs1"],
        "mbs=8": one_rank_results["mbs8"],
        "dp=2,mbs=1": rank0["dp2_step"],
    }
    assert max_param_diff(ref_params, initial_params) > 1e-2  # the step really moves the weights
    for name, result in candidates.items():
        assert max_param_diff(result["params"], ref_params) < 1e-6, name
        assert result["metrics"]["loss"][0] == pytest.approx(ref_loss, abs=1e-6), name
        assert result["metrics"]["global_valid_toks"] == [
            float(
                sum(
                    max(length - max(prompt, 1), 0)
                    for length, prompt, keep in zip(LENGTHS, PROMPT_LENGTHS, SAMPLE_MASK)
                    if keep
                )
            )
        ], name
    # Both ranks report the same (reduced) metrics.
    assert rank0["dp2_step"]["metrics"] == rank1["dp2_step"]["metrics"]
    assert (
        rank0["dp2_step"]["metrics"]["num_valid_tokens"] == rank0["dp2_step"]["metrics"]["global_valid_toks"]
    )


def test_packed_microbatches_same_logprobs_and_gradients(
    one_rank_results, tiny_model_dir, batch, reference_step
):
    ref_params, ref_loss, _ = reference_step
    expected = plain_logprobs(load_plain_model(tiny_model_dir), batch["input_ids"], batch["input_lengths"])
    assert float((one_rank_results["packed_logprobs"] - expected).abs().max()) < 1e-5
    assert one_rank_results["packed_num_microbatches"] > 1
    assert max_param_diff(one_rank_results["packed"]["params"], ref_params) < 1e-5
    assert one_rank_results["packed"]["metrics"]["loss"][0] == pytest.approx(ref_loss, abs=1e-5)


def test_dp2_planned_packing_same_logprobs_and_update(
    two_rank_results, tiny_model_dir, batch, reference_step
):
    rank0, rank1, _ = two_rank_results
    ref_params, _, _ = reference_step
    gathered = BatchedDataDict.from_batches(
        [
            BatchedDataDict(logprobs=rank0["dp2_packed_logprobs"]),
            BatchedDataDict(logprobs=rank1["dp2_packed_logprobs"]),
        ]
    ).reorder_data(rank0["dp2_packed_logprob_order"])["logprobs"]
    expected = plain_logprobs(load_plain_model(tiny_model_dir), batch["input_ids"], batch["input_lengths"])
    assert float((gathered - expected).abs().max()) < 1e-5
    assert max_param_diff(rank0["dp2_packed_step"]["params"], ref_params) < 1e-5


def test_dynamic_batching_same_update(one_rank_results, reference_step):
    ref_params, _, _ = reference_step
    assert one_rank_results["dynamic_num_microbatches"] > 1
    assert max_param_diff(one_rank_results["dynamic"]["params"], ref_params) < 1e-6


def test_activation_checkpointing_and_cpu_offload_same_update(one_rank_results, reference_step):
    ref_params, _, _ = reference_step
    for name in ("activation_checkpointing", "cpu_offload"):
        assert max_param_diff(one_rank_results[name]["params"], ref_params) < 1e-6, name


def test_bfloat16_compute_keeps_float32_master_weights(
    one_rank_results, tiny_model_dir, batch, reference_step
):
    _, ref_loss, _ = reference_step
    expected = plain_logprobs(load_plain_model(tiny_model_dir), batch["input_ids"], batch["input_lengths"])
    error = float((one_rank_results["bf16_logprobs"] - expected).abs().max())
    assert 0 < error < 0.1  # bf16 rounding, nothing worse
    assert one_rank_results["bf16_loss"][0] == pytest.approx(ref_loss, abs=0.05)
    assert {dtype for _, dtype in one_rank_results["bf16_refit_info"].values()} == {"float32"}


def test_tied_embeddings_train_export_and_convert(one_rank_results, tiny_llama_tied_dir, batch, tmp_path):
    ref_params, _, _ = plain_sgd_step(tiny_llama_tied_dir, batch, lr=1.0, max_grad_norm=None)
    trained = one_rank_results["tied"]["params"]
    assert "lm_head.weight" not in trained  # one tensor, reported under its first name
    assert max_param_diff(trained, ref_params) < 1e-6
    work = one_rank_results["work_dir"]
    converted = convert_checkpoint_to_hf(work / "tied" / "weights", tmp_path / "converted")
    for directory in (work / "tied_exported", converted):
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert max_param_diff({n: p.detach() for n, p in model.named_parameters()}, trained) == 0.0


# -------------------------------------------------------------------------------- tensor parallel


def test_tp2_sequence_parallel_matches_unsharded(two_rank_results, tiny_model_dir, batch):
    rank0, rank1, _ = two_rank_results
    model = load_plain_model(tiny_model_dir)
    expected = plain_logprobs(model, batch["input_ids"], batch["input_lengths"])
    _, ref_loss, _ = plain_sgd_step(tiny_model_dir, batch, lr=1.0, max_grad_norm=None)
    for result in (rank0, rank1):
        assert float((result["tp2_logprobs"] - expected).abs().max()) < 1e-5
        assert result["tp2_eval"]["loss"][0] == pytest.approx(ref_loss, abs=1e-6)


def test_tp2_sequence_parallel_with_packing(two_rank_results, tiny_model_dir, batch, reference_step):
    rank0, _, _ = two_rank_results
    ref_params, _, _ = reference_step
    expected = plain_logprobs(load_plain_model(tiny_model_dir), batch["input_ids"], batch["input_lengths"])
    assert float((rank0["tp2_packed_logprobs"] - expected).abs().max()) < 1e-5
    assert max_param_diff(rank0["tp2_packed_step"]["params"], ref_params) < 1e-5


def test_tp2_step_with_active_clipping_matches_plain_clip(two_rank_results, tiny_model_dir, batch):
    rank0, _, _ = two_rank_results
    ref_params, _, ref_norm = plain_sgd_step(tiny_model_dir, batch, lr=1.0, max_grad_norm=0.05)
    assert ref_norm > 0.05  # clipping is active
    assert rank0["tp2_step"]["metrics"]["grad_norm"][0] == pytest.approx(ref_norm, rel=1e-5)
    assert max_param_diff(rank0["tp2_step"]["params"], ref_params) < 1e-6


# ----------------------------------------------------------------------------- checkpoints, export


def test_resume_from_checkpoint_continues_identically(two_rank_results):
    rank0, _, _ = two_rank_results
    straight, resumed = rank0["uninterrupted"], rank0["resumed"]
    assert straight["metrics"]["num_steps"] == resumed["metrics"]["num_steps"] == 2
    for key in ("loss", "grad_norm", "lr"):
        assert resumed["metrics"][key] == pytest.approx(straight["metrics"][key], abs=1e-6), key
    # The linear decay really moved the LR, and the clipped AdamW steps depend on restored state.
    assert straight["metrics"]["lr"][0] != straight["metrics"]["lr"][1]
    assert max_param_diff(resumed["params"], straight["params"]) < 1e-6


def test_exported_hf_directory_loads_and_gives_same_logits(two_rank_results, batch):
    rank0, _, work = two_rank_results
    exported = AutoModelForCausalLM.from_pretrained(str(work / "exported"), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(work / "exported"))
    assert tokenizer.eos_token == "<|im_end|>"
    params = {n: p.detach() for n, p in exported.named_parameters()}
    assert max_param_diff(params, rank0["uninterrupted"]["params"]) == 0.0
    rows = batch.slice(0, 4)
    with torch.no_grad():
        logits = plain_logits(exported.eval(), rows["input_ids"], rows["input_lengths"])
    topk_values, topk_indices = torch.topk(logits, 16, dim=-1)
    valid = _valid(rows)
    assert torch.equal(topk_indices[valid], rank0["export_topk"]["topk_indices"][valid])
    assert float((topk_values - rank0["export_topk"]["topk_logits"])[valid].abs().max()) < 1e-5
    lp = plain_logprobs(exported, rows["input_ids"], rows["input_lengths"])
    assert float((lp - rank0["export_logprobs"]).abs().max()) < 1e-5


def test_converter_command_writes_checkpoint_as_hf(two_rank_results, tmp_path, capsys):
    rank0, _, work = two_rank_results
    out = tmp_path / "converted"
    assert main(["--checkpoint", str(work / "ckpt" / "weights"), "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    converted = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    AutoTokenizer.from_pretrained(str(out))  # the tokenizer saved beside the weights came along
    params = {n: p.detach() for n, p in converted.named_parameters()}
    assert max_param_diff(params, rank0["after_first_step"]) == 0.0
    with pytest.raises(FileNotFoundError, match=r"no DCP \.metadata"):
        convert_checkpoint_to_hf(tmp_path / "missing", tmp_path / "x")
    assert main(["--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 1


def test_refit_buckets_are_bounded_and_complete(two_rank_results, initial_params):
    rank0, _, _ = two_rank_results
    info = rank0["refit_info"]
    assert set(info) == set(initial_params)
    assert all(
        tuple(initial_params[n].shape) == shape and dtype == "float32" for n, (shape, dtype) in info.items()
    )
    for total, largest in zip(rank0["bucket_bytes"], rank0["bucket_max_tensor_bytes"]):
        assert total <= 20_000 or total == largest  # only a single oversized tensor may exceed
    assert sum(rank0["bucket_bytes"]) == sum(t.numel() * 4 for t in initial_params.values())


# ------------------------------------------------------------------------------------- generation


def test_colocated_fsdp_generation_logprobs_match_training_logprobs(two_rank_results):
    rank0, rank1, _ = two_rank_results
    for result, max_new in ((rank0, 6), (rank1, 10)):
        gen = result["generated"]
        lengths = gen["generation_lengths"]
        assert bool((lengths >= 1).all()) and bool((lengths <= max_new).all())
        total = gen["unpadded_sequence_lengths"]
        positions = torch.arange(gen["output_ids"].shape[1])[None, :]
        generated_mask = (positions >= (total - lengths)[:, None]) & (positions < total[:, None])
        error = mean_token_mult_prob_error(
            gen["logprobs"], result["generated_train_logprobs"], generated_mask
        )
        assert 1.0 <= error <= 1.001


def test_too_long_sequence_is_a_clear_error(one_rank_results):
    for method in ("get_logprobs", "train"):
        message = one_rank_results[f"too_long_{method}"]
        assert "sample 1 has 70 tokens, more than max_total_sequence_length=64" in message


def test_nll_loss_helper_is_globally_normalised():
    # Guard for the reference itself: two halves with global counts sum to the full-batch loss.
    logits = torch.randn(4, 5, 11)
    data = make_batch(11, [5, 4, 3, 5], [1, 2, 1, 3], [1, 1, 0, 1], seed=0)
    mask = data["token_mask"][:, 1:].float() * data["sample_mask"][:, None]
    full, _ = NLLLoss()(logits, data, data["sample_mask"].sum(), mask.sum())
    halves = sum(
        NLLLoss()(logits[i : i + 2], data.slice(i, i + 2), torch.tensor(3.0), mask.sum())[0] for i in (0, 2)
    )
    assert float(halves) == pytest.approx(float(full), abs=1e-6)
