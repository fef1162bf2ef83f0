"""vLLM generation on CPU with real Ray: two data-parallel synchronous engines in their own venv,
checked against a plain Hugging Face model and the DTensor policy; refit from the trained policy
through the object store and through a (gloo) broadcast group; the driver never imports vLLM."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from hf_reference import (
    generated_mask,
    generated_rows,
    greedy_continuation,
    load_model,
    right_padded,
    sequence_logprobs,
    token_mult_prob_error,
)
from safetensors.torch import load_file
from transformers import AutoTokenizer

from rl_core.data import BatchedDataDict
from rl_core.distributed import RayVirtualCluster
from rl_core.distributed.worker_group import WorkerGroupError

pytestmark = pytest.mark.ray

MAX_TOTAL = 48
MAX_NEW = 12
TEMPERATURE = 0.7
TEXTS = (
    "What is 12 + 7? The answer is",
    "Compute 5 plus 9. Answer:",
    "Q: 100 + 23 = ? A:",
    "If you have 3 apples and get 4 more, you have",
    "The answer",
)


@pytest.fixture(scope="module")
def tokenizer(vllm_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(vllm_model_dir))


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    return [tokenizer(text)["input_ids"] for text in TEXTS]


@pytest.fixture(scope="module")
def hf_model(vllm_model_dir: Path) -> torch.nn.Module:
    return load_model(vllm_model_dir)


@pytest.fixture(scope="module")
def stop_token(hf_model: torch.nn.Module, tokenizer: Any, prompts: list[list[int]]) -> int:
    """A configured stop token: the 4th token the model continues the first prompt with."""
    reference = greedy_continuation(hf_model, prompts[0], MAX_NEW, {tokenizer.eos_token_id})
    assert len(reference) >= 5 and reference[3] != tokenizer.eos_token_id, reference
    return reference[3]


@pytest.fixture(scope="module")
def stop_ids(tokenizer: Any, stop_token: int) -> set[int]:
    return {tokenizer.eos_token_id, stop_token}


@pytest.fixture(scope="module")
def generation(ray_cluster: None, vllm_venv: str, vllm_model_dir: Path, stop_token: int) -> Iterator[Any]:
    """Two vLLM engines (data parallel, one CPU bundle each)."""
    from rl_vllm.generation import VllmGeneration

    cluster = RayVirtualCluster([2], use_gpus=False, name="vllm-test")
    config = {
        "model_name": str(vllm_model_dir),
        "max_total_sequence_length": MAX_TOTAL,
        "max_new_tokens": MAX_NEW,
        "temperature": TEMPERATURE,
        "stop_token_ids": [stop_token],
        "seed": 3,
    }
    engines = VllmGeneration(cluster, config, name_prefix="vllm-test", env_vars={"OMP_NUM_THREADS": "1"})
    yield engines
    engines.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def policy(ray_cluster: None, vllm_model_dir: Path, stop_token: int) -> Iterator[Any]:
    """The DTensor policy on the same weights, sampling at the same temperature."""
    from rl_algos.backends import make_policy

    cluster = RayVirtualCluster([1], use_gpus=False, name="vllm-test-policy")
    config = {
        "model_name": str(vllm_model_dir),
        "max_total_sequence_length": MAX_TOTAL,
        "train_global_batch_size": 5,
        "train_micro_batch_size": 5,
        "logprob_batch_size": 8,
        "generation": {"temperature": TEMPERATURE, "max_new_tokens": MAX_NEW, "stop_token_ids": [stop_token]},
        "optimizer": {"name": "sgd", "kwargs": {"lr": 1.0}},
        "max_grad_norm": 1.0,
        "reference_model": False,
    }
    trained = make_policy(cluster, config, name_prefix="vllm-test-policy")
    yield trained
    trained.shutdown()
    cluster.shutdown()


def test_engines_run_in_the_vllm_venv(generation: Any, vllm_venv: str) -> None:
    venv_prefix = str(Path(vllm_venv).parent.parent)
    assert venv_prefix != sys.prefix
    assert [info["prefix"] for info in generation.engine_info] == [venv_prefix, venv_prefix]
    assert [(info["dp_rank"], info["tp_rank"]) for info in generation.engine_info] == [(0, 0), (1, 0)]
    assert all(info["vllm_version"] for info in generation.engine_info)
    assert len({info["pid"] for info in generation.engine_info}) == 2


def test_greedy_matches_hugging_face_in_input_order(
    generation: Any,
    hf_model: torch.nn.Module,
    tokenizer: Any,
    prompts: list[list[int]],
    stop_token: int,
    stop_ids: set[int],
) -> None:
    data = right_padded(prompts, tokenizer.pad_token_id)
    out = generation.generate(data, greedy=True)
    assert out.size == len(prompts)  # 3 rows on engine 0, 2 on engine 1
    generated = generated_rows(out)
    # The configured stop token ends the first row early (and is kept).
    assert generated[0][-1] == stop_token and len(generated[0]) <= 4 and not bool(out["truncated"][0])
    for row, prompt in enumerate(prompts):
        expected = greedy_continuation(hf_model, prompt, MAX_NEW, stop_ids)
        assert generated[row] == expected, f"row {row}"
        length = int(out["unpadded_sequence_lengths"][row])
        assert length == len(prompt) + len(expected)
        assert out["output_ids"][row, : len(prompt)].tolist() == prompt
        assert out["output_ids"][row, length:].eq(tokenizer.pad_token_id).all()
        assert bool(out["truncated"][row]) == (expected[-1] not in stop_ids and len(expected) == MAX_NEW)
    mask = generated_mask(out)
    assert out["logprobs"][~mask].eq(0).all()
    assert out["logprobs"][mask].lt(0).all()


def test_sampled_logprobs_match_the_dtensor_policy(
    generation: Any, policy: Any, hf_model: torch.nn.Module, tokenizer: Any, prompts: list[list[int]]
) -> None:
    data = right_padded(prompts * 2, tokenizer.pad_token_id)
    out = generation.generate(data, greedy=False)
    mask = generated_mask(out)
    assert int(mask.sum()) >= 10
    training = policy.get_logprobs(
        BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
    )["logprobs"]
    error = token_mult_prob_error(out["logprobs"], training, mask)
    sys.stderr.write(f"\n[vllm tests] token_mult_prob_error vLLM vs DTensor policy: {error:.7f}\n")
    assert error <= 1.01
    # The bound has teeth: the untempered model's log-probs of the same tokens are far off.
    untempered = torch.zeros_like(out["logprobs"])
    for row in range(out.size):
        sequence = out["output_ids"][row, : int(out["unpadded_sequence_lengths"][row])].tolist()
        untempered[row, 1 : len(sequence)] = torch.tensor(sequence_logprobs(hf_model, sequence, 1.0))
    assert token_mult_prob_error(out["logprobs"], untempered, mask) > 1.05


def test_stop_strings_and_a_full_context(
    generation: Any, hf_model: torch.nn.Module, tokenizer: Any, prompts: list[list[int]], stop_ids: set[int]
) -> None:
    references = [greedy_continuation(hf_model, p, MAX_NEW, stop_ids) for p in prompts]
    longest = max(range(len(prompts)), key=lambda row: len(references[row]))
    reference = references[longest]
    # A stop string from the middle of that continuation (a printable token's text): generation
    # stops at the token that completes its first occurrence, and keeps it.
    texts = [tokenizer.decode([token]) for token in reference[1:-1]]
    candidates = [text for text in texts if text.isascii() and text.strip()]
    assert candidates, f"no printable token in the middle of the reference {reference} to stop at"
    stop = candidates[0]
    cut = next(k for k in range(1, len(reference) + 1) if stop in tokenizer.decode(reference[:k]))
    assert cut < len(reference)
    other = (longest + 1) % len(prompts)
    full_context = (prompts[1] * MAX_TOTAL)[:MAX_TOTAL]
    data = right_padded([prompts[longest], prompts[other], full_context], tokenizer.pad_token_id)
    data["stop_strings"] = [[stop], None, None]
    out = generation.generate(data, greedy=True)
    generated = generated_rows(out)
    assert generated[0] == reference[:cut] and not bool(out["truncated"][0])
    assert generated[1] == references[other]
    # A prompt that fills the context generates nothing and counts as cut by the length limit.
    assert generated[2] == [] and bool(out["truncated"][2])
    assert int(out["unpadded_sequence_lengths"][2]) == MAX_TOTAL
    with pytest.raises(
        WorkerGroupError, match="prompt at index 0 has 49 tokens, more than max_total_sequence_length=48"
    ):
        generation.generate(right_padded([[*full_context, 5]], tokenizer.pad_token_id), greedy=True)


def _nll_batch(tokenizer: Any) -> BatchedDataDict:
    """A batch to train on: the policy learns to continue every text with ' 42 42 42 ...'."""
    rows = [tokenizer(text + " 42 42 42 42 42 42")["input_ids"] for text in TEXTS]
    data = right_padded(rows, tokenizer.pad_token_id)
    data["token_mask"] = (
        torch.arange(data["input_ids"].shape[1])[None, :] < data["input_lengths"][:, None]
    ).long()
    data["sample_mask"] = torch.ones(len(rows))
    return data


def test_refit_after_training_matches_the_policy(
    generation: Any, policy: Any, tokenizer: Any, prompts: list[list[int]]
) -> None:
    from rl_algos.losses import NLLLossFn

    data = right_padded(prompts, tokenizer.pad_token_id)
    before = generated_rows(generation.generate(data, greedy=True))
    for _ in range(3):
        policy.train(_nll_batch(tokenizer), NLLLossFn())
    trained = generated_rows(policy.generate(data, greedy=True))
    assert trained != before, "training must change the greedy outputs for this test to mean anything"

    # Small buckets: the fused q/k/v and gate/up projections straddle bucket boundaries.
    generation.update_weights(policy.stream_weights(16 * 1024))
    generation.invalidate_kv_cache()
    metrics = generation.last_refit_metrics
    num_params = len(policy.prepare_refit_info())
    assert metrics["refit_tensors"] == num_params and metrics["refit_buckets"] > 3
    assert metrics["refit_time_s"] > 0
    sys.stderr.write(f"\n[vllm tests] refit of {num_params} tensors: {metrics}\n")
    assert generated_rows(generation.generate(data, greedy=True)) == trained


def test_broadcast_refit_restores_the_initial_weights(
    generation: Any,
    vllm_model_dir: Path,
    hf_model: torch.nn.Module,
    tokenizer: Any,
    prompts: list[list[int]],
    stop_ids: set[int],
) -> None:
    """The non-colocated path: the weights go over a process group of their own (gloo here,
    NCCL on GPUs) from a sender (this process) to every engine rank."""
    from rl_vllm.refit import WeightBroadcastGroup
    from rl_vllm.worker import free_address

    initial = load_file(str(vllm_model_dir / "model.safetensors"))
    names = sorted(initial)
    buckets = [{name: initial[name] for name in names[i : i + 7]} for i in range(0, len(names), 7)]
    address, port = free_address()
    generation.start_weight_update()
    joins = generation.init_weight_broadcast(address, port, backend="gloo")
    sender = WeightBroadcastGroup(address, port, 0, generation.broadcast_world_size, backend="gloo")
    ray.get(joins)
    for bucket in buckets:
        receiving = generation.receive_weight_broadcast(WeightBroadcastGroup.layout_of(bucket))
        sender.send(bucket)
        assert ray.get(receiving) == [len(bucket)] * 2
    assert generation.finish_weight_update() == len(names)
    generation.invalidate_kv_cache()
    out = generation.generate(right_padded(prompts, tokenizer.pad_token_id), greedy=True)
    expected = [greedy_continuation(hf_model, p, MAX_NEW, stop_ids) for p in prompts]
    assert generated_rows(out) == expected


def test_the_driver_never_imported_vllm(generation: Any) -> None:
    # Runs last in this module: after generation, sampling and both refit paths (run alone, it
    # still follows the engines' start-up).
    assert generation.engine_info and "vllm" not in sys.modules
    assert not [name for name in sys.modules if name.startswith("vllm.")]
