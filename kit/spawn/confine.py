"""Confine the processes that run a submission: what they may read, write and signal (Linux Landlock).

The grader's workers run untrusted code. The verdict never depends on them behaving (the judge only
compares data they send), but a worker must not be able to reach *around* the judge either: rewrite the
kit or the tests on disk, read the reference solutions or the hidden tests' expectations, open the
grading log, signal or trace the judge. :func:`confine` applies these rules to the calling process and
everything it later forks, irreversibly:

* **read** only the Python installation and system directories, and in the graded tree only what the
  tests need (the kit, the submission, the public tests, the hidden tests' worker halves);
* **write** only the run's scratch folder (and ``/dev/shm``, ``/dev/null``);
* **signal and trace** only processes of the same confinement (Landlock scopes ptrace always, signals
  from ABI 6, Linux 6.12);
* no capabilities (a root grader's workers lose ``CAP_KILL``, ``CAP_DAC_OVERRIDE``, ``CAP_SYS_PTRACE``…)
  and ``no_new_privs`` (no setuid binary gives them back).

Landlock needs no privileges (Linux ≥ 5.13 with the Landlock LSM on, as Ubuntu ≥ 22.04 and Debian ≥ 12
have). Where it is missing, :func:`confine` says so and the run is graded unconfined: the verdict still
cannot be forged in-process, but files and the judge's siblings are reachable (INSTRUCTOR.md, threat model).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from dataclasses import dataclass, field

__all__ = ["Rules", "confine", "landlock_abi"]

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # the same on every Linux architecture
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_SET_DUMPABLE = 38, 24, 4

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR, MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = (
    1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12)
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

READ = EXECUTE | READ_FILE | READ_DIR
WRITE = (WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO | MAKE_SYM
         | REFER | TRUNCATE)
FILE_ONLY = EXECUTE | READ_FILE | WRITE_FILE | TRUNCATE | IOCTL_DEV  # the rights a rule on a plain file may hold

# Read-only everywhere a Python process and its libraries look: never a user's home, the graded tree or /tmp.
SYSTEM_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc", "/opt", "/proc", "/sys",
               "/dev", "/run", "/var/lib", "/snap", "/nix")
WRITABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/shm", "/dev/tty", "/dev/nvidia*", "/dev/dri")


@dataclass
class Rules:
    """Paths by access: ``read`` (files and directories beneath), ``list_only`` (directory names, no
    contents), ``write`` (read, create, change and delete beneath)."""

    read: list[str] = field(default_factory=list)
    list_only: list[str] = field(default_factory=list)
    write: list[str] = field(default_factory=list)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when there is none (not Linux, too old, or switched off)."""
    libc = _libc()
    if libc is None:
        return 0
    libc.syscall.restype = ctypes.c_long
    version = libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(int(version), 0)


def _handled(abi: int) -> int:
    rights = READ | WRITE | MAKE_CHAR | MAKE_BLOCK
    if abi < 2:
        rights &= ~REFER
    if abi < 3:
        rights &= ~TRUNCATE
    if abi >= 5:
        rights |= IOCTL_DEV
    return rights


def drop_privileges() -> None:
    """``no_new_privs`` and, for a root process, every capability gone (uid 0 keeps only what files allow)."""
    libc = _libc()
    if libc is None:
        return
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if os.geteuid() != 0:
        return
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    libc.syscall(126 if os.uname().machine == "x86_64" else 91, ctypes.byref(header), ctypes.byref(data))  # capset


