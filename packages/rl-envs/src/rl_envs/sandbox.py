"""Run untrusted Python in a separate, resource-limited, isolated process.

Every run gets a fresh process tree started by `_sandbox_launcher.py` (see its docstring for
the process layout) and a fresh, size-limited working directory. Two isolation levels:

``namespaces`` (default on Linux where `unshare` works; root or unprivileged user namespaces)
    new mount, PID, network, IPC and UTS namespaces; the program sees a tmpfs root holding only
    read-only binds of the system library directories and the interpreter's prefix, a few
    device files and a writable ``/sandbox`` tmpfs; no network interfaces except a down
    loopback; it runs as an unprivileged uid with no capabilities, `no_new_privs` and a
    seccomp filter (no INET sockets, no mount/namespace/ptrace/bpf/io_uring syscalls).
``rlimits``
    the fallback where namespaces are unavailable: same rlimits, seccomp filter (all sockets
    denied) and empty environment, but the host filesystem stays visible (what the uid may
    read it can read).

In both, the program's environment is a fixed minimal set (no inherited variables), its
stdin/stdout/stderr are files capped by RLIMIT_FSIZE, and the wall-clock limit kills the
whole process group; as root each run also gets a uid of its own so RLIMIT_NPROC is
per-run and leftover processes are swept by uid. See packages/rl-envs/README.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

from pydantic import Field

from rl_envs.base import EnvConfig

logger = logging.getLogger(__name__)

IsolationMode = Literal["namespaces", "rlimits"]

_LAUNCHER = Path(__file__).with_name("_sandbox_launcher.py")
_SYSTEM_PATHS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
_DEVICE_FILES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
_SETUP_ERROR_EXIT = 125


class SandboxConfig(EnvConfig):
    """Limits of one sandboxed run."""

    cpu_time_s: int = Field(default=5, ge=1, description="RLIMIT_CPU (SIGXCPU, then SIGKILL 1 s later)")
    wall_time_s: float = Field(default=10.0, gt=0, description="the whole process group is killed after this")
    memory_mb: int = Field(default=1024, ge=64, description="RLIMIT_AS per process (address space)")
    max_processes: int = Field(
        default=32, ge=1, description="RLIMIT_NPROC (per run when a uid of its own is used)"
    )
    max_output_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1024,
        description="RLIMIT_FSIZE: cap on stdout, stderr and every written file",
    )
    max_open_files: int = Field(default=64, ge=16, description="RLIMIT_NOFILE")
    disk_mb: int = Field(
        default=64, ge=1, description="size of the writable /sandbox tmpfs (namespaces mode)"
    )
    isolation: Literal["auto", "namespaces", "rlimits"] = Field(
        default="auto",
        description="auto: namespaces when this machine allows them, else rlimits (with a warning)",
    )
    python_executable: str | None = Field(
        default=None, description="interpreter for programs; default: the real binary behind sys.executable"
    )
    readonly_paths: list[str] = Field(
        default_factory=list, description="extra absolute host paths made visible read-only (namespaces mode)"
    )
    uid_base: int = Field(
        default=2_000_000_000, ge=1000, description="as root: first uid of the per-run uid range"
    )
    uid_count: int = Field(default=4096, ge=1, description="as root: size of the per-run uid range")


@dataclass(frozen=True)
class SandboxResult:
    exit_code: int | None  # None when killed by a signal or the wall clock
    signal: int | None
    stdout: str
    stderr: str
    timed_out: bool
    output_limit_exceeded: bool
    cpu_limit_exceeded: bool
    wall_time_s: float
    isolation: IsolationMode

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class SandboxSetupError(RuntimeError):
    """Isolation could not be established; the untrusted program was not run."""


def default_interpreter() -> str:
    # A venv's python is usually a symlink; the real binary finds its stdlib without the venv.
    return os.path.realpath(sys.executable)


def _interpreter_prefix(interpreter: str) -> str:
    if os.path.realpath(sys.executable) == interpreter:
        return os.path.realpath(sys.base_prefix)
    return os.path.dirname(os.path.dirname(interpreter))


class _UidAllocator:
    """Hands out uids from a range, exclusively across threads and processes (flock)."""

    def __init__(self, base: int, count: int) -> None:
        self.base, self.count = base, count
        self.lock_dir = Path(tempfile.gettempdir()) / "rl-sandbox-uids"

    @contextlib.contextmanager
    def lease(self) -> Iterator[int]:
        self.lock_dir.mkdir(mode=0o700, exist_ok=True)
        start = random.randrange(self.count)
        for i in range(self.count):
            uid = self.base + (start + i) % self.count
            fd = os.open(self.lock_dir / f"{uid}.lock", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield uid
            finally:
                os.close(fd)  # releases the flock
            return
        raise SandboxSetupError(f"all {self.count} sandbox uids from {self.base} are in use")


def _processes_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real, effective, saved or fs uid is ``uid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    # Zombies hold no resources; their reaper (our ancestor's init) collects them.
                    if line.startswith("State:") and line.split()[1] in ("Z", "X"):
                        break
                    if line.startswith("Uid:"):
                        if str(uid) in line.split()[1:]:
                            pids.append(int(entry))
                        break
        except (OSError, IndexError):
            continue  # exited meanwhile
    return pids


def kill_uid(uid: int, deadline_s: float = 5.0) -> int:
    """SIGKILL every process running as ``uid`` until none is left; returns how many were killed."""
    killed = 0
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        pids = _processes_of_uid(uid)
        if not pids:
            return killed
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.01)
    raise SandboxSetupError(f"processes of sandbox uid {uid} survived SIGKILL for {deadline_s} s")


_probe_lock = threading.Lock()
_probe_cache: dict[str, IsolationMode] = {}


class Sandbox:
    """Runs Python programs under `SandboxConfig` limits. Thread-safe: runs are independent."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.interpreter = self.config.python_executable or default_interpreter()
        if not os.path.isabs(self.interpreter) or not os.access(self.interpreter, os.X_OK):
            raise ValueError(
                f"sandbox python_executable {self.interpreter!r} is not an executable absolute path"
            )
        for path in self.config.readonly_paths:
            if not os.path.isabs(path):
                raise ValueError(f"sandbox readonly_paths entry {path!r} must be an absolute path")
        self._as_root = os.geteuid() == 0
        self._uids = _UidAllocator(self.config.uid_base, self.config.uid_count) if self._as_root else None
        self.isolation = self._resolve_isolation()

    # ------------------------------------------------------------------ public
    def run_python(self, source: str, stdin: str = "", wall_time_s: float | None = None) -> SandboxResult:
        """Run ``source`` as a script with ``stdin``; never raises for anything the program does."""
        return self._run(source, stdin, self.isolation, wall_time_s or self.config.wall_time_s)

    # ------------------------------------------------------------------ internals
    def _resolve_isolation(self) -> IsolationMode:
        wanted = self.config.isolation
        if wanted != "auto":
            return wanted
        with _probe_lock:
            cached = _probe_cache.get(self.interpreter)
            if cached is None:
                probe = self._run("print('ok')", "", "namespaces", 30.0, raise_setup_errors=False)
                if probe.stdout.strip() == "ok":
                    cached = "namespaces"
                else:
                    cached = "rlimits"
                    logger.warning(
                        "sandbox: Linux namespaces are unavailable here (%s); falling back to rlimits-only "
                        "isolation: the host filesystem is readable by sandboxed programs. See the rl-envs "
                        "README for what is and is not guaranteed.",
                        probe.stderr.strip() or f"exit {probe.exit_code}",
                    )
                _probe_cache[self.interpreter] = cached
        return cached

    def _spec(self, tmp: Path, mode: IsolationMode, uid: int | None, status_fd: int) -> dict[str, object]:
        cfg = self.config
        work_dir = tmp / "work"
        home = "/sandbox" if mode == "namespaces" else str(work_dir)
        readonly = [*_SYSTEM_PATHS, _interpreter_prefix(self.interpreter), *cfg.readonly_paths]
        return {
            "mode": mode,
            "status_fd": status_fd,
            "new_root": str(tmp / "root"),
            "work_dir": str(work_dir),
            "program_path": str(work_dir / "main.py"),
            "interpreter": self.interpreter,
            "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"},
            "readonly_paths": list(dict.fromkeys(readonly)),
            "device_files": list(_DEVICE_FILES),
            "uid": uid,
            "gid": uid,
            "sandbox_size_bytes": cfg.disk_mb * 1024 * 1024,
            "limits": {
                "cpu_seconds": cfg.cpu_time_s,
                "address_space_bytes": cfg.memory_mb * 1024 * 1024,
                "processes": cfg.max_processes,
                "file_size_bytes": cfg.max_output_bytes,
                "open_files": cfg.max_open_files,
            },
        }

    def _run(
        self,
        source: str,
        stdin: str,
        mode: IsolationMode,
        wall_time_s: float,
        raise_setup_errors: bool = True,
    ) -> SandboxResult:
        uid_lease = self._uids.lease() if self._uids is not None else contextlib.nullcontext(None)
        with tempfile.TemporaryDirectory(prefix="rl-sandbox-") as tmp_name, uid_lease as uid:
            tmp = Path(tmp_name)
            # rlimits mode runs the program in this directory as the leased uid: let it traverse.
            os.chmod(tmp, 0o711)
            (tmp / "root").mkdir()
            (tmp / "work").mkdir()
            (tmp / "work" / "main.py").write_text(source, encoding="utf-8", errors="surrogatepass")
            (tmp / "stdin").write_text(stdin, encoding="utf-8", errors="surrogatepass")
            with (
                open(tmp / "stdin", "rb") as stdin_f,
                open(tmp / "stdout", "wb") as stdout_f,
                open(tmp / "stderr", "wb") as stderr_f,
                open(tmp / "status", "ab") as status_f,
            ):
                spec = self._spec(tmp, mode, uid, status_f.fileno())
                start = time.monotonic()
                timed_out = self._launch_and_wait(
                    spec, stdin_f, stdout_f, stderr_f, status_f, wall_time_s, uid
                )
                elapsed = time.monotonic() - start
            status_lines = (tmp / "status").read_text(errors="replace").splitlines()
            stdout_b = _read_capped(tmp / "stdout", self.config.max_output_bytes)
            stderr_b = _read_capped(tmp / "stderr", self.config.max_output_bytes)
        return self._result(status_lines, stdout_b, stderr_b, timed_out, elapsed, mode, raise_setup_errors)

    def _launch_and_wait(
        self,
        spec: dict[str, object],
        stdin_f: BinaryIO,
        stdout_f: BinaryIO,
        stderr_f: BinaryIO,
        status_f: BinaryIO,
        wall_time_s: float,
        uid: int | None,
    ) -> bool:
        proc = subprocess.Popen(
            [self.interpreter, "-I", "-S", "-B", str(_LAUNCHER), json.dumps(spec)],
            stdin=stdin_f,
            stdout=stdout_f,
            stderr=stderr_f,
            pass_fds=(status_f.fileno(),),
            close_fds=True,
            env={},
            cwd="/",
            start_new_session=True,
        )
        timed_out = False
        try:
            proc.wait(timeout=wall_time_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            # The launcher leads its own process group; anything left in it (or, as root,
            # anything still running as the run's uid) is killed before the uid is reused.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if uid is not None:
                kill_uid(uid)
        return timed_out

    def _result(
        self,
        status_lines: list[str],
        stdout_b: bytes,
        stderr_b: bytes,
        timed_out: bool,
        elapsed: float,
        mode: IsolationMode,
        raise_setup_errors: bool,
    ) -> SandboxResult:
        exit_code: int | None = None
        sig: int | None = None
        for line in status_lines:
            kind, _, value = line.partition(" ")
            if kind == "setup-error":
                if raise_setup_errors:
                    raise SandboxSetupError(f"sandbox ({mode}) could not start the program: {value}")
                stderr_b = value.encode() + b"\n" + stderr_b
                exit_code = _SETUP_ERROR_EXIT
            elif kind == "exit":
                exit_code = int(value)
            elif kind == "signal":
                sig = int(value)
        cap = self.config.max_output_bytes
        return SandboxResult(
            exit_code=None if timed_out else exit_code,
            signal=sig,
            stdout=stdout_b.decode("utf-8", errors="replace"),
            stderr=stderr_b.decode("utf-8", errors="replace"),
            timed_out=timed_out,
            output_limit_exceeded=len(stdout_b) >= cap or len(stderr_b) >= cap,
            cpu_limit_exceeded=sig in (signal.SIGXCPU,),
            wall_time_s=elapsed,
            isolation=mode,
        )


def _read_capped(path: Path, cap: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(cap)
