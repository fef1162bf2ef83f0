"""Metrics logging: console progress, JSONL (always), TensorBoard, W&B and MLflow backends.

Note: this package is `rl_core.logging`; modules inside it that need the standard library's
`logging` get it through absolute imports as usual.
"""

from rl_core.logging.base import LoggerBackend, MetricRecord
from rl_core.logging.config import LoggerConfig
from rl_core.logging.console import ConsoleBackend, format_duration
from rl_core.logging.jsonl import JsonlBackend, read_metrics_jsonl
from rl_core.logging.logger import Logger
from rl_core.logging.plot import metric_series, plot_metrics
from rl_core.logging.trackers import MlflowBackend, TensorBoardBackend, WandbBackend

__all__ = [
    "ConsoleBackend",
    "JsonlBackend",
    "Logger",
    "LoggerBackend",
    "LoggerConfig",
    "MetricRecord",
    "MlflowBackend",
    "TensorBoardBackend",
    "WandbBackend",
    "format_duration",
    "metric_series",
    "plot_metrics",
    "read_metrics_jsonl",
]
