"""`HFGenerationWorker` / `generate_batch` in this process against independent references:
a plain cache-free greedy loop and plain forwards over the generated sequences."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dtensor_testing import load_plain_model, mean_token_mult_prob_error, plain_logprobs
from transformers import AutoTokenizer

from rl_core.data import BatchedDataDict
from rl_dtensor.generation import HFGenerationWorker
from rl_dtensor.model_loading import ModelLoadError

TEXTS = ["What is 12 + 7?", "Q: 3 + 4 = ? A:", "If you have 5 apples and get", "Compute 1 plus 2."]


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> BatchedDataDict[Any]:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    encoded = tokenizer(TEXTS, padding=True, return_tensors="pt")
    return BatchedDataDict(input_ids=encoded["input_ids"], input_lengths=encoded["attention_mask"].sum(-1))


def _worker(model_dir: Path, **overrides: Any) -> HFGenerationWorker:
    return HFGenerationWorker({"model_name": str(model_dir), "max_total_sequence_length": 48, **overrides})


@pytest.fixture(scope="module")
def worker(tiny_model_dir: Path) -> HFGenerationWorker:
    return _worker(tiny_model_dir, temperature=0.7)


def _generated_mask(out: BatchedDataDict[Any]) -> torch.Tensor:
    positions = torch.arange(out["output_ids"].shape[1])[None, :]
    total = out["unpadded_sequence_lengths"]
    return (positions >= (total - out["generation_lengths"])[:, None]) & (positions < total[:, None])


def _greedy_reference(model: torch.nn.Module, prompt: list[int], max_new: int, eos: int) -> list[int]:
    """Argmax decoding with a full forward per token (no KV cache, no padding)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax())
            tokens.append(nxt)
            if nxt == eos:
                break
    return tokens[len(prompt) :]


def test_sampled_logprobs_match_training_logprobs(worker, prompts, tiny_model_dir):
    out = worker.generate(prompts, sampling={"max_new_tokens": 12})
    assert set(out) == {
        "output_ids",
        "logprobs",
        "generation_lengths",
        "unpadded_sequence_lengths",
        "truncated",
    }
    model = load_plain_model(tiny_model_dir)
    train = plain_logprobs(model, out["output_ids"], out["unpadded_sequence_lengths"], temperature=0.7)
    mask = _generated_mask(out)
    assert int(mask.sum()) >= 4
    assert mean_token_mult_prob_error(out["logprobs"], train, mask) <= 1.001
    assert float((out["logprobs"] - train)[mask].abs().max()) < 1e-4
    # Prompts are kept as given; log-probs are 0 off the generated tokens.
    for row, length in enumerate(prompts["input_lengths"].tolist()):
        assert torch.equal(out["output_ids"][row, :length], prompts["input_ids"][row, :length])
    assert float(out["logprobs"][~mask].abs().max()) == 0.0


def test_greedy_matches_cache_free_reference(tiny_model_dir, prompts):
    gen = _worker(tiny_model_dir)
    out = gen.generate(prompts, greedy=True, sampling={"max_new_tokens": 8})
    model = load_plain_model(tiny_model_dir)
    eos = gen.tokenizer.eos_token_id
    for row, length in enumerate(prompts["input_lengths"].tolist()):
        prompt = prompts["input_ids"][row, :length].tolist()
        expected = _greedy_reference(model, prompt, 8, eos)
        n = int(out["generation_lengths"][row])
        assert out["output_ids"][row, length : length + n].tolist() == expected
        assert bool(out["truncated"][row]) == (expected[-1] != eos)
    # top_k = 1 sampling is greedy decoding.
    top1 = gen.generate(prompts, sampling={"max_new_tokens": 8, "top_k": 1})
    assert torch.equal(top1["output_ids"], out["output_ids"])


def test_stop_token_stop_string_and_length_limits(tiny_model_dir, prompts):
    gen = _worker(tiny_model_dir)
    free = gen.generate(prompts, greedy=True, sampling={"max_new_tokens": 6})
    first_len = int(prompts["input_lengths"][0])
    continuation = free["output_ids"][0, first_len : first_len + 6].tolist()
    assert bool(free["truncated"].all()) and free["generation_lengths"].tolist() == [6] * 4

    stop_token = continuation[2]
    stopped = gen.generate(
        prompts, greedy=True, sampling={"max_new_tokens": 6, "stop_token_ids": [stop_token]}
    )
    assert int(stopped["generation_lengths"][0]) == continuation.index(stop_token) + 1
    assert not bool(stopped["truncated"][0])

    stop_text = gen.tokenizer.decode(continuation[:3])
    per_sample = BatchedDataDict({**prompts, "stop_strings": [[stop_text], None, None, None]})
    by_string = gen.generate(per_sample, greedy=True, sampling={"max_new_tokens": 6})
    n = int(by_string["generation_lengths"][0])
    assert n <= 3 and not bool(by_string["truncated"][0])
    assert stop_text in gen.tokenizer.decode(by_string["output_ids"][0, first_len : first_len + n].tolist())
    assert by_string["generation_lengths"][1:].tolist() == [6, 6, 6]  # only sample 0 had the stop string

    short = _worker(tiny_model_dir, max_total_sequence_length=14)
    capped = short.generate(prompts, greedy=True)
    assert capped["unpadded_sequence_lengths"].tolist() == [14] * 4
    assert bool(capped["truncated"].all())
    first_too_long = int((prompts["input_lengths"] > 6).nonzero()[0, 0])
    expected = f"prompt at index {first_too_long} has {int(prompts['input_lengths'][first_too_long])} tokens"
    with pytest.raises(ValueError, match=f"{expected}, more than max_total_sequence_length=6"):
        _worker(tiny_model_dir, max_total_sequence_length=6).generate(prompts)


def test_sampling_is_seeded(tiny_model_dir, prompts):
    a = _worker(tiny_model_dir, seed=5).generate(prompts, sampling={"max_new_tokens": 10})
    b = _worker(tiny_model_dir, seed=5).generate(prompts, sampling={"max_new_tokens": 10})
    c = _worker(tiny_model_dir, seed=6).generate(prompts, sampling={"max_new_tokens": 10})
    assert torch.equal(a["output_ids"], b["output_ids"])
    assert not torch.equal(a["output_ids"], c["output_ids"])


def test_update_weights_changes_what_is_generated(tiny_model_dir, tiny_llama_tied_dir, prompts):
    gen = _worker(tiny_model_dir, temperature=0.9)
    source = load_plain_model(tiny_model_dir)
    with torch.no_grad():
        for param in source.parameters():
            param.add_(0.05 * torch.randn_like(param))
    weights = {name: p.detach().clone() for name, p in source.named_parameters()}
    assert gen.update_weights(weights)
    out = gen.generate(prompts, sampling={"max_new_tokens": 10})
    train = plain_logprobs(source, out["output_ids"], out["unpadded_sequence_lengths"], temperature=0.9)
    assert mean_token_mult_prob_error(out["logprobs"], train, _generated_mask(out)) <= 1.001
    with pytest.raises(KeyError, match="unknown parameter"):
        gen.update_weights({"not.a.param": torch.zeros(1)})


def test_missing_model_gives_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a local directory nor reachable"):
        _worker(tmp_path / "absent")
