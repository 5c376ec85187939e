"""The warm process every worker is forked from: torch and the kit imported once, then confined.

Starting a rank as a fresh interpreter costs an import of torch: 1–2 s per rank on a 2-core machine,
5 s for 8 ranks, before any test code runs. The zygote pays it once per session. It imports torch,
``torch.distributed``, the optimizers (with the ``torch._dynamo`` their first use pulls in), numpy, pytest,
Triton and the kit, confines itself (:mod:`kit.spawn.confine`; what it forks inherits the confinement),
and then forks one child per request: 2 ranks in ~0.05 s, 8 in ~0.2 s. It never runs a submission's code
itself; each child does, after the fork, in :mod:`kit.spawn.worker`. The judge starts it without waiting
(:meth:`Zygote.wait_ready`, at the first fork), so its imports overlap the judge's collection.

Protocol, over a Unix datagram socket pair with the process that started it (the judge):

* judge → zygote: ``{"id", "env", "cwd"}`` as JSON, with four file descriptors attached: the child's end of
  a fresh socket pair (the judge talks to the child directly on the other end), and the child's stdout, stderr
  and stack-dump files;
* zygote → judge: ``{"ready", "confinement"}`` once, then ``{"id", "pid"}`` per fork and
  ``{"exited", "code"}`` when a child is reaped (``code``: exit status, or 128 + signal).

The judge trusts none of it (a child may have tampered with the zygote): pids are checked against
``/proc`` before they are signalled, and exit codes only ever go into messages.

**The judge never opens a path a worker controls.** A worker's stdout, stderr and stack dumps go to files the
judge created itself, unnamed (``O_TMPFILE``: no path exists that a worker could replace by a link), and
reads through its own descriptors (``pread``). A worker that swaps paths in its scratch folder for links to
the hidden tests or ``/proc/self/environ`` changes nothing the judge reads.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from .confine import Rules
from .watch import ACCOUNTED, TreeWatch

__tracebackhide__ = True

# Imported before the first fork; a name that fails to import is skipped (triton on a machine without it). The kit's
# own names are strings (importing them here would be a cycle: kit.checks imports this package), so a move of one
# would skip it silently: tests/kit/test_architecture.py imports each name of KIT_PRELOAD.
LIBRARY_PRELOAD = ("numpy", "torch", "torch.distributed", "torch.nn.functional", "torch.utils._python_dispatch",
                   "torch.testing", "pytest", "triton", "triton.language")
KIT_PRELOAD = ("kit", "kit.checks", "kit.testing", "kit.comm_log", "kit.model", "kit.validate", "kit.spawn.worker")
PRELOAD = LIBRARY_PRELOAD + KIT_PRELOAD
# Imported as well by a zygote whose ranks may train. A process's first optimizer imports torch._dynamo
# (torch.optim wraps its constructors to keep dynamo out of them): 2.4 s of CPU per rank on a 2-core machine,
# more than the rest of a DDP test's rank (3.1 s → 0.55 s measured). The zygote pays it once (1.4 s more to
# start). A zygote started inside a worker (a benchmark driver the implementation runs, which spawns ranks to
# time collectives) does without: its ranks build no optimizer, and its start is on the test's clock.
TRAINING_PRELOAD = ("torch.optim", "torch._dynamo")
START_TIMEOUT_S = 120.0  # importing torch on a loaded machine: half of it without progress fails (see _receive)
WALL_FACTOR = 5  # … and at most this many times it of wall clock, however busy the machine
MAX_MESSAGE = 1 << 16


# ----------------------------------------------------------------------------------------------------
# The zygote process
# ----------------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    from .confine import _libc

    libc = _libc()
    if libc is not None:
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _send(control: socket.socket, message: dict) -> None:
    try:
        control.send(json.dumps(message).encode())
    except OSError:
        os._exit(0)  # the judge is gone


def _reap(control: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        _send(control, {"exited": pid, "code": 128 - code if code < 0 else code})


def _child(control: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked child: become a worker on ``fds[0]``, writing to ``fds[1:3]``, its stack dumps to ``fds[3]``.
    Never returns."""
    code = 1
    try:
        control.close()
        _die_with_parent()
        channel, stdout, stderr, stacks = fds
        for fd, target in ((stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        from .worker import serve

        serve(Connection(channel), stacks, [m for m in request.get("modules", []) if m in sys.modules])
        code = 0
    except BaseException:  # noqa: BLE001 — the child reports through its channel; here only the exit code
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _import_test_modules(path: list[str], names: list[str]) -> None:
    """Import the judge's test modules here, before the fork: the child then resolves checks from what they were
    before any submission code ran (:mod:`kit.spawn.checkbook`). One this process may not read (a hidden test's
    judge half) or that fails is skipped: the judge never asks a worker for a check from it."""
    for entry in path:
        if entry not in sys.path:
            sys.path.append(entry)
    for name in names:
        if name not in sys.modules and name not in _SKIPPED:
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: BLE001 — a module a worker cannot import is none of its business
                _SKIPPED.add(name)


_SKIPPED: set[str] = set()


def main(argv: list[str]) -> None:
    config = json.loads(argv[0])
    control = socket.socket(fileno=config["fd"])
    _die_with_parent()
    parent = os.getppid()
    contained = []
    # Contained before anything else runs, while this process has one thread (a user namespace needs that): its
    # own cgroup, which the judge kills as a whole, and its own loopback (kit.spawn.contain).
    if config.get("cgroup"):
        from .contain import Cgroup

        if not Cgroup(Path(config["cgroup"])).add(os.getpid()):
            contained.append("not in its cgroup")
    if config.get("isolate_network"):
        from .contain import isolate_network

        contained.append(isolate_network())
    sys.path[:] = config["sys_path"]
    for name in config.get("preload", PRELOAD):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 — an optional package (triton) may be missing or broken
            pass
    if config["rules"] is not None:
        from .confine import confine

        confinement = confine(Rules(**config["rules"]))
    else:
        confinement = "unconfined: not asked to (only the grader confines its workers)"
    confinement = "; ".join([confinement, *contained])
    _send(control, {"ready": True, "confinement": confinement, "pid": os.getpid()})
    while True:
        readable, _, _ = select.select([control], [], [], 0.05)
        _reap(control)
        if os.getppid() != parent:
            os._exit(0)
        if not readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 4)
        except OSError:
            os._exit(0)
        if not data:
            os._exit(0)
        request = json.loads(data)
        _import_test_modules(request.get("path", []), request.get("modules", []))
        pid = os.fork()
        if pid == 0:
            _child(control, request, fds)
        for fd in fds:
            os.close(fd)
        _send(control, {"id": request["id"], "pid": pid})


# ----------------------------------------------------------------------------------------------------
# The judge's side
# ----------------------------------------------------------------------------------------------------


class ZygoteError(RuntimeError):
    """The zygote could not be started or stopped answering."""


def _unnamed_file(folder: Path) -> int:
    """A new file with no name (``O_TMPFILE``; elsewhere created and unlinked at once), opened for reading and
    writing: the judge reads it through this descriptor only, so no path can be swapped for a link."""
    flags = os.O_RDWR | os.O_CLOEXEC
    if hasattr(os, "O_TMPFILE"):
        try:
            return os.open(folder, flags | os.O_TMPFILE, 0o600)
        except OSError:  # a file system without O_TMPFILE
            pass
    fd, path = tempfile.mkstemp(dir=folder)
    os.unlink(path)
    return fd


@dataclass
class Child:
    """A forked worker: its pid, the judge's end of its channel, and the judge's descriptors of its output files
    (read with ``pread``, never by path: see the module docstring)."""

    pid: int
    conn: Connection
    stdout: int
    stderr: int
    stacks: int  # where its faulthandler writes its Python stack when the judge asks (SIGUSR1)
    zygote_pid: int
    forwarded: dict[int, int] = field(default_factory=dict)  # bytes of stdout/stderr already passed on
    startup_cpu: float = 0.0  # CPU it may spend starting, beyond its first request's budget (kit.spawn.fresh)

    @staticmethod
    def size(fd: int) -> int:
        try:
            return os.fstat(fd).st_size if fd >= 0 else 0
        except OSError:
            return 0

    def read(self, fd: int, start: int = 0, limit: int = 1 << 24) -> bytes:
        """Up to ``limit`` bytes of one of its files from ``start`` (the judge's own descriptor; any offset the
        worker moved is left alone)."""
        size = self.size(fd)
        try:
            return os.pread(fd, min(size - start, limit), start) if size > start else b""
        except OSError:
            return b""

    def close_files(self) -> None:
        for fd in (self.stdout, self.stderr, self.stacks):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.stdout = self.stderr = self.stacks = -1  # a closed number may be reused by another file

    def is_live_child(self) -> bool:
        """Whether this pid is still the zygote's child (checked before the judge signals it: a pid the
        zygote reported may since have been reused, and a tampered zygote may have lied). Through ``/proc``, or
        psutil on the portable path (:mod:`kit.spawn.watch`)."""
        from .watch import ACCOUNTED, parent_pid

        parent = parent_pid(self.pid)
        return parent == self.zygote_pid if parent is not None else not ACCOUNTED  # no accounting: trust the pid


class Zygote:
    """The judge's handle on one zygote process (see the module docstring)."""

    def __init__(self, scratch: Path, rules: Rules | None, env: dict[str, str],
                 preload: tuple[str, ...] = PRELOAD + TRAINING_PRELOAD, *, contain: bool = False):
        """``contain``: the zygote and everything it forks get a cgroup of their own, killed as a whole when it is
        closed, and a network namespace of their own, where the kernel allows (:mod:`kit.spawn.contain`)."""
        self.scratch = scratch
        # The workers' output files live here, unnamed: a folder of the judge's own, never a worker's scratch.
        self.files = Path(tempfile.mkdtemp(prefix="kit-judge-files-"))
        self.exit_codes: dict[int, int] = {}
        self._lock = threading.Lock()
        self._next = 0
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.control = ours
        self.cgroup = None
        if contain:
            from .contain import Cgroup

            self.cgroup, _ = Cgroup.create(f"kit-zygote-{os.getpid()}-{id(self):x}")
        config = {"fd": theirs.fileno(), "sys_path": [p for p in sys.path if p],
                  "rules": None if rules is None else rules.__dict__, "preload": list(preload),
                  "cgroup": str(self.cgroup.path) if self.cgroup else None, "isolate_network": contain}
        self.process = subprocess.Popen([sys.executable, "-c", "import sys; from kit.spawn.zygote import main; "
                                         "main(sys.argv[1:])", json.dumps(config)],
                                        pass_fds=[theirs.fileno()], env=env, cwd=os.getcwd(),
                                        stdin=subprocess.DEVNULL)
        theirs.close()
        self._hello: dict | None = None  # the zygote's first message, once it has imported everything

    def wait_ready(self) -> None:
        """Wait until the zygote has imported everything and is serving (the constructor does not wait: the
        imports may overlap the judge's own work); ``ZygoteError`` if it dies or takes ``START_TIMEOUT_S``."""
        if self._hello is None:
            self._receive(lambda m: False, START_TIMEOUT_S, "to start", until=lambda: self._hello is not None)

    @property
    def confinement(self) -> str:
        """In words, how the zygote (and so every child) is confined."""
        self.wait_ready()
        return str(self._hello.get("confinement", "unknown"))

    def _receive(self, wanted, timeout: float, doing: str, until=lambda: False) -> dict | None:
        """The first message ``wanted`` accepts (None once ``until()``). ``timeout`` is judged as the checks' limits
        are (:class:`~kit.spawn.watch.TreeWatch`): the zygote fails after ``timeout / 2`` seconds without progress
        (no CPU used, not waiting for a core), or ``WALL_FACTOR × timeout`` of wall clock in all — a machine busy
        enough to slow the import of torch tenfold slows the start, it does not fail it."""
        watch = TreeWatch([self.process.pid])
        started = time.monotonic()
        while True:
            if until():
                return None
            watch.sample()
            wall = time.monotonic() - started
            stalled = watch.idle_for() > timeout / 2 if ACCOUNTED else wall > timeout
            if stalled or wall > WALL_FACTOR * timeout or self.process.poll() is not None:
                code = self.process.poll()
                why = (f"(it exited with code {code})" if code is not None else
                       f"within {wall:.0f} s (no progress for {watch.idle_for():.0f} s)" if stalled else
                       f"within {wall:.0f} s although it kept working")
                raise ZygoteError(f"the worker zygote failed {doing} {why}")
            readable, _, _ = select.select([self.control], [], [], 0.5)
            if not readable:
                continue
            message = self._parse(self.control.recv(MAX_MESSAGE))
            if message is not None and wanted(message):
                return message

    def _parse(self, data: bytes) -> dict | None:
        try:
            message = json.loads(data)
        except ValueError:
            return None
        if not isinstance(message, dict):
            return None
        if "ready" in message and self._hello is None:
            self._hello = message
            return None
        pid, code = message.get("exited"), message.get("code")
        if isinstance(pid, int) and isinstance(code, int):
            self.exit_codes[pid] = code
            return None
        return message

    def poll_exits(self) -> None:
        """Read the exit notices that have arrived (non-blocking)."""
        with self._lock:
            while select.select([self.control], [], [], 0)[0]:
                try:
                    self._parse(self.control.recv(MAX_MESSAGE))
                except OSError:
                    return

    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, env: dict[str, str], cwd: Path, name: str) -> Child:
        """A new child with ``env`` added to the zygote's environment, running in ``cwd``. The test modules the judge
        has imported from ``cwd/tests`` are imported in the zygote first (:mod:`kit.spawn.checkbook`)."""
        from .checkbook import test_modules

        modules = test_modules(cwd / "tests")
        with self._lock:
            self.wait_ready()
            self._next += 1
            request_id = self._next
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            files = [_unnamed_file(self.files) for _ in range(3)]  # stdout, stderr, stacks
            request = {"id": request_id, "env": env, "cwd": str(cwd), "name": name, "modules": modules,
                       "path": [p for p in sys.path if p]}
            try:
                socket.send_fds(self.control, [json.dumps(request).encode()], [theirs.fileno(), *files])
            except OSError as exc:
                for fd in files:
                    os.close(fd)
                raise ZygoteError(f"the worker zygote is gone ({exc})") from exc
            finally:
                theirs.close()
            try:
                # Importing new test modules first may take a while on a loaded machine, as the zygote's start does.
                reply = self._receive(lambda m: m.get("id") == request_id, START_TIMEOUT_S, "to fork a worker")
            except ZygoteError:
                for fd in files:
                    os.close(fd)
                raise
        pid = reply.get("pid")
        if not isinstance(pid, int) or pid <= 0:
            raise ZygoteError(f"the worker zygote answered a fork with {reply!r}")
        ours.setblocking(True)
        return Child(pid, Connection(ours.detach()), *files, self.process.pid)

    def close(self, expected: set[int] = frozenset()) -> int:
        """Stop the zygote and everything it started. Returns how many processes were still running besides the
        zygote and ``expected`` (workers the judge still holds): ones a worker left behind, killed with its cgroup
        (0 where there is no cgroup: the grader's sweep finds those)."""
        leftovers = 0
        if self.cgroup is not None:
            leftovers = self.cgroup.kill(spare={self.process.pid, *expected})
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.control.close()
        shutil.rmtree(self.files, ignore_errors=True)
        return leftovers

