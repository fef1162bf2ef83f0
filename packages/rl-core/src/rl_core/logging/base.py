"""The backend interface and the normalised form of one `log_metrics` call."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RESERVED_KEYS = ("step", "prefix", "time")


@dataclass(frozen=True)
class MetricRecord:
    """One `log_metrics` call: every value in plain Python form, plus the scalar subset."""

    step: int
    prefix: str
    time: float  # seconds since the epoch
    values: dict[str, Any]  # "<prefix>/<name>" -> scalar, list, string, ... (JSONL keeps all)
    scalars: dict[str, float]  # "<prefix>/<name>" -> float, for backends that plot numbers

    @classmethod
    def build(cls, metrics: Mapping[str, Any], step: int, prefix: str, time: float) -> MetricRecord:
        values: dict[str, Any] = {}
        scalars: dict[str, float] = {}
        for name, raw in metrics.items():
            key = f"{prefix}/{name}" if prefix else str(name)
            if key in RESERVED_KEYS:
                raise ValueError(f"metric name '{key}' is reserved; log it under a prefix")
            value = to_python(raw)
            values[key] = value
            if isinstance(value, bool | int | float):
                scalars[key] = float(value)
        return cls(step=step, prefix=prefix, time=time, values=values, scalars=scalars)


def to_python(value: Any) -> Any:
    """Tensors/arrays with one element -> Python scalar; larger ones -> nested lists."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if callable(getattr(value, "detach", None)):  # torch.Tensor, without importing torch
        value = value.detach().cpu()
    if callable(getattr(value, "tolist", None)):
        numel = getattr(value, "numel", None)
        size = numel() if callable(numel) else getattr(value, "size", None)
        if size == 1 and callable(getattr(value, "item", None)):
            return value.item()
        return value.tolist()
    if isinstance(value, Mapping):
        return {str(k): to_python(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_python(v) for v in value]
    return value


def json_safe(value: Any) -> Any:
    """Non-finite floats become the strings "NaN"/"Infinity"/"-Infinity" (strict JSON has
    no such numbers; `float()` reads these strings back); unknown objects become str()."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return str(value)


def flatten(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}` (for backends whose parameters are flat)."""
    flat: dict[str, Any] = {}
    for key, value in cfg.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name))
        else:
            flat[name] = value
    return flat


class LoggerBackend(ABC):
    """One destination for metrics (console, file, experiment tracker)."""

    @abstractmethod
    def log_metrics(self, record: MetricRecord) -> None: ...

    def log_hyperparams(self, cfg: Mapping[str, Any]) -> None:  # noqa: B027 - optional for backends
        """Record the run's configuration (plain, nested); default: nothing to do."""

    def close(self) -> None:  # noqa: B027 - optional for backends
        """Flush and release resources; called once."""
