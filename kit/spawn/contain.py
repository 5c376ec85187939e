"""Containment of a grading run by the kernel: a cgroup that kills everything in it, a network of its own.

A sweep of ``/proc`` (by process group, environment marker, parentage) misses what hides from it: a process
whose main thread left with the raw ``exit`` syscall while another thread runs shows ``Z`` and is alive; a
double-forked daemon that left the session and cleared its environment carries no marker. The kernel does not
miss them:

* **cgroup v2** (:class:`Cgroup`). Every process of a run is in the run's cgroup, and so is everything it
  forks, whatever it does to its session, environment or parent: a worker cannot move out (it has no
  capabilities and Landlock keeps it from ``/sys``). ``cgroup.kill`` (Linux ≥ 5.14) kills them all at once;
  ``cgroup.procs`` counts them first, so the result says how many were left running. The grader creates one
  per run (:mod:`kit.grading.sandbox`), the judge one per zygote below it (the submission's workers, and separately
  the trusted reference ranks). Needs a writable cgroup v2 hierarchy: root, or a delegated subtree.
* **A network namespace** (:func:`isolate_network`). Each zygote and the ranks it forks get a loopback of
  their own: no other run, no other submission and not the reference ranks can connect to their gloo
  listeners, and abstract Unix sockets (which live in the network namespace) are theirs alone. Needs
  ``CAP_SYS_ADMIN`` (a root grader) or unprivileged user namespaces.

Where the kernel refuses either, each function says why, ``kit doctor --grader`` reports it, and the run falls
back to the ``/proc`` sweeps (INSTRUCTOR.md, threat model). Everything here is Linux; elsewhere each reports that.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path

__all__ = ["Cgroup", "cgroup_support", "isolate_network", "network_support"]

CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


# ----------------------------------------------------------------------------------------------------
# cgroup v2
# ----------------------------------------------------------------------------------------------------


def _cgroup2_mount() -> Path | None:
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == "cgroup2":
                    return Path(fields[1])
    except OSError:
        pass
    return None


def own_cgroup() -> Path | None:
    """The cgroup v2 folder this process is in, or None (no cgroup v2, not Linux)."""
    mount = _cgroup2_mount()
    if mount is None:
        return None
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return mount / line[3:].strip().lstrip("/")
    except OSError:
        pass
    return None


class Cgroup:
    """One cgroup v2 folder that this process created: put processes in, count them, kill them all."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def create(cls, name: str, parent: Path | None = None) -> tuple[Cgroup | None, str]:
        """A new cgroup ``name`` below ``parent`` (default: this process's own); ``(None, why)`` if the kernel or
        the permissions do not allow one that can be killed as a whole."""
        parent = parent or own_cgroup()
        if parent is None:
            return None, "no cgroup v2 hierarchy is mounted"
        path = parent / name
        try:
            path.mkdir()
        except OSError as exc:
            return None, f"cannot create a cgroup in {parent}: {exc.strerror}"
        if not (path / "cgroup.kill").exists():
            path.rmdir()
            return None, "this kernel's cgroups have no cgroup.kill (Linux ≥ 5.14)"
        return cls(path), f"cgroup {path} (killed as a whole with cgroup.kill)"

    def add(self, pid: int) -> bool:
        """Move ``pid`` (and all its threads) into this cgroup; everything it forks from now on is in it too."""
        try:
            (self.path / "cgroup.procs").write_text(str(pid))
            return True
        except OSError:
            return False

    def pids(self) -> list[int]:
        """Every process in this cgroup and the cgroups below it."""
        found: list[int] = []
        for procs in [self.path / "cgroup.procs", *self.path.rglob("*/cgroup.procs")]:
            try:
                found += [int(p) for p in procs.read_text().split()]
            except (OSError, ValueError):
                pass
        return found

    def kill(self, *, spare: set[int] = frozenset(), wait: float = 2.0) -> int:
        """SIGKILL everything in it (``cgroup.kill``: no process escapes, whatever its state), wait until it is
        empty, remove it. Returns how many processes there were, not counting ``spare`` (ones expected there)."""
        count = len(set(self.pids()) - set(spare))
        try:
            (self.path / "cgroup.kill").write_text("1")
        except OSError:
            return count
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                if "populated 0" in (self.path / "cgroup.events").read_text():
                    break
            except OSError:
                break
            # cgroup.kill passes over a process whose main thread has exited while others run (Linux 6.18 does):
            # signal what is left one by one, which kills the whole thread group.
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.01)
        for child in sorted(self.path.rglob("*"), key=lambda p: -len(p.parts)):
            if child.is_dir():
                try:
                    child.rmdir()
                except OSError:
                    pass
        try:
            self.path.rmdir()
        except OSError:
            pass
        return count


def cgroup_support() -> str:
    """In words, whether this process can contain a run in a cgroup (``kit doctor --grader``)."""
    group, why = Cgroup.create(f"kit-probe-{os.getpid()}")
    if group is None:
        return f"no: {why}"
    group.kill()
    return "yes: each run in a cgroup of its own, killed as a whole with cgroup.kill"


# ----------------------------------------------------------------------------------------------------
# A network namespace
# ----------------------------------------------------------------------------------------------------


def _unshare(flags: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return 0 if libc.unshare(ctypes.c_int(flags)) == 0 else ctypes.get_errno()


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def isolate_network() -> str:
    """Move this process (it must not have started threads yet) into a new network namespace with its loopback up.
    Returns what was done, in words: ``"own network namespace: …"`` or ``"shared network: why"``."""
    if not sys.platform.startswith("linux"):
        return "shared network: network namespaces are Linux only"
    error = _unshare(CLONE_NEWNET)
    how = "own network namespace (loopback only)"
    if error:  # not root: a user namespace of our own may still make one (where unprivileged ones are allowed)
        uid, gid = os.getuid(), os.getgid()
        error = _unshare(CLONE_NEWUSER | CLONE_NEWNET)
        if error:
            return f"shared network: cannot create a network namespace ({os.strerror(error)})"
        try:
            Path("/proc/self/setgroups").write_text("deny")
            Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
            Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
        except OSError as exc:
            return f"shared network: a user namespace was created but not mapped ({exc.strerror})"
        how += ", in a user namespace"
    try:
        _loopback_up()
    except OSError as exc:
        return f"no network: the new namespace's loopback could not be brought up ({exc.strerror})"
    return how


def network_support() -> str:
    """In words, whether a run's workers can have a network namespace of their own (``kit doctor --grader``)."""
    if not sys.platform.startswith("linux"):
        return "no: network namespaces are Linux only"
    pid = os.fork()
    if pid == 0:
        os._exit(0 if isolate_network().startswith("own") else 1)
    _, status = os.waitpid(pid, 0)
    return ("yes: each zygote and its ranks get their own loopback" if os.waitstatus_to_exitcode(status) == 0
            else "no: the kernel refused a network namespace (needs root or unprivileged user namespaces)")
