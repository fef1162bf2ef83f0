"""Full (unsharded) weights out of a sharded model: refit buckets, HF export, reference copy."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PretrainedConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from rl_core.interfaces import WeightBucket
from rl_core.policy.refit import plan_buckets, refit_info


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on this rank (a collective for DTensors: every rank must call it)."""
    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return tensor


def gather_weights(model: nn.Module, names: list[str], device: torch.device | str = "cpu") -> WeightBucket:
    """Full copies of the named parameters on `device` (collective over the model's meshes)."""
    params = dict(model.named_parameters())
    missing = [name for name in names if name not in params]
    if missing:
        raise KeyError(f"the model has no parameter(s) {missing}")
    return {name: full_tensor(params[name].detach()).to(device, copy=True) for name in names}


def stream_weights(
    model: nn.Module, bucket_size_bytes: int, device: torch.device | str = "cpu"
) -> Iterator[WeightBucket]:
    """Yield all parameters, unsharded, in buckets of at most `bucket_size_bytes` (see `plan_buckets`)."""
    for names in plan_buckets(refit_info(model), bucket_size_bytes):
        yield gather_weights(model, names, device)


def load_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy full tensors into a plain (unsharded) model's parameters by name, in place."""
    params = dict(model.named_parameters())
    unknown = [name for name in weights if name not in params]
    if unknown:
        raise KeyError(f"weights for unknown parameter(s) {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    with torch.no_grad():
        for name, tensor in weights.items():
            target = params[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"parameter {name}: shape {tuple(tensor.shape)} != model's {tuple(target.shape)}"
                )
            target.copy_(tensor)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU, on rank 0 only (other ranks get {}); a collective."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}


def save_hf_directory(
    config: PretrainedConfig,
    state_dict: Mapping[str, torch.Tensor],
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Path:
    """Write a Hugging Face model directory (safetensors + config [+ tokenizer]).

    The model is materialised on the meta device and the given tensors are assigned to it, so
    no second copy of the weights is allocated.
    """
    with torch.device("meta"):
        model = _auto_class(config).from_config(config)
    result = model.load_state_dict(dict(state_dict), strict=False, assign=True)
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    missing = [key for key in result.missing_keys if key not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"state dict does not match {type(model).__name__}: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def _auto_class(config: PretrainedConfig) -> Any:
    """The Auto class that rebuilds the architecture the config names (causal LM by default)."""
    architectures = getattr(config, "architectures", None) or []
    if any(name.endswith("ForSequenceClassification") for name in architectures):
        return AutoModelForSequenceClassification
    return AutoModelForCausalLM


class ReferenceWeights:
    """A frozen CPU copy of a (possibly sharded) model's weights, swapped in when needed.

    Each rank keeps only its own shards. Swapping copies the current weights aside to CPU,
    loads the reference, and restores the current weights afterwards.
    """

    def __init__(self, model: nn.Module) -> None:
        self._state = self._cpu_copy(model)

    @staticmethod
    def _cpu_copy(model: nn.Module) -> dict[str, torch.Tensor]:
        return {key: value.detach().to("cpu", copy=True) for key, value in model.state_dict().items()}

    @contextmanager
    def swapped_in(self, model: nn.Module) -> Iterator[None]:
        current = self._cpu_copy(model)
        model.load_state_dict(self._state)
        try:
            yield
        finally:
            model.load_state_dict(current)
