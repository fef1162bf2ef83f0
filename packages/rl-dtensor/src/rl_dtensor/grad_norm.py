"""Gradient clipping over a mix of plain tensors and DTensors on different meshes.

`torch.nn.utils.clip_grad_norm_` stacks per-parameter norms, which fails when FSDP2 + TP put
parameters on different meshes (2-d `dp x tp` for tensor-parallel weights, 1-d `dp` for the
rest). Here gradients are grouped by (mesh, placements): each group's norm is one DTensor
reduction, so the total norm is exact and costs one collective per group.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def _group_key(grad: torch.Tensor) -> object:
    if isinstance(grad, DTensor):
        return (id(grad.device_mesh), grad.placements)
    return ("local", grad.device, grad.dtype)


def _grouped_params(parameters: Iterable[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """Parameters with a gradient, grouped by where (and how) their gradients live."""
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for param in parameters:
        if param.grad is not None:
            groups.setdefault(_group_key(param.grad), []).append(param)
    return list(groups.values())


def total_grad_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of all gradients (float32 scalar on the gradients' device)."""
    squares: list[torch.Tensor] = []
    for group in _grouped_params(parameters):
        grads = [p.grad for p in group if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float().pow(2))
    if not squares:
        return torch.zeros(())
    device = squares[0].device
    return torch.stack([s.to(device) for s in squares]).sum().sqrt()


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm` (None: no clipping).

    Returns the norm before clipping.
    """
    params = [p for p in parameters if p.grad is not None]
    norm = total_grad_norm(params)
    if max_norm is not None:
        for group in _grouped_params(params):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm
