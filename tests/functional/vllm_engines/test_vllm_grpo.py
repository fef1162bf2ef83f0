"""GRPO with `policy.generation.backend=vllm` on CPU, end to end: the packaged tiny recipe (math
environment, DTensor policy) on a local tiny model, with vLLM's asynchronous engine doing the
rollouts, refitted from the policy before every step. Then the same engine streams samples back
in the order they finish."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import generated_rows, right_padded
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_algos.cli import packaged_recipe
from rl_algos.grpo import GRPOMasterConfig, GRPORun, grpo_train, setup
from rl_algos.training import shutdown_run
from rl_core.config import load_validated_config

pytestmark = pytest.mark.ray

HEALTH_KEYS = (
    "train/token_mult_prob_error",
    "train/gen_kl_error",
    "train/timing/refit",
    "train/timing/generation",
    "train/reward",
    "train/mean_response_length",
)


def eos_prone_model(model_dir: Path, out_dir: Path) -> Path:
    """A copy of the tiny random model whose eos logit is scaled up: eos then wins wherever its
    (random) direction agrees with the hidden state, so sampled responses end at varied lengths
    and the overlong shaping below gives GRPO non-zero advantages from the first step."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= 40.0
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def vllm_recipe(root: Path, model_dir: Path) -> GRPOMasterConfig:
    """The packaged CPU recipe on a given model, shrunk; only `generation.*` selects vLLM."""
    overrides = [
        "policy.generation.backend=vllm",  # NeMo RL's spelling of generation.backend
        "generation.vllm.async_engine=true",
        "~base_model",
        f"policy.model_name={model_dir}",
        "data.train={source: arithmetic, num_samples: 64, levels: [1], seed: 1}",
        "data.validation=null",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.max_num_steps=2",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "grpo.reward_shaping={enabled: true, overlong_buffer_length: 12, max_response_length: 16}",
        "policy.max_total_sequence_length=96",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=16",
        "policy.generation.max_new_tokens=16",
        "policy.optimizer.kwargs={lr: 5.0e-4, weight_decay: 0.0}",
        f"logger.log_dir={root / 'logs'}",
        "logger.console=false",
        "checkpointing.enabled=false",
        "cluster.cpus_per_worker=1",
    ]
    return load_validated_config(packaged_recipe("grpo_tiny_cpu.yaml"), GRPOMasterConfig, overrides)


@pytest.fixture(scope="module")
def grpo(
    ray_cluster: None, vllm_venv: str, vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GRPORun]:
    root = tmp_path_factory.mktemp("grpo_vllm")
    run = setup(vllm_recipe(root, eos_prone_model(vllm_model_dir, root / "model")))
    yield run
    shutdown_run(run)


def test_two_grpo_steps_with_vllm_rollouts(grpo: GRPORun) -> None:
    from rl_vllm.generation import VllmGeneration

    assert isinstance(grpo.generation, VllmGeneration) and grpo.generation.cfg.async_engine
    assert grpo.generation.cfg.dtype == "float32"  # the policy's, since the recipe names none
    result = grpo_train(grpo)
    assert result.final_step == 2
    records = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    steps = {r["step"]: r for r in records if r["prefix"] == "train"}
    assert sorted(steps) == [1, 2]
    for step, metrics in steps.items():
        # vLLM's log-probs of the sampled tokens against the policy's, every step: both fp32,
        # same weights (refitted before each rollout), same temperature.
        assert 1.0 <= metrics["train/token_mult_prob_error"] <= 1.01, step
        assert abs(metrics["train/gen_kl_error"]) < 1e-3, step
        assert metrics["train/timing/refit"] > 0, step
        assert metrics["train/num_trained_samples"] == 16
        assert 0.0 <= metrics["train/reward"] <= 1.0
    # Step 1 moved the weights, so step 2's agreement shows the refit loaded the new ones. GRPO
    # teaches this model to stop early (the shaping penalises length); a gentle learning rate
    # keeps step 2's first tokens uncertain (not all eos at probability ~1), so the agreement
    # there is not trivially 1.
    assert steps[1]["train/advantage_abs_mean"] > 0 and steps[1]["train/grad_norm"] > 0
    assert steps[2]["train/mean_response_length"] > 1.0
    assert "vllm" not in sys.modules
    for step, metrics in steps.items():
        shown = {k.removeprefix("train/"): round(v, 7) for k, v in metrics.items() if k in HEALTH_KEYS}
        sys.stderr.write(f"\n[vllm tests] GRPO step {step}: {shown}\n")


async def _collect(generation: Any, data: Any) -> list[tuple[int, Any]]:
    return [item async for item in generation.generate_async(data, greedy=True)]


def test_generate_async_yields_samples_as_they_finish(grpo: GRPORun, vllm_model_dir: Path) -> None:
    generation = grpo.generation
    # Back to the plain random weights (GRPO taught the eos-prone model to stop at once), which
    # continue for many tokens: then budgets, not eos, decide which sample finishes first.
    generation.update_weights([load_file(str(vllm_model_dir / "model.safetensors"))])
    generation.invalidate_kv_cache()
    limit = grpo.cfg.policy.max_total_sequence_length
    text = grpo.tokenizer("What is 2 + 3? Compute it step by step. " * 8)["input_ids"]
    # Budgets min(16, limit - prompt length): 16, 2 and 7 new tokens.
    prompts = [text[:10], text[: limit - 2], text[: limit - 7]]
    data = right_padded(prompts, int(grpo.tokenizer.pad_token_id))
    whole = generation.generate(data, greedy=True)
    streamed = asyncio.run(_collect(generation, data))

    assert sorted(row for row, _ in streamed) == [0, 1, 2]
    by_row = [int(n) for n in whole["generation_lengths"]]
    assert by_row != sorted(by_row), f"lengths {by_row} in row order would not show the streaming order"
    # Continuous batching: samples come back as they finish, the ones with fewer tokens first.
    assert [int(out["generation_lengths"][0]) for _, out in streamed] == sorted(by_row)
    expected = generated_rows(whole)
    for row, out in streamed:
        assert generated_rows(out) == [expected[row]]
        assert out["output_ids"][0, : len(prompts[row])].tolist() == prompts[row]
