"""Checkpoint directories: atomic writes, keep-top-k, discovery and compatibility checks.

Layout: `checkpoint_dir/step_N/{training_info.json, config.yaml, ...}`. A checkpoint is
written into `tmp_step_N` and renamed to `step_N` only when complete, so a `step_N`
directory is always a whole checkpoint; a crash leaves at most a `tmp_step_N`, which the
next run removes. Replacing an existing `step_N` moves it aside to `old_step_N` first and
deletes it only after the new one is in place (the next run restores it if that was cut off).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import Field

from rl_core.config import RLConfig, save_config, to_plain
from rl_core.config.loader import read_yaml_file

log = logging.getLogger(__name__)

TRAINING_INFO_FILE = "training_info.json"
CONFIG_FILE = "config.yaml"
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^tmp_step_(\d+)$")
_DISPLACED_RE = re.compile(r"^old_step_(\d+)$")


class CheckpointConfig(RLConfig):
    enabled: bool = True
    checkpoint_dir: str = "checkpoints"
    save_period: int = Field(default=10, ge=1)
    # Keep the k best checkpoints by `metric_name` (the k newest when no metric is set) plus
    # always the newest one, so a run can resume; None keeps everything.
    keep_top_k: int | None = Field(default=None, ge=1)
    metric_name: str | None = None  # a training_info key, e.g. "val/accuracy"
    higher_is_better: bool = True


class CheckpointIncompatibleError(ValueError):
    """The checkpoint was written by a run with a different identity (model, tokenizer, ...)."""


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig) -> None:
        self.cfg = cfg
        self.checkpoint_dir = Path(cfg.checkpoint_dir)
        self._warned_missing_metric: set[int] = set()
        if cfg.enabled:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            self._recover_interrupted_writes()

    def should_save(self, step: int, is_last_step: bool = False) -> bool:
        return self.cfg.enabled and (step % self.cfg.save_period == 0 or is_last_step)

    @contextmanager
    def save(self, step: int, training_info: Mapping[str, Any], config: Mapping[str, Any]) -> Iterator[Path]:
        """Yield the temporary directory to write weights/optimizer/dataloader state into;
        on normal exit it becomes `step_N`, on an exception it is deleted (and the error
        re-raised) and every earlier checkpoint is left as it was."""
        tmp_path = self.init_tmp_checkpoint(step, training_info, config)
        try:
            yield tmp_path
        except BaseException:
            shutil.rmtree(tmp_path, ignore_errors=True)
            raise
        self.finalize_checkpoint(tmp_path)

    def init_tmp_checkpoint(
        self, step: int, training_info: Mapping[str, Any], config: Mapping[str, Any]
    ) -> Path:
        """Create `tmp_step_N` holding training_info.json and config.yaml; returns its path."""
        if not self.cfg.enabled:
            raise RuntimeError("checkpointing is disabled (checkpointing.enabled is false)")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
        tmp_path = self.checkpoint_dir / f"tmp_step_{step}"
        if tmp_path.exists():
            shutil.rmtree(tmp_path)
        tmp_path.mkdir(parents=True)
        try:
            info_text = json.dumps(to_plain(dict(training_info)), indent=2)
            (tmp_path / TRAINING_INFO_FILE).write_text(info_text + "\n", encoding="utf-8")
            save_config(config, tmp_path / CONFIG_FILE)
        except BaseException:
            shutil.rmtree(tmp_path, ignore_errors=True)
            raise
        return tmp_path

    def finalize_checkpoint(self, tmp_path: str | os.PathLike[str]) -> Path:
        """Rename a complete `tmp_step_N` to `step_N` (replacing an older `step_N`), then
        apply keep-top-k. Returns the final path."""
        tmp_path = Path(tmp_path)
        match = _TMP_RE.match(tmp_path.name)
        if match is None or tmp_path.parent.resolve() != self.checkpoint_dir.resolve():
            raise ValueError(f"{tmp_path} is not a tmp_step_N directory of {self.checkpoint_dir}")
        if not (tmp_path / TRAINING_INFO_FILE).is_file():
            raise ValueError(f"{tmp_path} has no {TRAINING_INFO_FILE}; create it with init_tmp_checkpoint")
        step = int(match[1])
        final = self.checkpoint_dir / f"step_{step}"
        if final.exists():
            displaced = self.checkpoint_dir / f"old_step_{step}"
            if displaced.exists():
                shutil.rmtree(displaced)
            os.replace(final, displaced)
            os.replace(tmp_path, final)
            shutil.rmtree(displaced)
        else:
            os.replace(tmp_path, final)
        _fsync_directory(self.checkpoint_dir)
        log.info("saved checkpoint %s", final)
        self._remove_beyond_top_k()
        return final

    def list_checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as (step, path), oldest first."""
        if not self.checkpoint_dir.is_dir():
            return []
        found = []
        for path in self.checkpoint_dir.iterdir():
            match = _STEP_RE.match(path.name)
            if match and (path / TRAINING_INFO_FILE).is_file():
                found.append((int(match[1]), path))
        return sorted(found)

    def get_latest_checkpoint_path(self) -> Path | None:
        checkpoints = self.list_checkpoints()
        return checkpoints[-1][1] if checkpoints else None

    def get_best_checkpoint_path(self) -> Path | None:
        """Best by `metric_name` (ties: the newer); the latest when no metric is configured."""
        ranked = self._ranked(self.list_checkpoints())
        return ranked[0][1] if ranked else None

    @staticmethod
    def load_training_info(path: str | os.PathLike[str]) -> dict[str, Any]:
        file = Path(path) / TRAINING_INFO_FILE
        if not file.is_file():
            raise FileNotFoundError(f"no {TRAINING_INFO_FILE} in checkpoint {path} (looked for {file})")
        try:
            info = json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}") from None
        if not isinstance(info, dict):
            raise ValueError(f"{file}: expected a JSON object, got {type(info).__name__}")
        return info

    @staticmethod
    def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
        """The resolved config the checkpoint was saved with."""
        return read_yaml_file(Path(path) / CONFIG_FILE).data

    @classmethod
    def check_compatible(cls, path: str | os.PathLike[str], expected: Mapping[str, Any]) -> None:
        """Refuse a checkpoint whose recorded identity differs from `expected`.

        Each key (e.g. `model_name`, or a dotted config key such as `policy.model_name`) is
        looked up in training_info.json first, then in the saved config.
        """
        info = cls.load_training_info(path)
        saved_config: dict[str, Any] | None = None
        problems = []
        for key, want in expected.items():
            found, have = _lookup(info, key)
            if not found:
                saved_config = saved_config if saved_config is not None else cls.load_config(path)
                found, have = _lookup(saved_config, key)
            want_plain = to_plain(want)
            if not found:
                problems.append(f"'{key}' is not recorded in it (this run expects {want_plain!r})")
            elif have != want_plain:
                problems.append(f"'{key}' was saved as {have!r} but this run expects {want_plain!r}")
        if problems:
            raise CheckpointIncompatibleError(
                f"checkpoint {path} is incompatible with this run: " + "; ".join(problems)
            )

    def _ranked(self, checkpoints: list[tuple[int, Path]]) -> list[tuple[int, Path]]:
        """Best first. Without a metric: newest first. Checkpoints lacking a finite metric
        value rank after all others (newest first among themselves)."""
        metric = self.cfg.metric_name
        if metric is None:
            return sorted(checkpoints, reverse=True)
        sign = 1.0 if self.cfg.higher_is_better else -1.0
        keyed = []
        for step, path in checkpoints:
            found, value = _lookup(self.load_training_info(path), metric)
            usable = found and isinstance(value, int | float) and not isinstance(value, bool)
            usable = usable and math.isfinite(value)
            if not usable and step not in self._warned_missing_metric:
                self._warned_missing_metric.add(step)
                warnings.warn(
                    f"checkpoint {path} has no finite '{metric}' in {TRAINING_INFO_FILE} "
                    f"(found {value!r}); it ranks last for keep_top_k",
                    stacklevel=3,
                )
            keyed.append(((usable, sign * value if usable else 0.0, step), (step, path)))
        keyed.sort(key=lambda item: item[0], reverse=True)
        return [checkpoint for _, checkpoint in keyed]

    def _remove_beyond_top_k(self) -> None:
        if self.cfg.keep_top_k is None:
            return
        checkpoints = self.list_checkpoints()
        if not checkpoints:
            return
        keep = {step for step, _ in self._ranked(checkpoints)[: self.cfg.keep_top_k]}
        keep.add(checkpoints[-1][0])  # the newest: needed to resume
        for step, path in checkpoints:
            if step not in keep:
                shutil.rmtree(path)
                log.info("removed checkpoint %s (not in the top %d)", path, self.cfg.keep_top_k)

    def _recover_interrupted_writes(self) -> None:
        for path in sorted(self.checkpoint_dir.iterdir()):
            displaced = _DISPLACED_RE.match(path.name)
            if displaced:
                final = self.checkpoint_dir / f"step_{displaced[1]}"
                if final.exists():
                    log.warning("removing %s: its replacement %s was completed", path, final)
                    shutil.rmtree(path)
                else:
                    log.warning("restoring %s: the run that was replacing it was interrupted", final)
                    os.replace(path, final)
        for path in sorted(self.checkpoint_dir.iterdir()):
            if _TMP_RE.match(path.name):
                log.warning("removing incomplete checkpoint %s left by an interrupted run", path)
                shutil.rmtree(path)


def _lookup(data: Mapping[str, Any], key: str) -> tuple[bool, Any]:
    """`data[key]`, else the nested path `key` split on '.' or '/' (`val/accuracy`)."""
    if key in data:
        return True, data[key]
    node: Any = data
    for part in re.split(r"[./]", key):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _fsync_directory(path: Path) -> None:
    """Make the rename itself durable (a power loss must not undo it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
