"""`Policy` (dtensor backend) and `WorkerGroupGeneration` of HF workers on real Ray actors (2 policy workers, dp=2; 1 generation
worker): sharding over the workers, refit of the generation backend from the policy's streamed
weights, and rollouts whose log-probs agree with the policy's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dtensor_testing import (
    TESTS_DIR,
    NLLLoss,
    load_plain_model,
    make_batch,
    max_param_diff,
    mean_token_mult_prob_error,
    plain_logprobs,
    plain_sgd_step,
    policy_config,
)
from transformers import AutoTokenizer

from rl_core.data import BatchedDataDict
from rl_core.distributed import RayVirtualCluster
from rl_core.policy import ColocatedGeneration, Policy, WorkerGroupGeneration

pytestmark = pytest.mark.ray

# The loss object is pickled by reference: the workers import it from this directory.
WORKER_ENV = {"PYTHONPATH": TESTS_DIR}


@pytest.fixture(scope="module")
def policy(ray_cluster: None, tiny_model_dir: Path) -> Iterator[Policy]:
    cluster = RayVirtualCluster([2], use_gpus=False, name="dtensor_policy_test")
    # Logprob micro-batches of 2 over uneven shards (5 rows: 3 + 2) exercise the idle forwards.
    policy = Policy(cluster, policy_config(tiny_model_dir, logprob_batch_size=2), env_vars=WORKER_ENV)
    yield policy
    policy.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def generation(ray_cluster: None, tiny_model_dir: Path) -> Iterator[WorkerGroupGeneration]:
    cluster = RayVirtualCluster([1], use_gpus=False, name="hf_generation_test")
    config = {"model_name": str(tiny_model_dir), "max_total_sequence_length": 64, "max_new_tokens": 10}
    generation = WorkerGroupGeneration(cluster, config, env_vars=WORKER_ENV)
    yield generation
    generation.shutdown()
    cluster.shutdown()


def _prompts(model_dir: Path) -> BatchedDataDict[Any]:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    encoded = tokenizer(
        ["What is 1 + 1?", "Q: 20 + 4", "Compute 7 plus 8."], padding=True, return_tensors="pt"
    )
    return BatchedDataDict(input_ids=encoded["input_ids"], input_lengths=encoded["attention_mask"].sum(-1))


def _check_rollout_logprobs(policy: Policy, out: BatchedDataDict[Any]) -> None:
    train = policy.get_logprobs(
        BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
    )["logprobs"]
    positions = torch.arange(out["output_ids"].shape[1])[None, :]
    total = out["unpadded_sequence_lengths"]
    mask = (positions >= (total - out["generation_lengths"])[:, None]) & (positions < total[:, None])
    assert int(mask.sum()) >= 3
    assert mean_token_mult_prob_error(out["logprobs"], train, mask) <= 1.001


def test_policy_logprobs_train_and_refit(policy, generation, tiny_model_dir):
    vocab = len(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    batch = make_batch(
        vocab, [20, 9, 14, 5, 18, 11, 7, 16], [3, 2, 4, 1, 5, 2, 2, 3], [1, 1, 0, 1, 1, 1, 1, 1], seed=7
    )

    uneven = batch.slice(0, 5)
    expected = plain_logprobs(load_plain_model(tiny_model_dir), uneven["input_ids"], uneven["input_lengths"])
    got = policy.get_logprobs(uneven)["logprobs"]
    assert float((got - expected).abs().max()) < 1e-5
    ref = policy.get_reference_policy_logprobs(uneven)["reference_logprobs"]
    assert float((ref - expected).abs().max()) < 1e-5

    ref_params, ref_loss, _ = plain_sgd_step(tiny_model_dir, batch, lr=1.0, max_grad_norm=None)
    metrics = policy.train(batch, NLLLoss())
    assert metrics["num_steps"] == 1
    assert metrics["loss"][0] == pytest.approx(ref_loss, abs=1e-6)
    streamed = {name: t for bucket in policy.stream_weights(50_000) for name, t in bucket.items()}
    assert max_param_diff(streamed, ref_params) < 1e-6
    assert set(policy.prepare_refit_info()) == set(streamed)

    # Refit the separate generation backend with the trained weights, then roll out.
    generation.prepare_for_generation()
    assert generation.update_weights(policy.stream_weights(50_000))
    out = generation.generate(_prompts(tiny_model_dir))
    generation.finish_generation()
    assert out["output_ids"].shape[0] == 3 and bool((out["generation_lengths"] <= 10).all())
    _check_rollout_logprobs(policy, out)


def test_colocated_generation_uses_the_policy_workers(policy, tiny_model_dir):
    colocated = ColocatedGeneration(policy)
    assert colocated.prepare_for_generation()
    out = colocated.generate(_prompts(tiny_model_dir))
    assert out["output_ids"].shape[0] == 3
    assert bool((out["generation_lengths"] >= 1).all())
    _check_rollout_logprobs(policy, out)
