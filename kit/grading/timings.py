"""Per-test limits derived from each test's own reference run: CPU seconds, not the wall clock.

``make timings`` (``python -m instructor timings``) writes, for every
graded test, the reference's wall seconds of setup, call and teardown and the **CPU seconds its workers
used** in setup and call, to ``tests/timings.json`` (hidden tests to ``tests/hidden/timings.json``,
which never ships): ``[setup, call, teardown, cpu_setup, cpu_call]``. A graded test then gets

    CPU budget  = max(floor, factor × (largest CPU setup in its file + its own CPU call))
    idle limit  = IDLE seconds in which its workers make no progress (kit.spawn.watch)
    wall limit  = cap (``--per-test-timeout``): the last resort

The CPU budget is what tells a hang from a slow machine (:mod:`kit.spawn.watch`): a busy machine slows a
test's wall clock, not the CPU its workers need, so a correct test never meets it, and a spinning one meets
it after the same CPU time anywhere. A blocked one (a collective nobody joins) uses no CPU and meets the
idle limit. The largest setup in the file, not the test's own: module-scoped fixtures (one spawn of every
rank for a whole file) charge their work to whichever test of the file uses them first, and after a crash
the resumed run starts in the middle of a file. For the same reason the first test a process runs from a
file may take the file's longest setup + call. ``factor`` 6 and ``floor`` 10 CPU-seconds leave room for a
slower processor than the one that recorded the times.

This module is imported by the test process too (through the grading plugin): standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FILES = ("tests/timings.json", "tests/hidden/timings.json")
FACTOR = 6.0
FLOOR = 10.0
# CPU-seconds the judge itself may spend on one test's setup and call. Measured with the reference (stages 1-7
# and the hidden tests, time.process_time() around setup and call): at most 1.23 s, in the first test that
# needs torch in the judge (its import is 0.9-1.0 s of it), 0.54 s in any other. 12x that leaves room for a
# slower processor and a heavier import (torch with CUDA on a GPU machine), while an answer too costly to
# check stops the judge after seconds, not minutes.
JUDGE_CPU_LIMIT = 15.0  # the grading plugin's --judge-cpu-limit, and the grader's
IDLE = 30.0  # seconds without any CPU in a test's workers: blocked for good (kit.spawn.watch)


@dataclass(frozen=True)
class Budget:
    """A test's limits: ``cpu`` seconds of its workers' CPU in setup and call, ``run`` seconds of wall clock
    for setup and call together, ``teardown`` seconds of wall clock for its teardown."""

    cpu: float
    run: float
    teardown: float

    @property
    def total(self) -> float:
        return self.run + self.teardown


def load(root: Path) -> dict[str, list[float]]:
    """``{nodeid: [setup, call, teardown, cpu_setup, cpu_call]}`` from every timings file under ``root``
    (missing files: none; entries recorded before CPU was: no CPU figures)."""
    timings: dict[str, list[float]] = {}
    for name in FILES:
        path = root / name
        if path.exists():
            timings.update(json.loads(path.read_text())["tests"])
    return timings


class Limits:
    """The budget of each test, from recorded durations (see the module docstring for the formula)."""

    def __init__(self, timings: dict[str, list[float]], *, cap: float, factor: float = FACTOR,
                 floor: float = FLOOR):
        self.timings = {k: v for k, v in timings.items() if len(v) >= 5}
        self.cap, self.factor, self.floor = cap, factor, floor
        self.file_setup: dict[str, float] = {}  # largest CPU setup
        self.file_run: dict[str, float] = {}  # largest CPU setup + call
        for nodeid, (*_, cpu_setup, cpu_call) in self.timings.items():
            f = nodeid.split("::")[0]
            self.file_setup[f] = max(self.file_setup.get(f, 0.0), cpu_setup)
            self.file_run[f] = max(self.file_run.get(f, 0.0), cpu_setup + cpu_call)

    def budget(self, nodeid: str, *, first_in_file: bool = False) -> Budget:
        """The test's budget; ``first_in_file``: no test of its file has run yet in this process."""
        if nodeid not in self.timings:
            return Budget(float("inf"), self.cap, self.cap)
        f = nodeid.split("::")[0]
        cpu = self.file_setup[f] + self.timings[nodeid][4]
        cpu = max(cpu, self.file_run[f]) if first_in_file else cpu
        return Budget(max(self.floor, self.factor * cpu), self.cap, self.cap)
