"""Tell a hang from a slow machine: watch the CPU time of a worker's process tree, not the clock.

A correct check on a busy machine is slow because its processes wait for a core: their CPU time still
grows, only more slowly. A broken one either spins (its CPU time grows without end) or blocks forever (a
collective no peer joins, a ``sleep``, a deadlock: its CPU time stops growing). So a check gets two limits
that the machine's load does not move:

* **CPU budget**: the CPU seconds its processes may use, a multiple of what the reference used (recorded in
  ``tests/timings.json``); a spin reaches it in the same CPU time on a quiet or a busy machine;
* **idle limit**: how long its processes may make no progress while the check is unfinished. A process
  waiting for a core still gets its share of one: 20 % of a core at a load of 10 on 2 cores, 4 % at a load
  of 50. A blocked one only polls (a collective no peer joins checks its socket and the store a few times a
  second: about 0.6 % of a core, whatever the load). So the tree counts as progressing while, over the last
  :data:`WINDOW_S` seconds, one of its processes used at least :data:`MIN_RATE` of a core (one: eight ranks
  that all poll add up to more, and make no progress either) — or spent at least :data:`MIN_DEMAND` of the window
  running or waiting in the run queue (``/proc/PID/schedstat``). The second test keeps a worker that the scheduler
  starves (a grader run under ``nice`` beside a full machine gets a tenth of a nice-0 process's share: under
  2 % of a core at a load of 40) from looking blocked: it wants a core all the time. A blocked process sleeps and
  is runnable only for its brief polls.

A wall-clock limit stays as the last resort (the caller's ``timeout``), far above both.

Linux reads ``/proc``. The portable path (:mod:`kit.setup.portable`: macOS, or ``LLMSYS_PORTABLE=1``) asks psutil
instead, the same figures through each system's own interface; without psutil there is no CPU accounting of
other processes and only the wall clock limits a check.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from kit.setup.portable import portable

try:
    import psutil
except ImportError:  # a GPU image without it: /proc on Linux; elsewhere, no accounting
    psutil = None

__all__ = ["ACCOUNTED", "Budget", "TreeWatch", "parent_pid"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
HAS_PROC = sys.platform.startswith("linux") and os.path.isdir("/proc/self") and not portable()
ACCOUNTED = HAS_PROC or psutil is not None  # whether other processes' CPU and parents can be read at all
WINDOW_S = 5.0  # progress is judged over the last few seconds, not one sample
MIN_RATE = 0.02  # of one core: a blocked tree's polling uses ~0.6 %
MIN_DEMAND = 0.5  # of the window running or runnable: a starved worker is runnable all the time, a blocked one rarely


@dataclass
class Budget:
    """The limits of one request: ``cpu`` seconds of CPU, ``idle`` seconds without any, ``wall`` seconds."""

    cpu: float = float("inf")
    idle: float = float("inf")
    wall: float = float("inf")


def _stat(pid: int) -> tuple[int, str, float] | None:
    """(parent pid, state, CPU seconds including reaped children) of a process, or None if it is gone (or
    cannot be read: no /proc and no psutil)."""
    if not HAS_PROC:
        return _stat_psutil(pid)
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return int(fields[1]), fields[0], (utime + stime + cutime + cstime) / _TICK


def _stat_psutil(pid: int) -> tuple[int, str, float] | None:
    if psutil is None:
        return None
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            times = process.cpu_times()
            state = "Z" if process.status() == psutil.STATUS_ZOMBIE else "R"
            return process.ppid(), state, times.user + times.system + times.children_user + times.children_system
    except (psutil.Error, OSError):
        return None


def _demand(pid: int) -> float | None:
    """Seconds process ``pid`` has run or waited in a run queue for a core (``/proc/PID/schedstat``: time on a CPU,
    then time runnable but waiting), or None where the kernel does not report it."""
    if not HAS_PROC:
        return None
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            on_cpu, waiting = (int(x) for x in f.read().split()[:2])
    except (OSError, ValueError):
        return None
    return (on_cpu + waiting) / 1e9


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid``; None if it is gone or cannot be read."""
    info = _stat(pid)
    return info[0] if info is not None else None


def _descendants_psutil(roots: list[int]) -> list[int]:
    found = list(roots)
    for root in roots:
        try:
            found += [c.pid for c in psutil.Process(root).children(recursive=True) if c.pid not in found]
        except (psutil.Error, OSError):
            pass
    return found


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _stat(int(entry))
            if info is not None:
                children.setdefault(info[0], []).append(int(entry))
    return children


@dataclass
class TreeWatch:
    """CPU time and progress of the processes rooted at ``roots`` (and everything they start), from now."""

    roots: list[int]
    cpu_seen: dict[int, float] = field(default_factory=dict)  # last CPU time read per pid (gone ones keep it)
    last_progress: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.monotonic)
    history: deque = field(default_factory=deque)  # (time, {pid: CPU seconds}) of the samples in the window
    demand_history: deque = field(default_factory=deque)  # (time, {pid: seconds running or runnable})

    def __post_init__(self) -> None:
        # What already ran (the persistent worker, a zygote it started earlier) counts from now: its CPU so far
        # was earlier requests'.
        self.baseline = {pid: info[2] for pid in (self.pids() if ACCOUNTED else [])
                         if (info := _stat(pid)) is not None}

    def pids(self) -> list[int]:
        """The roots and their live descendants."""
        if not HAS_PROC:
            return _descendants_psutil(self.roots) if psutil is not None else list(self.roots)
        children = _children_map()
        found, todo = [], list(self.roots)
        while todo:
            pid = todo.pop()
            if pid in found:
                continue
            found.append(pid)
            todo += children.get(pid, [])
        return found

    def sample(self) -> float:
        """Read the tree now; return its CPU seconds so far (since the roots started)."""
        if not ACCOUNTED:
            return 0.0
        for pid in self.pids():
            info = _stat(pid)
            if info is not None and info[1] != "Z":
                self.cpu_seen[pid] = max(self.cpu_seen.get(pid, 0.0), info[2] - self.baseline.get(pid, 0.0))
        now = time.monotonic()
        self.history.append((now, dict(self.cpu_seen)))
        demands = {pid: d for pid in self.cpu_seen if (d := _demand(pid)) is not None}
        self.demand_history.append((now, demands))
        for history in (self.history, self.demand_history):
            while history and history[0][0] < now - WINDOW_S:
                history.popleft()
        start, before = self.history[0]
        span = max(now - start, 1e-9)
        # Progress is one process working, not many polling: 8 ranks blocked in gloo poll at ~0.6 % each.
        busiest = max((cpu - before.get(pid, 0.0) for pid, cpu in self.cpu_seen.items()), default=0.0)
        # Or one process wanting a core most of the window (running or queued), however little it gets.
        demand_start, demand_before = self.demand_history[0]
        demand_span = now - demand_start
        wanting = max((d - demand_before[pid] for pid, d in demands.items() if pid in demand_before), default=0.0)
        starved = demand_span >= WINDOW_S / 2 and wanting >= MIN_DEMAND * demand_span
        if now - self.started < WINDOW_S or busiest >= MIN_RATE * span or starved:
            self.last_progress = now
        return sum(self.cpu_seen.values())

    def idle_for(self) -> float:
        """Seconds since the tree last made progress (see the module docstring; 0 where nothing is accounted)."""
        return time.monotonic() - self.last_progress if ACCOUNTED else 0.0

    def wall(self) -> float:
        return time.monotonic() - self.started
