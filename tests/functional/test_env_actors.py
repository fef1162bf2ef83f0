"""Environments as Ray actors: the sandbox escape suite, 64 concurrent steps, routing by task name."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
from pathlib import Path

import pytest
import ray
import torch

from rl_envs.registry import (
    UnknownEnvironmentError,
    create_environment,
    create_environments,
    get_environment_class,
    register_environment,
    registered_environments,
)
from rl_envs.router import EnvironmentRouter

pytestmark = pytest.mark.ray

SECRET = f"s3cr3t-{uuid.uuid4().hex}"
REPO_ROOT = Path(__file__).resolve().parents[2]


def reply(text: str) -> list[dict]:
    return [
        {"role": "user", "content": "task", "token_ids": torch.arange(2)},
        {"role": "assistant", "content": text, "token_ids": torch.arange(5)},
    ]


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def processes_with(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if "\nState:\tZ" not in status and marker.encode() in cmdline:
            found.append(int(entry))
    return found


def marked(program: str, marker: str) -> str:
    """Re-exec the program with ``marker`` in its argv, so every process it forks carries it."""
    return (
        f"import os, sys\nif sys.argv[-1] != {marker!r}:\n"
        f"    os.execv(sys.executable, [sys.executable, '-I', '-S', sys.argv[0], {marker!r}])\n{program}"
    )


@pytest.fixture(scope="module")
def code_env(ray_cluster):
    env = create_environment(
        "code",
        {"num_workers": 4, "sandbox": {"cpu_time_s": 2, "wall_time_s": 4, "max_processes": 16}},
        runtime_env={"env_vars": {"RL_ESCAPE_SECRET": SECRET}},
    )
    yield env
    ray.get(env.shutdown.remote())
    ray.kill(env)


def test_registry_names_and_errors() -> None:
    assert set(registered_environments()) >= {"math", "code", "reward_model", "sliding_puzzle", "tools"}
    assert get_environment_class("sliding_puzzle").__name__ == "SlidingPuzzleEnvironment"
    with pytest.raises(
        UnknownEnvironmentError, match=r"unknown environment 'chess'; registered environments: \["
    ):
        get_environment_class("chess")
    register_environment("puzzle_alias", "rl_envs.sliding_puzzle.SlidingPuzzleEnvironment")
    assert get_environment_class("puzzle_alias").__name__ == "SlidingPuzzleEnvironment"
    with pytest.raises(ValueError, match="already registered"):
        register_environment("math", "rl_envs.code.CodeEnvironment")
    with pytest.raises(ValueError, match="not a fully-qualified"):
        register_environment("bad", "CodeEnvironment")


def all_actors() -> set[str]:
    return set(ray._private.state.actors())


def test_bad_env_section_fails_before_any_actor_starts(ray_cluster) -> None:
    before = all_actors()
    with pytest.raises(ValueError, match=r"(?s)env\.gsm8k .*unknown key 'num_workerz'"):
        create_environments(
            {"puzzle": {"type": "sliding_puzzle"}, "gsm8k": {"type": "math", "num_workerz": 2}}
        )
    with pytest.raises(UnknownEnvironmentError, match="unknown environment 'maths'"):
        create_environments({"gsm8k": {"type": "maths"}})
    # The valid "puzzle" section came first, yet nothing was started.
    assert all_actors() == before


def escape_cases(host_dir: Path, server_port: int, actor_pid: int, marker: str) -> list[tuple[str, str, str]]:
    """(name, program, the output it would print if the escape worked)."""
    passwd_first_line = Path("/etc/passwd").read_text().splitlines()[0]
    project_first_line = (REPO_ROOT / "pyproject.toml").read_text().splitlines()[0]
    return [
        (
            "network",
            f"import socket\nsocket.create_connection(('127.0.0.1', {server_port}), timeout=2)\nprint('connected')",
            "connected",
        ),
        ("read /etc/passwd", "print(open('/etc/passwd').read().splitlines()[0])", passwd_first_line),
        (
            "read project file",
            f"print(open({str(REPO_ROOT / 'pyproject.toml')!r}).read().splitlines()[0])",
            project_first_line,
        ),
        (
            "write host file",
            f"open({str(host_dir / 'escaped.txt')!r}, 'w').write('pwned')\nprint('written')",
            "written",
        ),
        ("parent env vars", "import os\nprint(os.environ.get('RL_ESCAPE_SECRET'))", SECRET),
        (
            "fork bomb",
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            "done",
        ),
        ("infinite loop", "while True:\n    pass", "done"),
        ("allocate 8 GiB", "x = bytearray(8 * 1024**3)\nx[-1] = 1\nprint('allocated')", "allocated"),
        ("print 100 MB", "import sys\nsys.stdout.write('x' * 100_000_000)\nprint('done')", "done"),
        (
            "kill the parent",
            "import os\nos.kill(os.getppid(), 9)\nprint('killed')",
            "killed",
        ),
        ("kill the environment actor", f"import os\nos.kill({actor_pid}, 9)\nprint('killed')", "killed"),
        (
            "outliving subprocess",
            "import subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1); print(\"survivor\")', {marker!r}],"
            " start_new_session=True)\nprint('spawned')",
            "spawned\nsurvivor",
        ),
    ]


def test_sandbox_escape_suite(code_env, tmp_path: Path) -> None:
    host_dir = tmp_path / "world-writable"
    host_dir.mkdir()
    host_dir.chmod(0o777)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    connections: list[object] = []
    stop = threading.Event()

    def accept_forever() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                connections.append(server.accept())

    listener = threading.Thread(target=accept_forever)
    listener.start()
    actor_pid = ray.get(code_env.__ray_call__.remote(lambda self: os.getpid()))
    marker = f"rl-escape-{uuid.uuid4().hex}"
    good = (fenced("print(int(input()) * 2)"), [{"input": "21\n", "output": "42\n"}])
    try:
        for name, program, escaped_output in escape_cases(
            host_dir, server.getsockname()[1], actor_pid, marker
        ):
            tests = [{"input": "", "output": escaped_output}]
            sample = reply(fenced(marked(program, marker)))
            ret = ray.get(code_env.step.remote([sample], [{"tests": tests}]), timeout=60)
            assert ret.rewards.tolist() == [0.0], name
            assert processes_with(marker) == [], f"{name}: processes left behind"
            # The environment keeps serving: a correct sample right after gets full reward.
            after = ray.get(code_env.step.remote([reply(good[0])], [{"tests": good[1]}]), timeout=60)
            assert after.rewards.tolist() == [1.0], f"environment broken after {name}"
    finally:
        stop.set()
        listener.join()
        server.close()
    assert connections == []
    assert list(host_dir.iterdir()) == []
    assert ray.get(code_env.__ray_call__.remote(lambda self: os.getpid())) == actor_pid


def test_64_concurrent_steps_get_correct_rewards(code_env) -> None:
    program = fenced("n = int(input())\nprint(n * n if n % 3 else n + 1)")
    # Expected outputs say n*n; the program is wrong exactly for multiples of 3.
    futures = [
        code_env.step.remote([reply(program)], [{"tests": [{"input": f"{n}\n", "output": f"{n * n}\n"}]}])
        for n in range(64)
    ]
    rewards = [ray.get(f, timeout=300).rewards.item() for f in futures]
    assert rewards == [0.0 if n % 3 == 0 else 1.0 for n in range(64)]
    batch = ray.get(
        code_env.step.remote(
            [reply(program)] * 64,
            [{"tests": [{"input": f"{n}\n", "output": f"{n * n}\n"}]} for n in range(64)],
        ),
        timeout=300,
    )
    assert batch.rewards.tolist() == rewards


def test_router_splits_steps_and_merges_in_order(code_env) -> None:
    envs = create_environments(
        {"math": {"num_workers": 1}, "puzzle": {"type": "sliding_puzzle", "max_moves": 5}}
    )
    router = EnvironmentRouter({**envs, "code": code_env})
    board = [[1, 2, 3], [4, 5, 6], [7, 0, 8]]  # solved by moving the blank right
    samples = [
        ("math", reply("\\boxed{12}"), {"ground_truth": "12"}),
        ("puzzle", reply("<move>right</move>"), {"board": board}),
        ("code", reply(fenced("print(input())")), {"tests": [{"input": "hi\n", "output": "hi"}]}),
        ("math", reply("The answer is 7."), {"ground_truth": "8"}),
        ("code", reply("no code"), {"tests": [{"input": "", "output": "x"}]}),
        ("puzzle", reply("<move>up</move>"), {"board": board}),
    ]
    task_names = [s[0] for s in samples]
    ret = router.step([s[1] for s in samples], [s[2] for s in samples], task_names)
    assert ret.rewards.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert ret.terminateds.tolist() == [True, True, True, True, True, False]
    assert ret.answers[0] == "12" and ret.answers[3] == "7" and ret.answers[4] is None
    assert ret.observations[1]["content"].startswith("Moved the blank right")
    assert ret.observations[5]["content"].startswith("Moved the blank up")
    assert ret.metadata[5]["game_state"]["moves"] == 1 and ret.next_stop_strings[5] == ["</move>"]
    assert ret.observations[2]["content"] == "passed 1/1 tests"

    batch = {"rewards": ret.rewards, "message_log": [s[1] for s in samples], "tag": "kept"}
    merged, metrics = router.global_post_process_and_metrics(batch, task_names)
    assert metrics["math/accuracy"] == pytest.approx(0.5)
    assert metrics["code/pass_rate"] == pytest.approx(0.5)
    assert metrics["code/format_error_rate"] == pytest.approx(0.5)
    assert metrics["puzzle/mean_reward"] == pytest.approx(0.5)
    torch.testing.assert_close(merged["rewards"], ret.rewards)
    assert merged["tag"] == "kept"
    with pytest.raises(ValueError, match=r"sample 0 has task_name 'chess', which has no environment"):
        router.step([reply("x")], [{}], ["chess"])
    for _name, handle in envs.items():
        ray.get(handle.shutdown.remote())
        ray.kill(handle)
