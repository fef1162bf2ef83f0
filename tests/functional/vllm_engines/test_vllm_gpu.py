"""The GPU refit paths (marked `gpu`, skipped without CUDA): CUDA IPC handles between processes on
one GPU, an NCCL weight broadcast between two GPUs, and a colocated vLLM engine that sleeps
between rollouts, wakes, and takes new weights through CUDA IPC from the trainer's process.

The engine test starts its own Ray cluster with the GPU, so run these on their own:
`pytest -m gpu tests/functional/vllm_engines/test_vllm_gpu.py`.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from hf_reference import generated_rows, greedy_continuation, load_model, right_padded
from safetensors.torch import load_file
from transformers import AutoTokenizer

from rl_vllm.refit import WeightBroadcastGroup, cuda_device_uuid, cuda_ipc_handles, tensors_from_ipc_handles

pytestmark = pytest.mark.gpu


def _as_lists(bucket: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {name: tensor.cpu().tolist() for name, tensor in bucket.items()}


def _ipc_receiver(handles: Any, results: Any) -> None:
    torch.cuda.set_device(0)
    results.put(_as_lists(tensors_from_ipc_handles(handles, torch.device("cuda", 0))))


def test_cuda_ipc_handles_map_the_senders_tensors_in_another_process() -> None:
    bucket = {"w": torch.randn(4, 3, device="cuda"), "ids": torch.arange(5, device="cuda")}
    handles = cuda_ipc_handles(bucket)
    assert list(handles) == [cuda_device_uuid(0)]
    context = mp.get_context("spawn")
    results = context.Queue()
    receiver = context.Process(target=_ipc_receiver, args=(handles, results))
    receiver.start()
    received = results.get(timeout=300)
    receiver.join(timeout=60)
    assert receiver.exitcode == 0
    assert received == _as_lists(bucket)  # `bucket` stayed alive until the receiver was done


def _nccl_receiver(port: int, layout: Any, results: Any) -> None:
    torch.cuda.set_device(1)
    group = WeightBroadcastGroup("127.0.0.1", port, 1, 2, backend="nccl", timeout_s=300)
    results.put(_as_lists(group.receive(layout, torch.device("cuda", 1))))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL broadcast needs two GPUs")
def test_nccl_weight_broadcast_between_two_gpus() -> None:
    torch.cuda.set_device(0)
    bucket = {"w": torch.randn(8, 8, device="cuda:0"), "b": torch.randn(8, device="cuda:0").half()}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    context = mp.get_context("spawn")
    results = context.Queue()
    receiver = context.Process(
        target=_nccl_receiver, args=(port, WeightBroadcastGroup.layout_of(bucket), results)
    )
    receiver.start()
    WeightBroadcastGroup("127.0.0.1", port, 0, 2, backend="nccl", timeout_s=300).send(bucket)
    received = results.get(timeout=300)
    receiver.join(timeout=60)
    assert receiver.exitcode == 0 and received == _as_lists(bucket)


@pytest.fixture(scope="module")
def gpu_ray() -> Iterator[None]:
    import ray

    from rl_core.distributed import init_ray

    if ray.is_initialized() and not ray.cluster_resources().get("GPU"):
        pytest.skip(
            "this session's Ray cluster has no GPU; run the gpu tests on their own (pytest -m gpu ...)"
        )
    init_ray(num_cpus=4, num_gpus=1)
    yield


@pytest.mark.ray
def test_colocated_engine_sleeps_wakes_and_refits_through_cuda_ipc(
    gpu_ray: None, vllm_venv: str, vllm_model_dir: Path
) -> None:
    from rl_core.distributed import RayVirtualCluster
    from rl_vllm.generation import VllmGeneration

    tokenizer = AutoTokenizer.from_pretrained(str(vllm_model_dir))
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 4 + 4?", "Q: 17 + 5 = ? A:")]
    data = right_padded(prompts, tokenizer.pad_token_id)
    cluster = RayVirtualCluster([1], use_gpus=True, num_gpus_per_node=1, name="vllm-gpu-test")
    engine = VllmGeneration(
        cluster,
        {
            "model_name": str(vllm_model_dir),
            "max_total_sequence_length": 40,
            "max_new_tokens": 8,
            "gpu_memory_utilization": 0.2,
            "colocated": True,
        },
        name_prefix="vllm-gpu-test",
    )
    try:
        model = load_model(vllm_model_dir)
        stop_ids = {tokenizer.eos_token_id}
        assert generated_rows(engine.generate(data, greedy=True)) == [
            greedy_continuation(model, p, 8, stop_ids) for p in prompts
        ]
        free_awake = torch.cuda.mem_get_info(0)[0]
        engine.finish_generation()  # asleep: weights offloaded, KV cache released
        assert torch.cuda.mem_get_info(0)[0] > free_awake
        engine.prepare_for_generation()

        # This process plays the colocated trainer: new weights on the same GPU, sent as handles.
        generator = torch.Generator().manual_seed(3)
        weights = {
            name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
            for name, tensor in load_file(str(vllm_model_dir / "model.safetensors")).items()
        }
        on_gpu = {name: tensor.to("cuda:0") for name, tensor in weights.items()}
        engine.update_weights_from_ipc_handles([cuda_ipc_handles(on_gpu)])
        engine.invalidate_kv_cache()
        assert engine.last_refit_metrics["refit_tensors"] == len(weights)
        model.load_state_dict(weights)
        assert generated_rows(engine.generate(data, greedy=True)) == [
            greedy_continuation(model, p, 8, stop_ids) for p in prompts
        ]
    finally:
        engine.shutdown()
        cluster.shutdown()
