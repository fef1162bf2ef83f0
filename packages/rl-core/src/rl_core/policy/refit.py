"""Planning the transfer of full weights from a policy to a generation engine."""

from __future__ import annotations

import torch
from torch import nn

RefitInfo = dict[str, tuple[tuple[int, ...], str]]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def refit_info(model: nn.Module) -> RefitInfo:
    """Name -> (full shape, dtype name) of every parameter, in `named_parameters` order.

    Tied parameters appear once, under their first name (how HF / vLLM loaders expect them).
    """
    return {name: (tuple(param.shape), dtype_name(param.dtype)) for name, param in model.named_parameters()}


def tensor_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * getattr(torch, dtype).itemsize


def plan_buckets(info: RefitInfo, bucket_size_bytes: int) -> list[list[str]]:
    """Consecutive groups of parameter names of at most `bucket_size_bytes` each.

    A parameter larger than the bound gets a bucket of its own (tensors are never split).
    """
    if bucket_size_bytes < 1:
        raise ValueError(f"bucket_size_bytes must be positive, got {bucket_size_bytes}")
    buckets: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, (shape, dtype) in info.items():
        size = tensor_nbytes(shape, dtype)
        if current and current_bytes + size > bucket_size_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets
