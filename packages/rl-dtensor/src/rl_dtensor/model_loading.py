"""Loading a Hugging Face causal LM and its tokenizer from a local directory or a hub id."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase


class ModelLoadError(ValueError):
    """A model or tokenizer could not be found or loaded; the message names it."""


def _from_pretrained(what: str, name: str, loader: Any, **kwargs: Any) -> Any:
    """Call a `from_pretrained` loader on a local directory or a hub id, with a clear error.

    A name that is not a directory is tried as a hub id (the real hub code path; it fails
    quickly when `HF_HUB_OFFLINE=1` or the hub is unreachable).
    """
    path = Path(name).expanduser()
    if path.is_dir():
        return loader(str(path), **kwargs)
    if path.exists():
        raise ModelLoadError(f"{what} {name!r} is a file, not a model directory or a hub id")
    try:
        return loader(name, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"{what} {name!r} is neither a local directory nor reachable on the Hugging Face hub: {exc}"
        ) from exc


def load_config(name: str) -> PretrainedConfig:
    config: PretrainedConfig = _from_pretrained("model", name, AutoConfig.from_pretrained)
    return config


def flash_attention_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def choose_attn_implementation(requested: str | None, packing: bool) -> str:
    """The attention kernel: as requested, else varlen FlashAttention for packed GPU batches
    when installed, else PyTorch SDPA (which takes the dense block-diagonal mask on CPU)."""
    if requested is not None:
        if requested == "flash_attention_2" and not flash_attention_available():
            raise ModelLoadError(
                "attn_implementation='flash_attention_2' needs CUDA and the flash_attn package"
            )
        return requested
    if packing and flash_attention_available():
        return "flash_attention_2"
    return "sdpa"


def load_causal_lm(
    name: str, dtype: torch.dtype, attn_implementation: str = "sdpa", device: torch.device | str = "cpu"
) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained(name)` in `dtype` on `device`."""
    model: PreTrainedModel = _from_pretrained(
        "model",
        name,
        AutoModelForCausalLM.from_pretrained,
        dtype=dtype,
        attn_implementation=attn_implementation,
    )
    move_module(model, device)
    return model


def load_sequence_classifier(
    name: str,
    dtype: torch.dtype,
    num_labels: int,
    pad_token_id: int,
    attn_implementation: str = "sdpa",
    device: torch.device | str = "cpu",
) -> PreTrainedModel:
    """`AutoModelForSequenceClassification.from_pretrained(name, num_labels=...)`.

    From a causal-LM checkpoint the backbone is loaded and the `num_labels`-way head is freshly
    initialised (from torch's global RNG, so equally seeded ranks agree). `pad_token_id` is set
    on the config because Hugging Face's pooling refuses batches without one.
    """
    model: PreTrainedModel = _from_pretrained(
        "model",
        name,
        AutoModelForSequenceClassification.from_pretrained,
        dtype=dtype,
        attn_implementation=attn_implementation,
        num_labels=num_labels,
    )
    model.config.pad_token_id = pad_token_id
    move_module(model, device)
    return model


def move_module(module: nn.Module, device: torch.device | str) -> None:
    """`module.to(device)` in place (typed as a plain module: transformers wraps `.to`)."""
    module.to(device)


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The tokenizer at `name`; one without a pad token pads with its eos token."""
    tokenizer: PreTrainedTokenizerBase = _from_pretrained("tokenizer", name, AutoTokenizer.from_pretrained)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
