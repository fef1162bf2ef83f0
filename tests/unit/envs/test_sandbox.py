"""The sandbox's isolation and limits, observed from inside the sandboxed program."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from rl_envs.sandbox import _LAUNCHER, Sandbox, SandboxConfig

PROJECT_FILE = Path(__file__).resolve()
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    sb = Sandbox(SandboxConfig(cpu_time_s=2, wall_time_s=4, max_processes=16, max_output_bytes=64 * 1024))
    if sb.isolation != "namespaces":
        pytest.skip("Linux namespaces are unavailable on this machine")
    return sb


def processes_with(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def test_runs_a_program_with_stdin(sandbox: Sandbox) -> None:
    result = sandbox.run_python("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", "1 2 3\n")
    assert (result.exit_code, result.stdout, result.timed_out) == (0, "6\n", False)
    assert result.isolation == "namespaces"


def test_ordinary_python_features_work_but_namespaces_cannot_be_created(sandbox: Sandbox) -> None:
    program = """
import ctypes, multiprocessing, os, subprocess, sys, threading
out = []
worker = threading.Thread(target=lambda: out.append("thread"))
worker.start(); worker.join(); print(out[0])
print(subprocess.run([sys.executable, "-c", "print('child')"], capture_output=True, text=True).stdout.strip())
with multiprocessing.Pool(2) as pool:
    print(sum(pool.map(abs, [-1, -2, -3])))
open("/tmp/scratch", "w").write("tmp is writable")
print(open("/sandbox/scratch").read())
libc = ctypes.CDLL(None, use_errno=True)
print(libc.unshare(0x10000000), ctypes.get_errno())  # CLONE_NEWUSER
"""
    result = sandbox.run_python(program)
    assert result.stdout.splitlines() == ["thread", "child", "6", "tmp is writable", "-1 1"], result.stderr


def test_sees_no_host_environment_variables(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RL_TEST_SECRET_TOKEN", "s3cr3t-value")
    result = sandbox.run_python("import os, json\nprint(json.dumps(dict(os.environ)))")
    env = json.loads(result.stdout)
    assert "s3cr3t-value" not in result.stdout
    assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_CTYPE"}


def test_filesystem_is_private(sandbox: Sandbox, tmp_path: Path) -> None:
    host_target = tmp_path / "escaped.txt"
    tmp_path.chmod(0o777)
    program = f"""
import os
def attempt(fn):
    try:
        fn(); return "ok"
    except OSError as e:
        return type(e).__name__
print(os.getcwd(), os.getuid() != 0)
print(sorted(os.listdir("/")))
print(attempt(lambda: open("/etc/passwd").read()))
print(attempt(lambda: open({str(PROJECT_FILE)!r}).read()))
print(attempt(lambda: open({str(host_target)!r}, "w").write("x")))
print(attempt(lambda: open("/usr/escaped", "w")))
print(attempt(lambda: open("/sandbox/scratch.txt", "w").write("fine")))
"""
    lines = sandbox.run_python(program).stdout.splitlines()
    assert lines[0] == "/sandbox True"
    assert "etc" not in lines[1] and "work" not in lines[1] and "home" not in lines[1]
    assert lines[2:] == ["FileNotFoundError", "FileNotFoundError", "FileNotFoundError", "OSError", "ok"]
    assert not host_target.exists()


def test_no_network_even_to_a_listening_host_port(sandbox: Sandbox) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            accepted.append(server.accept())

    thread = threading.Thread(target=accept)
    thread.start()
    program = f"""
import socket
for family, addr in ((socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_INET6, ("::1", {port}))):
    try:
        socket.create_connection(addr, timeout=1); print("connected")
    except OSError as e:
        print("blocked", e.errno)
a, b = socket.socketpair(); a.sendall(b"unix ok"); print(b.recv(16).decode())
"""
    result = sandbox.run_python(program)
    thread.join()
    server.close()
    assert accepted == []
    assert result.stdout.splitlines()[:2] == ["blocked 13", "blocked 13"]
    assert result.stdout.splitlines()[2] == "unix ok"  # local pipes between its own processes still work


def test_cpu_wall_memory_and_output_limits(sandbox: Sandbox) -> None:
    spin = sandbox.run_python("while True: pass")
    assert spin.exit_code is None and (spin.cpu_limit_exceeded or spin.timed_out)
    sleep = sandbox.run_python("import time; time.sleep(60)", wall_time_s=1)
    assert sleep.timed_out and sleep.exit_code is None
    memory = sandbox.run_python("x = bytearray(8 * 1024**3)")
    assert memory.exit_code == 1 and "MemoryError" in memory.stderr
    flood = sandbox.run_python("while True: print('y' * 1000)")
    assert flood.exit_code != 0 and flood.output_limit_exceeded
    assert len(flood.stdout.encode()) <= sandbox.config.max_output_bytes


def test_process_count_is_capped_and_nothing_outlives_the_run(sandbox: Sandbox) -> None:
    marker = f"rl-sandbox-marker-{uuid.uuid4().hex}"
    program = f"""
