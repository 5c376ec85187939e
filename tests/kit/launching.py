"""Starting real launchers from a test — torchrun, SLURM's daemons — and proving that none of them outlives it.

Every process a :class:`Processes` starts carries a marker in its environment (``LLMSYS_TEST_LAUNCH=<id>``)
that everything it starts inherits: torchrun's agents and ranks, munged, slurmctld, slurmd, the job's steps.
:meth:`Processes.leftovers` lists the live ones; :meth:`Processes.close` kills each process group it started,
then anything still marked. The fixture ``processes`` (``tests/kit/conftest.py``) closes after the test and
fails it if something was still running that the test did not expect to stop itself.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kit.grading.sandbox import processes as all_processes

MARKER = "LLMSYS_TEST_LAUNCH"
ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def free_port() -> int:
    """A TCP port nobody listens on now (the OS's choice; a rendezvous binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    """One started command: its process, its output file, how long it ran."""

    name: str
    proc: subprocess.Popen
    log: Path
    started: float
    seconds: float | None = None

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, chars: int = 4000) -> str:
        return f"--- {self.name} (exit {self.proc.returncode}, {self.seconds or 0:.1f} s) ---\n{self.output[-chars:]}"


@dataclass
class Processes:
    """The processes one test starts, all marked; see the module docstring."""

    folder: Path
    marker: str = field(default_factory=lambda: f"{os.getpid()}-{secrets.token_hex(6)}")
    runs: list[Run] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment, marked, with the repository importable and nothing inherited that would
        make a child think a launcher started it."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                            "PYTHONPATH", "KIT_RANK_FOLDER") and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
        return env | {MARKER: self.marker, "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"} | extra

    def start(self, name: str, cmd: list[str], *, env: dict[str, str] | None = None, cwd: Path = ROOT) -> Run:
        """Start ``cmd`` in its own session (it leads a process group), output into ``<folder>/<name>.log``."""
        log = self.folder / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env or self.env(), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        run = Run(name, proc, log, time.monotonic())
        self.runs.append(run)
        return run

    def wait(self, runs: list[Run], timeout: float, *, succeed: bool = True, grace: float = 10.0) -> list[Run]:
        """Wait for every run to exit, at most ``timeout`` seconds in all; past that, kill everything and fail.

        With ``succeed``, a run that exits non-zero gives the others ``grace`` seconds to stop by themselves
        (a launcher tears its job down), then everything is killed and the test fails at once with every run's
        output: a run launched wrongly fails the test in seconds, not at the timeout.
        """
        deadline, failed_at = time.monotonic() + timeout, None
        while True:
            for run in runs:
                if run.seconds is None and run.proc.poll() is not None:
                    run.seconds = time.monotonic() - run.started
                    if succeed and run.proc.returncode != 0 and failed_at is None:
                        failed_at = time.monotonic()
            pending = [r for r in runs if r.seconds is None]
            if not pending and failed_at is None:
                return runs
            now = time.monotonic()
            if not pending or now > deadline or (failed_at is not None and now > failed_at + grace):
                self.close()
                why = "failed" if failed_at is not None else f"still ran after {timeout:g} s"
                names = ", ".join(r.name for r in pending) or "none"
                raise AssertionError(f"a run {why}; killed everything (still running then: {names}).\n"
                                     + "\n".join(r.tail() for r in runs))
            time.sleep(0.1)

    def run(self, name: str, cmd: list[str], *, timeout: float, env: dict[str, str] | None = None,
            succeed: bool = True) -> Run:
        """Start ``cmd`` and wait for it (see :meth:`wait`)."""
        return self.wait([self.start(name, cmd, env=env)], timeout, succeed=succeed)[0]

    def leftovers(self) -> list[str]:
        """Live processes carrying this test's marker, as ``pid: command line``."""
        entry = f"{MARKER}={self.marker}".encode()
        found = []
        for pid, _, _, state, environ in all_processes():
            if pid != os.getpid() and state != "Z" and entry in environ:
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    cmdline = "?"
                found.append(f"{pid}: {cmdline.strip()[:200]}")
        return found

    def assert_none_left(self, after: float = 5.0) -> None:
        """Fail if a marked process is still alive ``after`` seconds from now (processes that are exiting get
        that long to finish)."""
        deadline = time.monotonic() + after
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, "processes left behind:\n" + "\n".join(left)

    def close(self) -> None:
        """Kill every process group this test started, then every marked process; reap what was ours."""
        for run in self.runs:
            if run.proc.poll() is None:
                try:
                    os.killpg(run.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        entry = f"{MARKER}={self.marker}".encode()
        for pid, _, _, state, environ in all_processes():
            if pid != os.getpid() and state != "Z" and entry in environ:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        for run in self.runs:
            try:
                run.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
