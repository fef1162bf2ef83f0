"""Optimisers and learning-rate schedules chosen by name from the config."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}

SCHEDULERS: tuple[str, ...] = ("constant", "linear", "cosine")


def check_optimizer_name(name: str) -> str:
    """`name` if it is a known optimiser, else a ValueError that lists the valid names."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer name {name!r}; valid names: {', '.join(sorted(OPTIMIZERS))}")
    return name


def check_scheduler_name(name: str) -> str:
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler name {name!r}; valid names: {', '.join(SCHEDULERS)}")
    return name


def build_optimizer(
    name: str, params: Iterable[torch.nn.Parameter], kwargs: dict[str, Any]
) -> torch.optim.Optimizer:
    """The optimiser `name` over `params`; a bad keyword names the optimiser and the keyword."""
    cls = OPTIMIZERS[check_optimizer_name(name)]
    try:
        return cls(params, **kwargs)
    except TypeError as exc:
        raise ValueError(
            f"optimizer {name!r} ({cls.__name__}) rejected optimizer.kwargs {kwargs}: {exc}"
        ) from exc


def lr_multiplier(
    name: str, warmup_steps: int, total_steps: int | None, min_lr_ratio: float
) -> Callable[[int], float]:
    """Step -> factor on the base learning rate: linear warm-up, then the named decay.

    `linear` and `cosine` decay from 1 to `min_lr_ratio` over `total_steps - warmup_steps`
    steps and stay there; `constant` stays at 1 after the warm-up.
    """
    check_scheduler_name(name)
    if name != "constant" and total_steps is None:
        raise ValueError(f"scheduler {name!r} needs scheduler.total_steps")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if name == "constant":
            return 1.0
        assert total_steps is not None
        decay_steps = max(total_steps - warmup_steps, 1)
        progress = min((step - warmup_steps) / decay_steps, 1.0)
        if name == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    name: str,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_multiplier(name, warmup_steps, total_steps, min_lr_ratio)
    )