def confine(rules: Rules) -> str:
    """Apply ``rules`` to this process and its future children. Returns what was applied, in words
    (``"landlock ABI 7: …"``, or why nothing could be)."""
    drop_privileges()
    abi = landlock_abi()
    if abi <= 0:
        return "unconfined: this kernel has no Landlock (Linux ≥ 5.13 with the Landlock LSM enabled)"
    libc = _libc()
    handled = _handled(abi)
    attr = _RulesetAttr(handled, 0, (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return f"unconfined: landlock_create_ruleset failed ({os.strerror(ctypes.get_errno())})"
    added: list[str] = []
    try:
        def allow(path: str, rights: int) -> None:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                return  # a path that does not exist here needs no rule
            try:
                is_dir = os.path.isdir(path)
                beneath = _PathBeneath((rights if is_dir else rights & FILE_ONLY) & handled, fd)
                if libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(beneath), 0) == 0:
                    added.append(path)
            finally:
                os.close(fd)

        for path in SYSTEM_DIRS:
            allow(path, READ)
        for pattern in WRITABLE_DEVICES:
            for path in glob.glob(pattern):
                allow(path, READ | WRITE | IOCTL_DEV)
        for path in rules.list_only:
            allow(path, READ_DIR)
        for path in rules.read:
            allow(path, READ)
        for path in rules.write:
            allow(path, READ | WRITE)
        if libc.syscall(_SYS_RESTRICT_SELF, ruleset, 0) != 0:
            return f"unconfined: landlock_restrict_self failed ({os.strerror(ctypes.get_errno())})"
    finally:
        os.close(ruleset)
    scopes = "signals and ptrace" if abi >= 6 else "ptrace (signals need Landlock ABI 6, Linux 6.12)"
    return (f"landlock ABI {abi}: reads {len(rules.read)} graded paths and the system, writes "
            f"{len(rules.write)} scratch paths, {scopes} scoped to the workers; {refuse_unix_sockets()}")


# seccomp: no new Unix sockets. Landlock does not govern connect() to a named Unix socket, so a worker could reach
# any socket file the grader's user may write (a container runtime's, another run's). A worker needs none: its
# channel to the judge is a socket pair made before it was confined, gloo speaks TCP, and socketpair() (a private
# pair, reaching nothing) stays allowed. NCCL's proxy does need them, so a machine with CUDA is left as it is.
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_NR_SOCKET = {"x86_64": 41, "aarch64": 198}
_AF_UNIX, _EACCES, _ENOSYS = 1, 13, 38
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def refuse_unix_sockets() -> str:
    """Make ``socket(AF_UNIX, …)`` fail with ``EACCES`` in this process and its children (seccomp; ``no_new_privs``
    is set by :func:`drop_privileges`). Returns what was done, in words."""
    from kit import cuda_present

    machine = os.uname().machine
    libc = _libc()
    if libc is None or machine not in _AUDIT_ARCH:
        return f"Unix sockets not filtered (seccomp filter written for x86_64 and aarch64, not {machine})"
    if cuda_present():
        return "Unix sockets allowed (NCCL's proxy needs them)"
    program = [
        _SockFilter(_LD_W_ABS, 0, 0, 4),  # arch
        _SockFilter(_JEQ_K, 1, 0, _AUDIT_ARCH[machine]),
        _SockFilter(_RET_K, 0, 0, _RET_ERRNO | _ENOSYS),  # another ABI (i386's socketcall): nothing a worker needs
        _SockFilter(_LD_W_ABS, 0, 0, 0),  # syscall number
        _SockFilter(_JGE_K, 4, 0, 0x40000000),  # x32's numbers: refused below, like another ABI
        _SockFilter(_JEQ_K, 0, 2, _NR_SOCKET[machine]),
        _SockFilter(_LD_W_ABS, 0, 0, 16),  # socket()'s first argument, the address family (low 32 bits)
        _SockFilter(_JEQ_K, 1, 0, _AF_UNIX),
        _SockFilter(_RET_K, 0, 0, _RET_ALLOW),
        _SockFilter(_RET_K, 0, 0, _RET_ERRNO | _EACCES),
    ]
    # x32 jumps (+4 from index 4) land on the EACCES return: refused too.
    filters = (_SockFilter * len(program))(*program)
    prog = _SockFprog(len(program), ctypes.cast(filters, ctypes.POINTER(_SockFilter)))
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        return f"Unix sockets not filtered (seccomp: {os.strerror(ctypes.get_errno())})"
    return "no new Unix sockets (seccomp)"


def keep_out_of_reach() -> None:
    """For the judge: no process of the same user may read or trace its memory (``/proc/PID/mem``, ptrace)."""
    libc = _libc()
    if libc is not None:
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
