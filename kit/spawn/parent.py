"""The parent's side of a run: start the ranks, forward their stderr, collect their reports, dump stacks."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from pathlib import Path

from .rank import rank_main

__tracebackhide__ = True  # pytest: the kit's plumbing is not part of a student's traceback

POLL_S = 0.2  # how often the parent looks at the ranks while it waits
GRACE_S = 1.0  # after a first error, how long the other ranks get to report theirs


class Ranks:
    """The rank processes of one run, their report queue and their files (store, stderr, stacks)."""

    def __init__(self, fn, world_size, backend, folder, args, kwargs, timeout) -> None:
        ctx = mp.get_context("spawn")
        self.folder = folder
        self.queue = ctx.Queue()
        self.procs = [
            ctx.Process(target=rank_main, name=f"rank{r}", daemon=True,
                        args=(fn, r, world_size, backend, folder, args, kwargs, self.queue, timeout))
            for r in range(world_size)
        ]
        self.values: dict[int, bytes] = {}
        self.errors: dict[int, dict[str, str]] = {}  # in order of arrival: the first is the cause
        self._forwarded = [0] * world_size

    def start(self) -> None:
        for p in self.procs:
            p.start()

    def reported(self) -> int:
        return len(self.values) + len(self.errors)

    def receive(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for one report; False if none came."""
        self.forward_stderr()
        try:
            rank, status, payload = self.queue.get(timeout=max(timeout, 0.01))
        except queue.Empty:
            return False
        (self.values if status == "ok" else self.errors)[rank] = payload
        return True

    def drain(self, seconds: float) -> None:
        """Take the reports that arrive within ``seconds``, stopping early once every rank has reported."""
        until = time.monotonic() + seconds
        while self.reported() < len(self.procs) and time.monotonic() < until:
            self.receive(min(POLL_S, until - time.monotonic()))

    def silent(self) -> list[int]:
        """Ranks that exited abnormally without reporting (os._exit, a signal, gloo's abort, the OOM killer)."""
        return [r for r, p in enumerate(self.procs)
                if r not in self.values and r not in self.errors and not p.is_alive() and p.exitcode not in (0, None)]

    def forward_stderr(self) -> None:
        # What the ranks write to stderr reaches the parent's stderr (pytest's captured stderr) as it grows.
        for r in range(len(self.procs)):
            path = Path(self.folder) / f"stderr-{r}"
            if path.exists() and path.stat().st_size > self._forwarded[r]:
                with open(path, "rb") as f:
                    f.seek(self._forwarded[r])
                    data = f.read()
                self._forwarded[r] += len(data)
                os.write(2, data)

    def stderr_tail(self, rank: int, lines: int = 8) -> list[str]:
        path = Path(self.folder) / f"stderr-{rank}"
        text = path.read_text(errors="replace") if path.exists() else ""
        return [line for line in text.splitlines() if line.strip()][-lines:]

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Each live rank's Python stack (innermost call first), through the faulthandler it registered."""
        for r in ranks:
            if self.procs[r].is_alive() and self.procs[r].pid is not None:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(0.5)
        stacks = {}
        for r in ranks:
            path = Path(self.folder) / f"stack-{r}"
            stacks[r] = path.read_text().strip() if path.exists() else ""
        return stacks

    def stop(self) -> None:
        self.forward_stderr()
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 3
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1)
        self.queue.close()


def collect(ranks: Ranks, timeout: float) -> None:
    """Wait for every rank's report; stop early at the first error or a rank that died without one."""
    deadline = time.monotonic() + timeout
    while ranks.reported() < len(ranks.procs) and time.monotonic() < deadline:
        if ranks.receive(min(POLL_S, deadline - time.monotonic())):
            if ranks.errors:
                ranks.drain(GRACE_S)  # the others' errors, usually consequences, for the message
                return
        elif ranks.silent():
            ranks.drain(POLL_S)  # a report may still be in the pipe
            return
    time.sleep(0.1)  # a rank that just died: let is_alive() see it
