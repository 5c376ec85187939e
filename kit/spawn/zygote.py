"""The warm process every worker is forked from: torch and the kit imported once, then confined.

Starting a rank as a fresh interpreter costs an import of torch: 1–2 s per rank on a 2-core machine,
5 s for 8 ranks, before any test code runs. The zygote pays it once per session. It imports torch,
``torch.distributed``, the optimizers (with the ``torch._dynamo`` their first use pulls in), numpy, pytest,
Triton and the kit, confines itself (:mod:`kit.spawn.confine`; what it forks inherits the confinement),
and then forks one child per request: 2 ranks in ~0.05 s, 8 in ~0.2 s. It never runs a submission's code
itself; each child does, after the fork, in :mod:`kit.spawn.worker`. The judge starts it without waiting
(:meth:`Zygote.wait_ready`, at the first fork), so its imports overlap the judge's collection.

Protocol, over a Unix datagram socket pair with the process that started it (the judge):

* judge → zygote: ``{"id", "env", "cwd", "stdout", "stderr"}`` as JSON, with one file descriptor attached
  (the child's end of a fresh socket pair: the judge talks to the child directly on the other end);
* zygote → judge: ``{"ready", "confinement"}`` once, then ``{"id", "pid"}`` per fork and
  ``{"exited", "code"}`` when a child is reaped (``code``: exit status, or 128 + signal).

The judge trusts none of it (a child may have tampered with the zygote): pids are checked against
``/proc`` before they are signalled, and exit codes only ever go into messages.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from .confine import Rules

__tracebackhide__ = True

# Imported before the first fork; a name that fails to import is skipped (triton on a machine without it).
PRELOAD = ("numpy", "torch", "torch.distributed", "torch.nn.functional", "torch.utils._python_dispatch",
           "torch.testing", "pytest", "triton", "triton.language", "kit", "kit.checks", "kit.testing",
           "kit.comm_log", "kit.model", "kit.validate", "kit.spawn.worker")
# Imported as well by a zygote whose ranks may train. A process's first optimizer imports torch._dynamo
# (torch.optim wraps its constructors to keep dynamo out of them): 2.4 s of CPU per rank on a 2-core machine,
# more than the rest of a DDP test's rank (3.1 s → 0.55 s measured). The zygote pays it once (1.4 s more to
# start). A zygote started inside a worker (a benchmark driver the implementation runs, which spawns ranks to
# time collectives) does without: its ranks build no optimizer, and its start is on the test's clock.
TRAINING_PRELOAD = ("torch.optim", "torch._dynamo")
START_TIMEOUT_S = 120.0  # importing torch on a loaded machine
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


def _child(control: socket.socket, request: dict, fd: int) -> None:
    """In the forked child: become a worker on ``fd``. Never returns."""
    code = 1
    try:
        control.close()
        _die_with_parent()
        for name in ("stdout", "stderr"):
            target = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(target, 1 if name == "stdout" else 2)
            os.close(target)
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        from .worker import serve

        serve(Connection(fd))
        code = 0
    except BaseException:  # noqa: BLE001 — the child reports through its channel; here only the exit code
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def main(argv: list[str]) -> None:
    config = json.loads(argv[0])
    control = socket.socket(fileno=config["fd"])
    _die_with_parent()
    parent = os.getppid()
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
    _send(control, {"ready": True, "confinement": confinement, "pid": os.getpid()})
    while True:
        readable, _, _ = select.select([control], [], [], 0.05)
        _reap(control)
        if os.getppid() != parent:
            os._exit(0)
        if not readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 1)
        except OSError:
            os._exit(0)
        if not data:
            os._exit(0)
        request = json.loads(data)
        pid = os.fork()
        if pid == 0:
            _child(control, request, fds[0])
        for fd in fds:
            os.close(fd)
        _send(control, {"id": request["id"], "pid": pid})


# ----------------------------------------------------------------------------------------------------
# The judge's side
# ----------------------------------------------------------------------------------------------------


class ZygoteError(RuntimeError):
    """The zygote could not be started or stopped answering."""


@dataclass
class Child:
    """A forked worker: its pid and the judge's end of its channel."""

    pid: int
    conn: Connection
    stdout: Path
    stderr: Path
    stacks: Path  # where its faulthandler writes its Python stack when the judge asks (SIGUSR1)
    zygote_pid: int
    forwarded: dict[Path, int] = field(default_factory=dict)  # bytes of stdout/stderr already passed on

    def is_live_child(self) -> bool:
        """Whether this pid is still the zygote's child (checked before the judge signals it: a pid the
        zygote reported may since have been reused, and a tampered zygote may have lied)."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[1]) == self.zygote_pid
        except (OSError, ValueError, IndexError):
            return not sys.platform.startswith("linux")  # no /proc: trust the pid


class Zygote:
    """The judge's handle on one zygote process (see the module docstring)."""

    def __init__(self, scratch: Path, rules: Rules | None, env: dict[str, str],
                 preload: tuple[str, ...] = PRELOAD + TRAINING_PRELOAD):
        self.scratch = scratch
        self.exit_codes: dict[int, int] = {}
        self._lock = threading.Lock()
        self._next = 0
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.control = ours
        config = {"fd": theirs.fileno(), "sys_path": [p for p in sys.path if p],
                  "rules": None if rules is None else rules.__dict__, "preload": list(preload)}
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
        deadline = time.monotonic() + timeout
        while True:
            if until():
                return None
            left = deadline - time.monotonic()
            if left <= 0 or self.process.poll() is not None:
                code = self.process.poll()
                raise ZygoteError(f"the worker zygote failed {doing} "
                                  + (f"(it exited with code {code})" if code is not None else f"within {timeout:g} s"))
            readable, _, _ = select.select([self.control], [], [], min(left, 0.5))
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
        """A new child with ``env`` added to the zygote's environment, running in ``cwd``."""
        with self._lock:
            self.wait_ready()
            self._next += 1
            request_id = self._next
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            stdout, stderr, stacks = (self.scratch / f"{name}-{request_id}.{kind}" for kind in ("out", "err", "stack"))
            env = {**env, "KIT_WORKER_STACKS": str(stacks)}
            request = {"id": request_id, "env": env, "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr)}
            try:
                socket.send_fds(self.control, [json.dumps(request).encode()], [theirs.fileno()])
            except OSError as exc:
                raise ZygoteError(f"the worker zygote is gone ({exc})") from exc
            finally:
                theirs.close()
            reply = self._receive(lambda m: m.get("id") == request_id, 30.0, "to fork a worker")
        pid = reply.get("pid")
        if not isinstance(pid, int) or pid <= 0:
            raise ZygoteError(f"the worker zygote answered a fork with {reply!r}")
        ours.setblocking(True)
        return Child(pid, Connection(ours.detach()), stdout, stderr, stacks, self.process.pid)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.control.close()

