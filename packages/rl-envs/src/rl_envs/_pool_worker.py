"""Worker process of `rl_envs.pool.WorkerPool`: runs pickled ``(function, args)`` tasks.

Usage: ``python -m rl_envs._pool_worker <socket fd> [preload ...]`` where each preload is a
module to import or ``module:function`` to call (a warm-up run that triggers lazy imports).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from multiprocessing.connection import Connection


def _exit_when_orphaned(parent_pid: int) -> None:
    # A task stuck in C code never sees the closed socket; the pool that owned us is gone.
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    for preload in sys.argv[2:]:
        module_name, _, function_name = preload.partition(":")
        module = importlib.import_module(module_name)
        if function_name:
            getattr(module, function_name)()
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    conn.send("ready")
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = (True, fn(*args))
        except Exception as exc:
            reply = (False, f"{type(exc).__name__}: {exc}")
        conn.send(reply)


if __name__ == "__main__":
    main()
