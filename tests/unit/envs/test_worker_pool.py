"""WorkerPool: ordered results, a hard timeout that really kills, survival of crashes."""

from __future__ import annotations

import operator
import os
import time

import pytest

from rl_envs.pool import TaskError, TaskTimeout, WorkerPool


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2)
    yield p
    p.shutdown()


def test_results_in_input_order(pool: WorkerPool) -> None:
    pairs = [(i, 3 * i + 1) for i in range(20)]
    assert pool.map(operator.mul, pairs, timeout_s=30) == [a * b for a, b in pairs]


def test_timeout_kills_the_worker_and_the_pool_keeps_serving(pool: WorkerPool) -> None:
    restarts = pool.restarts
    out = pool.map(time.sleep, [(60,), (0,)], timeout_s=1.0)
    assert out[0] == TaskTimeout(1.0)
    assert out[1] is None  # time.sleep(0) returns None: the other task was not affected
    assert pool.restarts == restarts + 1
    assert pool.map(operator.add, [(2, 3)] * 4, timeout_s=30) == [5] * 4


def test_exceptions_and_dead_workers_become_task_errors(pool: WorkerPool) -> None:
    out = pool.map(operator.truediv, [(1, 0), (6, 3)], timeout_s=30)
    assert isinstance(out[0], TaskError) and "ZeroDivisionError" in out[0].message
    assert out[1] == 2.0
    died = pool.map(os._exit, [(3,)], timeout_s=30)
    assert isinstance(died[0], TaskError) and "died" in died[0].message
    assert pool.map(operator.sub, [(10, 4)], timeout_s=30) == [6]


def test_no_worker_survives_shutdown() -> None:
    p = WorkerPool(2)
    assert p.map(abs, [(-1,), (-2,)], timeout_s=30) == [1, 2]
    processes = [w.process for w in p._all]
    p.shutdown()
    assert all(proc.poll() is not None for proc in processes)
    with pytest.raises(RuntimeError, match="shut down"):
        p.map(abs, [(-1,)], timeout_s=30)
