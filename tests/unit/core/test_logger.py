"""Metrics logger: JSONL file, console progress line, TensorBoard, W&B (offline), MLflow, plots."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from rl_core.logging import Logger, LoggerConfig, format_duration, metric_series, read_metrics_jsonl

# Three steps of made-up training metrics; every backend must give these back.
STEPS = [1, 2, 3]
REWARDS = [0.25, 0.5, 0.875]
LOSSES = [2.5, 1.25, 0.625]


def fake_clock(times: list[float]) -> Any:
    ticks: Iterator[float] = iter(times)
    return lambda: next(ticks)


def log_three_steps(logger: Logger) -> None:
    for step, reward, loss in zip(STEPS, REWARDS, LOSSES):
        logger.log_metrics({"reward": torch.tensor(reward), "loss": np.float32(loss)}, step=step)


def test_jsonl_records_every_call_exactly_and_flushes_each_line(tmp_path: Path) -> None:
    before = time.time()
    logger = Logger(LoggerConfig(log_dir=str(tmp_path), console=False))
    logger.log_metrics(
        {
            "reward": 0.5,
            "num_samples": 64,
            "kl": torch.tensor([0.125]),  # one element: a scalar
            "entropy": np.float64(1.75),
            "lengths": torch.tensor([3, 5, 8]),  # kept as a list in the file
            "tags": ["a", "b"],
            "loss": float("nan"),
            "grad_norm": float("inf"),
            "clipped": True,
        },
        step=7,
    )
    # Flushed at once: readable while the logger is still open (a killed run keeps it).
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    logger.log_metrics({"accuracy": np.array(0.75)}, step=7, prefix="val")
    logger.close()
    after = time.time()

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    records = [json.loads(line) for line in lines]
    assert records[0] == first
    assert before <= records[0]["time"] <= records[1]["time"] <= after
    for record in records:
        del record["time"]
    assert records == [
        {
            "step": 7,
            "prefix": "train",
            "train/reward": 0.5,
            "train/num_samples": 64,
            "train/kl": 0.125,
            "train/entropy": 1.75,
            "train/lengths": [3, 5, 8],
            "train/tags": ["a", "b"],
            "train/loss": "NaN",
            "train/grad_norm": "Infinity",
            "train/clipped": True,
        },
        {"step": 7, "prefix": "val", "val/accuracy": 0.75},
    ]
    assert list(json.loads(lines[0]))[:3] == ["step", "prefix", "time"]
    # A resumed run appends to the same file.
    with Logger(LoggerConfig(log_dir=str(tmp_path), console=False)) as again:
        again.log_metrics({"reward": 1.0}, step=8)
    assert [r["step"] for r in read_metrics_jsonl(tmp_path / "metrics.jsonl")] == [7, 7, 8]


def test_reserved_metric_names_need_a_prefix(tmp_path: Path) -> None:
    with Logger(LoggerConfig(log_dir=str(tmp_path), console=False)) as logger:
        with pytest.raises(ValueError, match="metric name 'step' is reserved"):
            logger.log_metrics({"step": 1}, step=1, prefix="")
        logger.log_metrics({"step": 1}, step=1)  # under a prefix it is an ordinary metric
    assert read_metrics_jsonl(tmp_path / "metrics.jsonl")[0]["train/step"] == 1


def test_console_progress_line_with_moving_average_eta(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = LoggerConfig(log_dir=str(tmp_path), console_metrics=["reward", "val/accuracy"])
    # Steps finish 1.23 s apart: 97 steps left at step 3 -> 119.31 s -> "1m59s".
    with Logger(cfg, total_steps=100, clock=fake_clock([10.0, 11.23, 12.46, 12.46])) as logger:
        for step in STEPS:
            logger.log_metrics({"reward": 0.42, "loss": 3.0}, step=step)
        logger.log_metrics({"accuracy": 0.5}, step=3, prefix="val")  # same step: timing unchanged
    assert capsys.readouterr().out.splitlines() == [
        "step 1/100 (1%) | train/reward 0.420",
        "step 2/100 (2%) | train/reward 0.420 | 1.23 s/step | ETA 2m01s",
        "step 3/100 (3%) | train/reward 0.420 | 1.23 s/step | ETA 1m59s",
        "step 3/100 (3%) | val/accuracy 0.500 | 1.23 s/step | ETA 1m59s",
    ]


def test_console_every_n_steps_and_uneven_step_times(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = LoggerConfig(log_dir=str(tmp_path), console_every_n_steps=2)
    # Step durations 1 s, 3 s, 2 s, 6 s: the moving average is total time / steps advanced.
    clock = fake_clock([0.0, 1.0, 4.0, 6.0, 12.0])
    with Logger(cfg, total_steps=5, clock=clock) as logger:
        for step, value in zip(range(1, 6), [1, 2e-5, 3.5e5, -0.5, float("nan")]):
            logger.log_metrics({"v": value}, step=step)
    assert capsys.readouterr().out.splitlines() == [
        "step 2/5 (40%) | train/v 2.000e-05 | 1 s/step | ETA 3s",  # (1) / 1
        "step 4/5 (80%) | train/v -0.500 | 2 s/step | ETA 2s",  # (1+3+2) / 3
        "step 5/5 (100%) | train/v nan | 3 s/step | ETA 0s",  # the last step always prints; 12/4
    ]


def test_console_without_total_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with Logger(LoggerConfig(log_dir=str(tmp_path)), clock=fake_clock([0.0, 0.5])) as logger:
        logger.log_metrics({"n": 3}, step=10)
        logger.log_metrics({"n": 4}, step=20)
    assert capsys.readouterr().out.splitlines() == [
        "step 10 | train/n 3",
        "step 20 | train/n 4 | 0.05 s/step",
    ]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.4, "0s"), (45, "45s"), (119.31, "1m59s"), (3600, "1h00m00s"), (7387, "2h03m07s"), (277200, "3d05h")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_log_hyperparams_writes_config_yaml(tmp_path: Path) -> None:
    cfg = {"grpo": {"num_prompts_per_step": 8, "lr": 1e-6}, "policy": {"model_name": "tiny"}}
    with Logger(LoggerConfig(log_dir=str(tmp_path), console=False)) as logger:
        path = logger.log_hyperparams(cfg)
    assert path == tmp_path / "config.yaml"
    assert yaml.safe_load(path.read_text()) == cfg


def test_tensorboard_event_file_reads_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Logger(LoggerConfig(log_dir=str(tmp_path), console=False, tensorboard=True)) as logger:
        logger.log_hyperparams({"policy": {"model_name": "tiny-llama"}})
        log_three_steps(logger)
        logger.log_metrics({"lengths": [1, 2]}, step=3)  # non-scalar: JSONL only
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["train/loss", "train/reward"]
    for tag, expected in [("train/reward", REWARDS), ("train/loss", LOSSES)]:
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == STEPS
        assert [s.value for s in scalars] == expected  # exact: all are dyadic fractions
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "model_name: tiny-llama" in text


def test_wandb_offline_run_holds_the_logged_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    for name, value in {
        "WANDB_SILENT": "true",
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
    }.items():
        monkeypatch.setenv(name, value)
    cfg = LoggerConfig(log_dir=str(tmp_path / "logs"), console=False, wandb=True, wandb_name="unit")
    with Logger(cfg) as logger:
        assert logger.wandb is not None
        run_dir = logger.wandb.run_dir
        logger.log_hyperparams({"grpo": {"num_prompts_per_step": 8}})
        log_three_steps(logger)
    assert run_dir.parent == tmp_path / "logs" / "wandb"
    run_files = list(run_dir.glob("run-*.wandb"))
    assert len(run_files) == 1
    # The offline transaction log, decoded by wandb's own inspector.
    inspected = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_files[0])],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    records = [json.loads(line) for line in inspected.stdout.splitlines() if line.startswith("{")]
    history = [r["history"] for r in records if r.get("type") == "history"]
    assert [h["step"]["num"] for h in history] == STEPS
    assert [h["item"]["train/reward"] for h in history] == REWARDS
    assert [h["item"]["train/loss"] for h in history] == LOSSES
    run = next(r["run"] for r in records if r.get("type") == "run")
    assert run["display_name"] == "unit"
    config: dict[str, Any] = {}
    for record in records:
        if record.get("type") == "config":
            config.update(record["config"]["update"])
    assert config == {"grpo": {"num_prompts_per_step": 8}}


def test_mlflow_local_store_reads_back(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    cfg = LoggerConfig(log_dir=str(tmp_path), console=False, mlflow=True, mlflow_run_name="unit")
    with Logger(cfg) as logger:
        assert logger.mlflow is not None
        run_id = logger.mlflow.run_id
        logger.log_hyperparams({"grpo": {"num_prompts_per_step": 8}, "policy": {"model_name": "tiny"}})
        log_three_steps(logger)
        logger.log_metrics({"accuracy": float("nan")}, step=3, prefix="val")

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "unit"
    assert run.data.params == {"grpo.num_prompts_per_step": "8", "policy.model_name": "tiny"}
    for key, expected in [("train/reward", REWARDS), ("train/loss", LOSSES)]:
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        assert [(m.step, m.value) for m in history] == list(zip(STEPS, expected))
    assert math.isnan(client.get_metric_history(run_id, "val/accuracy")[0].value)


def test_plot_writes_a_png_of_the_logged_curve(tmp_path: Path) -> None:
    from matplotlib.image import imread

    rewards = [0.1 * i for i in range(10)]
    with Logger(LoggerConfig(log_dir=str(tmp_path), console=False)) as logger:
        for step, reward in enumerate(rewards):
            logger.log_metrics({"reward": reward, "loss": 1.0 - reward}, step=step)
        png = logger.log_plot(["train/reward", "train/loss"], name="curves", title="GRPO")
    assert png == tmp_path / "plots" / "curves.png"
    assert metric_series(tmp_path / "metrics.jsonl", "train/reward") == (list(range(10)), rewards)
    image = imread(png)
    assert image.shape == (400, 700, 4)  # figsize 7x4 inches at 100 dpi
    # Something besides the white background was drawn (axes, two coloured lines).
    assert (image[..., :3] < 0.5).any()
    with pytest.raises(ValueError, match=r"no numeric values for metric\(s\) \['train/missing'\]"):
        logger.log_plot(["train/missing"])


def test_read_metrics_jsonl_tolerates_only_a_truncated_last_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/r": 1}\n{"step": 2, "train/r": 2}\n{"step": 3, "tr')
    with pytest.warns(UserWarning, match=f"{path}:3: skipping truncated last line"):
        assert [r["step"] for r in read_metrics_jsonl(path)] == [1, 2]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=f"{path}:2: not a JSON object"):
        read_metrics_jsonl(path)


@pytest.mark.parametrize(
    ("option", "module", "extra"),
    [
        ("wandb", "wandb", "wandb"),
        ("mlflow", "mlflow.tracking", "mlflow"),
        ("tensorboard", "torch.utils.tensorboard", "tensorboard"),
    ],
)
def test_missing_extra_tells_which_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, option: str, module: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail as if absent
    with pytest.raises(ImportError, match=f'pip install "rl-core\\[{extra}\\]"'):
        Logger(LoggerConfig.model_validate({"log_dir": str(tmp_path), "console": False, option: True}))


def test_plot_without_matplotlib_tells_which_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Logger(LoggerConfig(log_dir=str(tmp_path), console=False)) as logger:
        logger.log_metrics({"reward": 1.0}, step=1)
        monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
        with pytest.raises(ImportError, match=r'pip install "rl-core\[plot\]"'):
            logger.log_plot(["train/reward"])
