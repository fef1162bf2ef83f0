"""`Logger`: one `log_metrics` call fans out to every enabled backend."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from pydantic import BaseModel

from rl_core.config import save_config, to_plain
from rl_core.logging.base import LoggerBackend, MetricRecord
from rl_core.logging.config import LoggerConfig
from rl_core.logging.console import ConsoleBackend
from rl_core.logging.jsonl import JsonlBackend
from rl_core.logging.plot import plot_metrics
from rl_core.logging.trackers import MlflowBackend, TensorBoardBackend, WandbBackend

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"


class Logger:
    """Metrics to `log_dir/metrics.jsonl` (always) and the console/TensorBoard/W&B/MLflow
    backends enabled in `cfg`. Use as a context manager, or call `close()`."""

    def __init__(
        self,
        cfg: LoggerConfig,
        total_steps: int | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        stream: TextIO | None = None,
    ) -> None:
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = JsonlBackend(self.log_dir / METRICS_FILE)
        self.console: ConsoleBackend | None = None
        self.tensorboard: TensorBoardBackend | None = None
        self.wandb: WandbBackend | None = None
        self.mlflow: MlflowBackend | None = None
        self.backends: list[LoggerBackend] = [self.jsonl]
        self._closed = False
        try:
            if cfg.console:
                self.console = ConsoleBackend(
                    total_steps, cfg.console_every_n_steps, cfg.console_metrics, stream, clock
                )
                self.backends.append(self.console)
            if cfg.tensorboard:
                self.tensorboard = TensorBoardBackend(self.log_dir / "tensorboard")
                self.backends.append(self.tensorboard)
            if cfg.wandb:
                self.wandb = WandbBackend(self.log_dir, cfg.wandb_project, cfg.wandb_name, cfg.wandb_mode)
                self.backends.append(self.wandb)
            if cfg.mlflow:
                uri = cfg.mlflow_tracking_uri or (self.log_dir / "mlruns").resolve().as_uri()
                self.mlflow = MlflowBackend(uri, cfg.mlflow_experiment_name, cfg.mlflow_run_name)
                self.backends.append(self.mlflow)
        except BaseException:
            self.close()
            raise

    @property
    def metrics_path(self) -> Path:
        return self.jsonl.path

    def log_metrics(self, metrics: Mapping[str, Any], step: int, prefix: str = "train") -> None:
        """Log one step's metrics (floats, ints, 1-element tensors/arrays; lists and strings go
        to the JSONL file only) under `<prefix>/<name>`."""
        record = MetricRecord.build(metrics, step, prefix, time.time())
        for backend in self.backends:
            backend.log_metrics(record)

    def log_hyperparams(self, cfg: Mapping[str, Any] | BaseModel) -> Path:
        """Write `log_dir/config.yaml` and hand the config to every backend; returns the file."""
        plain = to_plain(cfg)
        path = save_config(plain, self.log_dir / CONFIG_FILE)
        for backend in self.backends:
            backend.log_hyperparams(plain)
        return path

    def log_plot(self, keys: Sequence[str], name: str | None = None, title: str | None = None) -> Path:
        """Plot metrics logged so far to `log_dir/plots/<name>.png` (name defaults to the keys)."""
        stem = name or re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(keys))
        return plot_metrics(self.metrics_path, keys, self.log_dir / "plots" / f"{stem}.png", title)

    def close(self) -> None:
        """Close every backend (even if one fails; the first error is re-raised)."""
        if self._closed:
            return
        self._closed = True
        first_error: BaseException | None = None
        for backend in reversed(self.backends):
            try:
                backend.close()
            except Exception as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def __enter__(self) -> Logger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
