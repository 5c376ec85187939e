"""Workers started as fresh interpreters: the start method of the portable path (:mod:`kit.setup.portable`).

The grader's workers are forked from a zygote that imported torch once (:mod:`.zygote`). That needs what only
Linux gives: forking a process that has imported torch (macOS does not support it: Apple's system libraries
are not fork-safe, and Python's own default there is ``spawn``), ``prctl`` so that a worker dies with the judge,
and ``/proc`` to check a pid before it is signalled. On the portable path each worker is instead a new
``python`` (``subprocess``: the ``spawn`` start method) that imports torch and the judge's test modules itself,
then serves requests exactly as a forked worker does (:func:`kit.spawn.worker.serve`). It costs an import of
torch per worker (1–3 CPU-seconds on a 2-core machine, granted to each new worker on top of its test's CPU
budget: :data:`STARTUP_CPU_S`) and needs nothing Linux-only: its output goes to files the judge created, its
channel is a socket pair, a thread ends it if the judge is gone, and psutil accounts for its CPU
(:mod:`.watch`).

:class:`Spawner` is the judge's side, with the interface of :class:`.zygote.Zygote` that :mod:`.parent` uses.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from .zygote import Child, _import_test_modules, _unnamed_file

__tracebackhide__ = True

STARTUP_CPU_S = 15.0  # what a fresh worker may spend importing torch and the test modules, beyond its test's budget
CONFINEMENT = "unconfined: the portable path (kit.setup.portable) runs a student's own checks, never a grade"


class Spawner:
    """Starts each worker as a fresh interpreter (see the module docstring)."""

    confinement = CONFINEMENT

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        # The workers' output files live here, unnamed, as the zygote's do.
        self.files = Path(tempfile.mkdtemp(prefix="kit-judge-files-"))
        self.exit_codes: dict[int, int] = {}
        self.processes: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()

    def wait_ready(self) -> None:
        """Nothing to wait for: each worker starts on its own."""

    def alive(self) -> bool:
        return True

    def poll_exits(self) -> None:
        """Reap the workers that exited, keeping their exit codes (128 + signal when killed)."""
        with self._lock:
            for pid, process in list(self.processes.items()):
                code = process.poll()
                if code is not None:
                    self.exit_codes[pid] = 128 - code if code < 0 else code
                    del self.processes[pid]

    def fork(self, env: dict[str, str], cwd: Path, name: str) -> Child:
        """A new worker with ``env`` added to the spawner's environment, running in ``cwd``; it imports the test
        modules the judge has imported from ``cwd/tests`` before serving (:mod:`kit.spawn.checkbook`)."""
        from .checkbook import test_modules

        self.poll_exits()
        modules = test_modules(cwd / "tests")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        stdout, stderr, stacks = (_unnamed_file(self.files) for _ in range(3))
        config = {"channel": theirs.fileno(), "stacks": stacks, "modules": modules, "judge": os.getpid(),
                  "path": [p for p in sys.path if p], "name": name}
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", "import sys; from kit.spawn.fresh import main; main(sys.argv[1])",
                 json.dumps(config)],
                pass_fds=[theirs.fileno(), stacks], env={**self.env, **env}, cwd=cwd, stdin=subprocess.DEVNULL,
                stdout=stdout, stderr=stderr)
        except OSError:
            for fd in (stdout, stderr, stacks):
                os.close(fd)
            raise
        finally:
            theirs.close()
        with self._lock:
            self.processes[process.pid] = process
        ours.setblocking(True)
        return Child(process.pid, Connection(ours.detach()), stdout, stderr, stacks, os.getpid(),
                     startup_cpu=STARTUP_CPU_S)

    def close(self, expected: set[int] = frozenset()) -> int:
        """Kill every worker still running (and what it started). Returns 0: without cgroups nothing tells a
        daemon a worker left behind from another process of the user's."""
        from .watch import TreeWatch

        with self._lock:
            processes = list(self.processes.values())
        for process in processes:
            for pid in TreeWatch([process.pid]).pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        for process in processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.poll_exits()
        shutil.rmtree(self.files, ignore_errors=True)
        return 0


def _end_with_the_judge(judge: int) -> None:
    """A worker whose judge is gone ends (what ``PR_SET_PDEATHSIG`` does for a forked one, portably)."""

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != judge:
                os._exit(0)

    threading.Thread(target=watch, name="kit-judge-watch", daemon=True).start()


def main(config_json: str) -> None:
    """In the new interpreter: import the judge's test modules, then serve its requests. Never returns."""
    code = 1
    try:
        config = json.loads(config_json)
        _end_with_the_judge(config["judge"])
        sys.path[:] = config["path"]
        _import_test_modules([], config["modules"])
        from .worker import serve

        serve(Connection(config["channel"]), config["stacks"], [m for m in config["modules"] if m in sys.modules])
        code = 0
    except BaseException:  # noqa: BLE001 — the worker reports through its channel; here only the exit code
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
