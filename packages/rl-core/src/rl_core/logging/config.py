"""Settings of the metrics logger."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rl_core.config import RLConfig


class LoggerConfig(RLConfig):
    """Where metrics go. The JSONL file `log_dir/metrics.jsonl` is always written."""

    log_dir: str = "logs"
    console: bool = True
    console_every_n_steps: int = Field(default=1, ge=1)
    # Metrics shown on the console line, as full (`train/reward`) or bare (`reward`) names;
    # None shows every scalar of the call.
    console_metrics: list[str] | None = None
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "rl"
    wandb_name: str | None = None
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    mlflow: bool = False
    # None: a local file store under `log_dir/mlruns`.
    mlflow_tracking_uri: str | None = None
    mlflow_experiment_name: str = "rl"
    mlflow_run_name: str | None = None
