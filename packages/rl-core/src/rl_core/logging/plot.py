"""Metric curves from a metrics.jsonl file (matplotlib, an optional extra)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from rl_core.logging.jsonl import read_metrics_jsonl
from rl_core.logging.optional import import_optional


def metric_series(jsonl_path: str | Path, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric key (e.g. "train/reward"), in file order."""
    steps: list[int] = []
    values: list[float] = []
    for record in read_metrics_jsonl(jsonl_path):
        value = record.get(key)
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int | float) or value in ("NaN", "Infinity", "-Infinity"):
            steps.append(int(record["step"]))
            values.append(float(value))
    return steps, values


def plot_metrics(
    jsonl_path: str | Path, keys: Sequence[str], out_png: str | Path, title: str | None = None
) -> Path:
    """Plot each metric against the step into one PNG; returns its path."""
    figure_module = import_optional("matplotlib.figure", "plot", "Plotting metrics")
    series = {key: metric_series(jsonl_path, key) for key in keys}
    missing = [key for key, (steps, _) in series.items() if not steps]
    if missing:
        raise ValueError(f"{jsonl_path}: no numeric values for metric(s) {missing}")
    # A bare Figure (no pyplot) needs no display and keeps no global state.
    figure = figure_module.Figure(figsize=(7, 4), dpi=100)
    axes = figure.add_subplot()
    for key, (steps, values) in series.items():
        axes.plot(steps, [v if math.isfinite(v) else math.nan for v in values], label=key)
    axes.set_xlabel("step")
    axes.set_title(title or ", ".join(keys))
    axes.grid(alpha=0.3)
    axes.legend()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    return out
