"""The always-on metrics file: one JSON object per `log_metrics` call."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from rl_core.logging.base import LoggerBackend, MetricRecord, json_safe


class JsonlBackend(LoggerBackend):
    """Appends to `path` (a resumed run continues the same file); each line is flushed at
    once so a killed run keeps every metric it logged."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def log_metrics(self, record: MetricRecord) -> None:
        line = {"step": record.step, "prefix": record.prefix, "time": record.time, **json_safe(record.values)}
        self._file.write(json.dumps(line, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file. A truncated last line (a run killed mid-write) is skipped
    with a warning; any other unreadable line is an error naming path and line number."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                warnings.warn(f"{path}:{number}: skipping truncated last line ({exc.msg})", stacklevel=2)
                continue
            raise ValueError(f"{path}:{number}: not a JSON object: {exc.msg}: {line[:80]!r}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records
