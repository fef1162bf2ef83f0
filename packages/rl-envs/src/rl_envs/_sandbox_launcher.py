"""Sandbox launcher: isolates itself, then execs the untrusted Python program.

Run as a script (``python -I -S -B _sandbox_launcher.py '<json spec>'``) by
`rl_envs.sandbox.Sandbox`; it must therefore use the standard library only and never import
`rl_envs`. The parent passes the program's stdin/stdout/stderr as fds 0/1/2 and an append-only
*status file* as the fd named by the spec's ``status_fd``, on which this script reports one line per event:

    exec                 the program is about to start (isolation is in place)
    exit <code>          the program exited normally
    signal <number>      the program was killed by a signal
    setup-error <text>   isolation could not be set up; the program never ran

Process tree in ``namespaces`` mode::

    launcher (host PID namespace, new mount/net/ipc/uts namespaces, root of the new filesystem)
      └─ init  (PID 1 of a new PID namespace; reaps; when it exits the kernel kills the namespace)
           └─ program (rlimits, unprivileged uid, no_new_privs, seccomp, then execve)

In ``rlimits`` mode there are no namespaces: init is an ordinary child and the parent sweeps
leftover processes by uid / process group.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import resource
import shutil
import signal
import struct
import sys
from typing import Any

SETUP_ERROR_EXIT = 125

# <linux/sched.h>
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
# <linux/mount.h>
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MNT_DETACH = 2
# statvfs f_flag bits -> the mount flags a read-only remount must keep (inside a user
# namespace the kernel refuses to clear flags that were locked by the outer namespace).
_STATVFS_TO_MS = {
    os.ST_NOSUID: MS_NOSUID,
    os.ST_NODEV: MS_NODEV,
    os.ST_NOEXEC: MS_NOEXEC,
    os.ST_NOATIME: MS_NOATIME,
    os.ST_NODIRATIME: MS_NODIRATIME,
    os.ST_RELATIME: MS_RELATIME,
}
# <linux/prctl.h>, <linux/seccomp.h>, <linux/filter.h>
PR_SET_PDEATHSIG = 1
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
BPF_LD_W_ABS = 0x20
BPF_JEQ_K = 0x15
BPF_JGE_K = 0x35
BPF_RET_K = 0x06
BPF_ALU_AND_K = 0x54
EPERM = 1
EACCES = 13
AF_UNIX = 1

# Per-architecture numbers: audit arch, then the syscalls the filter refers to.
_ARCH_TABLE: dict[str, dict[str, int]] = {
    "x86_64": {
        "audit_arch": 0xC000003E,
        "socket": 41,
        "clone": 56,
        "clone3": 435,
        "pivot_root": 155,
        "ptrace": 101,
        "mount": 165,
        "umount2": 166,
        "chroot": 161,
        "unshare": 272,
        "setns": 308,
        "keyctl": 250,
        "add_key": 248,
        "request_key": 249,
        "perf_event_open": 298,
        "bpf": 321,
        "userfaultfd": 323,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "open_by_handle_at": 304,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "open_tree": 428,
        "move_mount": 429,
        "fsopen": 430,
        "fsmount": 432,
        "mount_setattr": 442,
    },
    "aarch64": {
        "audit_arch": 0xC00000B7,
        "socket": 198,
        "clone": 220,
        "clone3": 435,
        "pivot_root": 41,
        "ptrace": 117,
        "mount": 40,
        "umount2": 39,
        "chroot": 51,
        "unshare": 97,
        "setns": 268,
        "keyctl": 219,
        "add_key": 217,
        "request_key": 218,
        "perf_event_open": 241,
        "bpf": 280,
        "userfaultfd": 282,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "open_by_handle_at": 265,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "open_tree": 428,
        "move_mount": 429,
        "fsopen": 430,
        "fsmount": 432,
        "mount_setattr": 442,
    },
}
# Syscalls the program never needs and that widen the attack surface (namespaces, mounts,
# tracing other processes, kernel keyrings, eBPF, io_uring which bypasses the socket filter).
_DENIED_SYSCALLS = tuple(
    name for name in _ARCH_TABLE["x86_64"] if name not in ("audit_arch", "socket", "clone", "clone3")
)
# clone() flags that create namespaces (the low byte of clone's flags is the exit signal).
_CLONE_NAMESPACE_FLAGS = (
    CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | 0x02000000
)
ENOSYS = 38
_X32_SYSCALL_BIT = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


_status_fd = -1


def _status(line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(_status_fd, (line.replace("\n", " ") + "\n").encode())


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)} (errno {errno})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {source} -> {target}")


def _write_file(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


# ---------------------------------------------------------------- namespaces and filesystem
def _enter_namespaces(as_root: bool) -> None:
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID
    if not as_root:
        # An unprivileged user gets the capabilities needed for the mounts below only inside a
        # user namespace of its own. Its uid is mapped to 1000 there (not 0), so the exec of
        # the program drops every capability.
        flags |= CLONE_NEWUSER
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")
    if not as_root:
        _write_file("/proc/self/setgroups", "deny")
        _write_file("/proc/self/uid_map", f"1000 {uid} 1")
        _write_file("/proc/self/gid_map", f"1000 {gid} 1")
    _check(_libc.sethostname(b"sandbox", ctypes.c_size_t(7)), "sethostname")


def _remount_readonly(target: str, keep_devices: bool) -> None:
    current = os.statvfs(target).f_flag
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID
    if not keep_devices:
        flags |= MS_NODEV
    for st_bit, ms_bit in _STATVFS_TO_MS.items():
        if current & st_bit:
            flags |= ms_bit
    _mount(None, target, None, flags)


def _bind_readonly(source: str, new_root: str, is_device: bool = False) -> None:
    target = new_root + source
    if os.path.islink(source):
        # Keep merged-/usr style symlinks (/lib -> usr/lib) as symlinks.
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if not os.path.lexists(target):
            os.symlink(os.readlink(source), target)
        return
    if not os.path.exists(source):
        return
    if os.path.isdir(source):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        with open(target, "a"):
            pass
    _mount(source, target, None, MS_BIND | MS_REC)
    _remount_readonly(target, keep_devices=is_device)


def _build_root(spec: dict[str, Any], uid: int | None, gid: int | None) -> None:
    new_root = spec["new_root"]
    # Nothing we mount may propagate back to the host's mount namespace.
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    for path in spec["readonly_paths"]:
        _bind_readonly(path, new_root)
    for path in spec["device_files"]:
        _bind_readonly(path, new_root, is_device=True)
    work = new_root + "/sandbox"
    os.makedirs(work, mode=0o755)
    size = int(spec["sandbox_size_bytes"])
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=0700")
    shutil.copyfile(spec["program_path"], work + "/main.py")
    os.symlink("sandbox", new_root + "/tmp")
    # POSIX semaphores (multiprocessing locks) live in /dev/shm.
    os.makedirs(new_root + "/dev/shm", mode=0o755, exist_ok=True)
    _mount("tmpfs", new_root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777")
    if uid is not None and gid is not None:
        os.chown(work, uid, gid)
        os.chown(work + "/main.py", uid, gid)
    # pivot_root(".", ".") stacks the old root under the new one; detaching it leaves the
    # host's filesystem unreachable from this mount namespace.
    os.chdir(new_root)
    syscalls = _ARCH_TABLE.get(platform.machine())
    if syscalls is None:
        raise SetupError(f"unsupported architecture {platform.machine()!r} for pivot_root")
    _check(_libc.syscall(ctypes.c_long(syscalls["pivot_root"]), b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", ctypes.c_int(MNT_DETACH)), "umount old root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


# ------------------------------------------------------------------------ program process
def _set_limits(limits: dict[str, int]) -> None:
    cpu = int(limits["cpu_seconds"])
    # Soft limit sends SIGXCPU, the hard limit one second later SIGKILL.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["address_space_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))


def _seccomp_program(allow_unix_sockets: bool) -> list[tuple[int, int, int, int]]:
    """A classic-BPF filter: deny the listed syscalls and namespace-creating clones with EPERM,
    sockets other than AF_UNIX (or all sockets) with EACCES; kill on a foreign syscall ABI."""
    arch = _ARCH_TABLE.get(platform.machine())
    if arch is None:
        raise SetupError(f"no seccomp syscall table for architecture {platform.machine()!r}")
    deny = SECCOMP_RET_ERRNO | EPERM
    deny_socket = SECCOMP_RET_ERRNO | EACCES
    prog: list[tuple[int, int, int, int]] = [
        (BPF_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (BPF_JEQ_K, 1, 0, arch["audit_arch"]),
        (BPF_RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS),
        (BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
    ]
    if platform.machine() == "x86_64":
        prog += [(BPF_JGE_K, 0, 1, _X32_SYSCALL_BIT), (BPF_RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS)]
    for name in _DENIED_SYSCALLS:
        prog += [(BPF_JEQ_K, 0, 1, arch[name]), (BPF_RET_K, 0, 0, deny)]
    prog += [
        # clone3 passes its flags in memory the filter cannot read: ENOSYS makes glibc use clone.
        (BPF_JEQ_K, 0, 1, arch["clone3"]),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | ENOSYS),
        # clone: allowed unless it asks for new namespaces.
        (BPF_JEQ_K, 0, 5, arch["clone"]),
        (BPF_LD_W_ABS, 0, 0, 16),  # low 32 bits of args[0] (flags)
        (BPF_ALU_AND_K, 0, 0, _CLONE_NAMESPACE_FLAGS),
        (BPF_JEQ_K, 0, 1, 0),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        (BPF_RET_K, 0, 0, deny),
    ]
    if allow_unix_sockets:
        prog += [
            (BPF_JEQ_K, 0, 4, arch["socket"]),
            (BPF_LD_W_ABS, 0, 0, 16),  # low 32 bits of args[0] (domain), little-endian
            (BPF_JEQ_K, 1, 0, AF_UNIX),
            (BPF_RET_K, 0, 0, deny_socket),
            (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        ]
    else:
        prog += [(BPF_JEQ_K, 0, 1, arch["socket"]), (BPF_RET_K, 0, 0, deny_socket)]
    prog.append((BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW))
    return prog


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _install_seccomp(allow_unix_sockets: bool) -> None:
    prog = _seccomp_program(allow_unix_sockets)
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buffer = ctypes.create_string_buffer(raw, len(raw))
    fprog = _SockFprog(len(prog), ctypes.cast(buffer, ctypes.c_void_p))
    _check(
        _libc.prctl(
            ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(fprog), 0, 0
        ),
        "seccomp",
    )


def _exec_program(spec: dict[str, Any], cwd: str, program: str, uid: int | None, gid: int | None) -> None:
    try:
        os.chdir(cwd)
        _set_limits(spec["limits"])
        if uid is not None and gid is not None:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        _check(_libc.prctl(ctypes.c_int(PR_SET_NO_NEW_PRIVS), ctypes.c_ulong(1), 0, 0, 0), "no_new_privs")
        _install_seccomp(allow_unix_sockets=spec["mode"] == "namespaces")
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        interpreter = spec["interpreter"]
        argv = [interpreter, "-I", "-S", "-B", "-X", "utf8", program]
        _status("exec")
        os.execve(interpreter, argv, spec["env"])
    except BaseException as exc:  # report, never fall through into the launcher's code
        hint = ""
        if isinstance(exc, PermissionError) and uid is not None:
            hint = (
                f" (uid {uid} cannot reach the interpreter or the working directory: choose a "
                "python_executable that every user may execute, e.g. /usr/bin/python3)"
            )
        _status(f"setup-error program: {type(exc).__name__}: {exc}{hint}")
    os._exit(SETUP_ERROR_EXIT)


def _run_init(spec: dict[str, Any], cwd: str, program: str, uid: int | None, gid: int | None) -> None:
    _libc.prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), 0, 0, 0)
    child = os.fork()
    if child == 0:
        _exec_program(spec, cwd, program, uid, gid)
    while True:  # as PID 1 we also reap orphans until the program itself is gone
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == child:
            if os.WIFSIGNALED(status):
                _status(f"signal {os.WTERMSIG(status)}")
            else:
                _status(f"exit {os.WEXITSTATUS(status)}")
            break
    os._exit(0)


def main() -> None:
    global _status_fd
    spec = json.loads(sys.argv[1])
    _status_fd = int(spec["status_fd"])
    # Forked helpers keep the fd; the exec'd program does not.
    os.set_inheritable(_status_fd, False)
    as_root = os.geteuid() == 0
    uid = spec.get("uid") if as_root else None
    gid = spec.get("gid") if as_root else None
    try:
        if spec["mode"] == "namespaces":
            _enter_namespaces(as_root)
            _build_root(spec, uid, gid)
            cwd, program = "/sandbox", "/sandbox/main.py"
        else:
            cwd, program = spec["work_dir"], spec["program_path"]
            if uid is not None and gid is not None:
                os.chown(cwd, uid, gid)
        pid = os.fork()
    except (SetupError, OSError) as exc:
        _status(f"setup-error {type(exc).__name__}: {exc}")
        os._exit(SETUP_ERROR_EXIT)
    if pid == 0:
        _run_init(spec, cwd, program, uid, gid)
    os.waitpid(pid, 0)
    os._exit(0)


if __name__ == "__main__":
    main()
