"""A pool of long-lived worker processes with a hard per-task timeout.

Verification libraries can hang inside C code (a huge integer power in sympy) where no signal
reaches them; the only reliable interruption is killing the process. Each task therefore runs
in a worker process; if it overruns its timeout the worker is SIGKILLed and replaced, and the
task yields `TaskTimeout`. Workers are plain `python -m rl_envs._pool_worker` processes (not
`multiprocessing`), so they never re-import the caller's ``__main__`` (a Ray worker's, say).
"""

from __future__ import annotations

import logging
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskTimeout:
    """The task ran past its timeout; its worker was killed."""

    timeout_s: float


@dataclass(frozen=True)
class TaskError:
    """The task raised (``message`` has the exception) or its worker died."""

    message: str


class _Worker:
    def __init__(self, preload: Sequence[str]) -> None:
        self.ready = False
        parent_sock, child_sock = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rl_envs._pool_worker", str(child_sock.fileno()), *preload],
            pass_fds=(child_sock.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        child_sock.close()
        self.conn = Connection(parent_sock.detach())

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


class WorkerPool:
    """``size`` worker processes; `map` runs a module-level function over argument tuples.

    Thread-safe. Workers start lazily on first use, importing ``preload`` modules so the
    first task does not pay for them.
    """

    def __init__(self, size: int, preload: Sequence[str] = (), startup_timeout_s: float = 300.0) -> None:
        if size < 1:
            raise ValueError(f"WorkerPool size must be >= 1, got {size}")
        self.size = size
        self.startup_timeout_s = startup_timeout_s
        self.preload = tuple(preload)
        self.restarts = 0
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._dispatch = ThreadPoolExecutor(max_workers=size, thread_name_prefix="worker-pool")

    def _spawn(self) -> None:
        """Start a worker; it joins the idle queue once its imports are done, so tasks are
        handed to ready workers first and start-up never counts against a task's timeout."""
        worker = _Worker(self.preload)
        with self._lock:
            self._all.add(worker)

        def enqueue_when_ready() -> None:
            worker.conn.poll(self.startup_timeout_s)
            self._idle.put(worker)

        threading.Thread(target=enqueue_when_ready, daemon=True).start()

    def _ensure_started(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("WorkerPool is shut down")
            if self._started:
                return
            self._started = True
        for _ in range(self.size):
            self._spawn()

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._all.discard(worker)
            self.restarts += 1
            if self._closed:
                return
        self._spawn()

    def _wait_ready(self, worker: _Worker) -> None:
        if worker.ready:
            return
        if not worker.conn.poll(0):
            raise OSError(f"worker did not start within {self.startup_timeout_s} s")
        if worker.conn.recv() != "ready":
            raise OSError("worker sent an unexpected start-up message")
        worker.ready = True

    def _run_one(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float) -> Any:
        worker = self._idle.get()
        try:
            self._wait_ready(worker)
            worker.conn.send((fn, args))
            if not worker.conn.poll(timeout_s):
                logger.warning("worker pool: %s overran %.1f s; killing its worker", fn.__name__, timeout_s)
                self._replace(worker)
                return TaskTimeout(timeout_s)
            ok, value = worker.conn.recv()
        except (EOFError, OSError) as exc:
            self._replace(worker)
            return TaskError(f"worker process died: {exc!r}")
        self._idle.put(worker)
        return value if ok else TaskError(value)

    def map(
        self, fn: Callable[..., Any], arg_tuples: Sequence[tuple[Any, ...]], timeout_s: float
    ) -> list[Any]:
        """``[fn(*args) for args in arg_tuples]`` in parallel, in order; a failed entry is a
        `TaskTimeout` or `TaskError` instead of a result."""
        if not arg_tuples:
            return []
        self._ensure_started()
        futures = [self._dispatch.submit(self._run_one, fn, args, timeout_s) for args in arg_tuples]
        return [f.result() for f in futures]

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            workers = list(self._all)
            self._all.clear()
        for worker in workers:
            worker.kill()
        self._dispatch.shutdown(wait=False, cancel_futures=True)