import os, subprocess, sys
n = 0
try:
    for _ in range(1000):
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", {marker!r}], start_new_session=True)
        n += 1
except OSError:
    pass
print(n)
"""
    result = sandbox.run_python(program)
    assert 0 < int(result.stdout) < sandbox.config.max_processes
    assert processes_with(marker) == []


def test_killing_its_parent_does_nothing(sandbox: Sandbox) -> None:
    result = sandbox.run_python("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('after')")
    # The parent is the sandbox's PID-namespace init, which ignores signals from inside.
    assert result.stdout in ("", "after\n")
    assert sandbox.run_python("print(1 + 1)").stdout == "2\n"


@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="needs a system python3 every user may execute")
def test_rlimits_mode_hides_environment_blocks_sockets_and_sweeps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RL_TEST_SECRET_TOKEN", "s3cr3t-value")
    sb = Sandbox(SandboxConfig(isolation="rlimits", python_executable=SYSTEM_PYTHON, wall_time_s=4))
    marker = f"rl-sandbox-marker-{uuid.uuid4().hex}"
    program = f"""
import os, socket, subprocess, sys
print("s3cr3t" in str(os.environ))
for family in (socket.AF_INET, socket.AF_UNIX):
    try:
        socket.socket(family); print("socket")
    except OSError as e:
        print("blocked", e.errno)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", {marker!r}], start_new_session=True)
print(os.getuid() == 0)
"""
    result = sb.run_python(program)
    assert result.isolation == "rlimits"
    assert result.stdout.splitlines() == ["False", "blocked 13", "blocked 13", "False"]
    assert processes_with(marker) == []


@pytest.mark.skipif(
    os.geteuid() != 0 or SYSTEM_PYTHON is None, reason="needs root to become an unprivileged user"
)
def test_launcher_isolates_an_unprivileged_user_with_a_user_namespace() -> None:
    """The non-root path: the launcher itself runs as uid 65534 and must build the same jail."""
    # pytest's tmp_path lies under a root-only directory; this user must reach its files.
    tmp_path = Path(tempfile.mkdtemp(prefix="rl-userns-test-"))
    try:
        _run_launcher_as_nobody(tmp_path)
    finally:
        shutil.rmtree(tmp_path)


def _run_launcher_as_nobody(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    (tmp_path / "root").mkdir(mode=0o777)
    (tmp_path / "root").chmod(0o777)
    program = tmp_path / "main.py"
    program.write_text("import os\nprint(os.getuid(), sorted(os.listdir('/')))\nopen('/etc/passwd')\n")
    program.chmod(0o644)
    status = tmp_path / "status"
    status.touch(mode=0o666)
    launcher = tmp_path / "launcher.py"
    shutil.copy(_LAUNCHER, launcher)
    launcher.chmod(0o644)
    with open(status, "ab") as status_f:
        spec = {
            "mode": "namespaces",
            "status_fd": status_f.fileno(),
            "new_root": str(tmp_path / "root"),
            "program_path": str(program),
            "interpreter": os.path.realpath(SYSTEM_PYTHON),
            "env": {"PATH": "/usr/bin"},
            "readonly_paths": ["/usr", "/lib", "/lib64", "/bin"],
            "device_files": ["/dev/null"],
            "uid": None,
            "gid": None,
            "sandbox_size_bytes": 1 << 20,
            "limits": {
                "cpu_seconds": 5,
                "address_space_bytes": 1 << 30,
                "processes": 8,
                "file_size_bytes": 1 << 20,
                "open_files": 32,
            },
        }
        proc = subprocess.run(
            [SYSTEM_PYTHON, "-I", "-S", str(launcher), json.dumps(spec)],
            user=65534,
            group=65534,
            extra_groups=[],
            pass_fds=(status_f.fileno(),),
            capture_output=True,
            text=True,
            timeout=30,
        )
    if "setup-error" in status.read_text() and "unshare" in status.read_text():
        pytest.skip(f"unprivileged user namespaces are disabled here: {status.read_text()}")
    assert status.read_text().splitlines() == ["exec", "exit 1"], proc.stderr
    uid, listing = proc.stdout.split(" ", 1)
    assert uid == "1000"
    assert "etc" not in listing and "sandbox" in listing
    assert "FileNotFoundError" in proc.stderr
