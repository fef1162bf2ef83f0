"""One vLLM engine over two tensor-parallel ranks (two Ray workers running as SPMD peers, gloo on
CPU): greedy output equals plain Hugging Face decoding, before and after a refit whose full
tensors each rank shards for itself."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import generated_rows, greedy_continuation, load_model, right_padded
from safetensors.torch import load_file
from transformers import AutoTokenizer

from rl_core.distributed import RayVirtualCluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MAX_NEW = 10


@pytest.fixture(scope="module")
def tp_engine(ray_cluster: None, vllm_venv: str, vllm_model_dir: Path) -> Iterator[Any]:
    from rl_vllm.generation import VllmGeneration

    cluster = RayVirtualCluster([2], use_gpus=False, name="vllm-tp-test")
    config = {
        "model_name": str(vllm_model_dir),
        "max_total_sequence_length": 40,
        "max_new_tokens": MAX_NEW,
        "tensor_parallel_size": 2,
    }
    engine = VllmGeneration(cluster, config, name_prefix="vllm-tp-test", env_vars={"OMP_NUM_THREADS": "1"})
    yield engine
    engine.shutdown()
    cluster.shutdown()


def test_tensor_parallel_engine_generates_and_refits_like_hugging_face(
    tp_engine: Any, vllm_model_dir: Path, tmp_path: Path
) -> None:
    assert tp_engine.dp_size == 1
    assert [(i["dp_rank"], i["tp_rank"]) for i in tp_engine.engine_info] == [(0, 0), (0, 1)]
    tokenizer = AutoTokenizer.from_pretrained(str(vllm_model_dir))
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 4 + 4?", "Q: 17 + 5 = ? A:", "Compute")]
    data = right_padded(prompts, tokenizer.pad_token_id)
    model = load_model(vllm_model_dir)
    stop_ids = {tokenizer.eos_token_id}
    expected = [greedy_continuation(model, p, MAX_NEW, stop_ids) for p in prompts]
    assert generated_rows(tp_engine.generate(data, greedy=True)) == expected

    # New weights, full tensors in small buckets: each rank takes its slice of q/k/v, gate/up,
    # o and down projections.
    generator = torch.Generator().manual_seed(5)
    weights = {
        name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in load_file(str(vllm_model_dir / "model.safetensors")).items()
    }
    names = sorted(weights)
    tp_engine.update_weights([{n: weights[n] for n in names[i : i + 4]} for i in range(0, len(names), 4)])
    tp_engine.invalidate_kv_cache()
    model.load_state_dict(weights)
    expected = [greedy_continuation(model, p, MAX_NEW, stop_ids) for p in prompts]
    assert generated_rows(tp_engine.generate(data, greedy=True)) == expected
