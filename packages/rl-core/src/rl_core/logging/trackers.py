"""Experiment-tracker backends (optional extras, imported only when enabled)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from rl_core.logging.base import LoggerBackend, MetricRecord, flatten
from rl_core.logging.optional import import_optional


class TensorBoardBackend(LoggerBackend):
    def __init__(self, log_dir: Path) -> None:
        tensorboard = import_optional("torch.utils.tensorboard", "tensorboard", "TensorBoard logging")
        self.log_dir = log_dir
        self._writer = tensorboard.SummaryWriter(log_dir=str(log_dir))

    def log_metrics(self, record: MetricRecord) -> None:
        for key, value in record.scalars.items():
            self._writer.add_scalar(key, value, global_step=record.step, walltime=record.time)
        self._writer.flush()

    def log_hyperparams(self, cfg: Mapping[str, Any]) -> None:
        text = yaml.safe_dump(dict(cfg), sort_keys=False)
        # Four-space indentation makes TensorBoard's markdown renderer show it as code.
        self._writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbBackend(LoggerBackend):
    def __init__(self, log_dir: Path, project: str, name: str | None, mode: str) -> None:
        wandb = import_optional("wandb", "wandb", "W&B logging")
        log_dir.mkdir(parents=True, exist_ok=True)
        # "create_new" lets several loggers (tests, sweeps) coexist in one process.
        self._run = wandb.init(project=project, name=name, mode=mode, dir=str(log_dir), reinit="create_new")

    @property
    def run_dir(self) -> Path:
        """The run's directory (`<log_dir>/wandb/<offline-run-...>`)."""
        return Path(self._run.dir).parent

    def log_metrics(self, record: MetricRecord) -> None:
        if record.scalars:
            self._run.log(dict(record.scalars), step=record.step)

    def log_hyperparams(self, cfg: Mapping[str, Any]) -> None:
        self._run.config.update(dict(cfg), allow_val_change=True)

    def close(self) -> None:
        self._run.finish()


# MLflow limits (mlflow.utils.validation): per log_batch call and per parameter value.
_MLFLOW_MAX_METRICS_PER_BATCH = 1000
_MLFLOW_MAX_PARAMS_PER_BATCH = 100
_MLFLOW_MAX_PARAM_LENGTH = 6000


class MlflowBackend(LoggerBackend):
    def __init__(self, tracking_uri: str, experiment_name: str, run_name: str | None) -> None:
        tracking = import_optional("mlflow.tracking", "mlflow", "MLflow logging")
        self._entities = import_optional("mlflow.entities", "mlflow", "MLflow logging")
        if tracking_uri.startswith("file:") or "://" not in tracking_uri:
            # MLflow 3 refuses its file store unless opted in; a local store needs no server
            # and no SQL database, which is what a default, zero-setup run wants.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = tracking_uri
        self._client = tracking.MlflowClient(tracking_uri=tracking_uri)
        experiment = self._client.get_experiment_by_name(experiment_name)
        experiment_id = (
            experiment.experiment_id if experiment else self._client.create_experiment(experiment_name)
        )
        self.run_id: str = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        self._params: dict[str, str] = {}

    def log_metrics(self, record: MetricRecord) -> None:
        timestamp_ms = int(record.time * 1000)
        metrics = [self._entities.Metric(k, v, timestamp_ms, record.step) for k, v in record.scalars.items()]
        for start in range(0, len(metrics), _MLFLOW_MAX_METRICS_PER_BATCH):
            self._client.log_batch(
                self.run_id, metrics=metrics[start : start + _MLFLOW_MAX_METRICS_PER_BATCH]
            )

    def log_hyperparams(self, cfg: Mapping[str, Any]) -> None:
        # MLflow parameters are write-once: log only keys not logged before by this run.
        new = {
            key: str(value)[:_MLFLOW_MAX_PARAM_LENGTH]
            for key, value in flatten(cfg).items()
            if key not in self._params
        }
        self._params.update(new)
        params = [self._entities.Param(k, v) for k, v in new.items()]
        for start in range(0, len(params), _MLFLOW_MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[start : start + _MLFLOW_MAX_PARAMS_PER_BATCH])

    def close(self) -> None:
        self._client.set_terminated(self.run_id, status="FINISHED", end_time=int(time.time() * 1000))
