"""Console progress line: `step 3/100 (3%) | train/reward 0.420 | 1.23 s/step | ETA 1m59s`."""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TextIO

from rl_core.logging.base import LoggerBackend, MetricRecord


class StepTimer:
    """Seconds per step as a moving average over the last `window` step advances."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window: int = 20) -> None:
        self._clock = clock
        self._intervals: deque[tuple[int, float]] = deque(maxlen=window)  # (steps advanced, seconds)
        self._last: tuple[int, float] | None = None

    def observe(self, step: int) -> None:
        now = self._clock()
        if self._last is not None:
            last_step, last_time = self._last
            if step == last_step:
                return  # another prefix logged for the same step
            if step > last_step:
                self._intervals.append((step - last_step, now - last_time))
            else:  # the step counter went back (a restart): old timings no longer apply
                self._intervals.clear()
        self._last = (step, now)

    @property
    def seconds_per_step(self) -> float | None:
        steps = sum(n for n, _ in self._intervals)
        return sum(t for _, t in self._intervals) / steps if steps else None


def format_value(value: float | int) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.3f}"
    return f"{value:.3e}"


def format_duration(seconds: float) -> str:
    """`45s`, `1m59s`, `2h03m07s`, `3d04h`."""
    total = round(seconds)
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


class ConsoleBackend(LoggerBackend):
    def __init__(
        self,
        total_steps: int | None = None,
        every_n_steps: int = 1,
        keys: Sequence[str] | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total_steps = total_steps
        self._every_n_steps = every_n_steps
        self._keys = list(keys) if keys is not None else None
        self._stream = stream  # None: whatever sys.stdout is at print time (pytest's capsys)
        self._timer = StepTimer(clock)

    def log_metrics(self, record: MetricRecord) -> None:
        self._timer.observe(record.step)
        if record.step % self._every_n_steps == 0 or record.step == self.total_steps:
            print(self.format_line(record), file=self._stream or sys.stdout, flush=True)

    def format_line(self, record: MetricRecord) -> str:
        if self.total_steps:
            percent = int(100 * record.step / self.total_steps)
            parts = [f"step {record.step}/{self.total_steps} ({percent}%)"]
        else:
            parts = [f"step {record.step}"]
        parts += [f"{key} {format_value(record.values[key])}" for key in self._shown_keys(record)]
        seconds = self._timer.seconds_per_step
        if seconds is not None:
            parts.append(f"{seconds:.3g} s/step")
            if self.total_steps:
                parts.append(f"ETA {format_duration(seconds * max(self.total_steps - record.step, 0))}")
        return " | ".join(parts)

    def _shown_keys(self, record: MetricRecord) -> list[str]:
        if self._keys is None:
            return list(record.scalars)
        wanted = []
        for key in self._keys:
            full = key if key in record.scalars else f"{record.prefix}/{key}"
            if full in record.scalars:
                wanted.append(full)
        return wanted
