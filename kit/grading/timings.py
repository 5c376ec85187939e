"""Per-test time limits derived from each test's own reference duration.

``make timings`` (``python -m kit grade --impl reference --hidden --record-timings``) writes the
reference's setup, call and teardown seconds of every graded test to ``tests/timings.json`` (hidden
tests to ``tests/hidden/timings.json``, which never ships). A graded test then gets

    run limit      = min(cap, max(floor, factor × (largest setup in its file + its own call)))
    teardown limit = min(cap, max(floor, factor × largest teardown in its file))

seconds, where ``cap`` is ``--per-test-timeout`` (also the limit of tests with no recorded time). The
largest setup in the file, not the test's own: module-scoped fixtures (one spawn of every rank for a
whole file) charge their time to whichever test of the file uses them first, and after a crash the
resumed run starts in the middle of a file. For the same reason the first test a process runs from a
file may also take the file's longest setup + call: shared work cached in a module variable is paid
by whichever test gets there first. The defaults, ``factor`` 6 and ``floor`` 10 s, leave room for a
2-core machine under load, where a test can be 3× slower than when its time was recorded, so a stuck
test costs seconds to a minute instead of the cap.

This module is imported by the test process too (through the grading plugin): standard library only.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

FILES = ("tests/timings.json", "tests/hidden/timings.json")
FACTOR = 6.0
FLOOR = 10.0


@dataclass(frozen=True)
class Budget:
    """Seconds a test may take: ``run`` for setup and call together, ``teardown`` for its teardown."""

    run: float
    teardown: float

    @property
    def total(self) -> float:
        return self.run + self.teardown


def load(root: Path) -> dict[str, list[float]]:
    """``{nodeid: [setup, call, teardown]}`` from every timings file under ``root`` (missing files: none)."""
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
        self.timings, self.cap, self.factor, self.floor = timings, cap, factor, floor
        self.file_setup: dict[str, float] = {}
        self.file_run: dict[str, float] = {}  # longest setup + call
        self.file_teardown: dict[str, float] = {}
        for nodeid, (setup, call, teardown) in timings.items():
            f = nodeid.split("::")[0]
            self.file_setup[f] = max(self.file_setup.get(f, 0.0), setup)
            self.file_run[f] = max(self.file_run.get(f, 0.0), setup + call)
            self.file_teardown[f] = max(self.file_teardown.get(f, 0.0), teardown)

    def _limit(self, seconds: float) -> float:
        return min(self.cap, max(self.floor, self.factor * seconds))

    def budget(self, nodeid: str, *, first_in_file: bool = False) -> Budget:
        """The test's budget; ``first_in_file``: no test of its file has run yet in this process."""
        if nodeid not in self.timings:
            return Budget(self.cap, self.cap)
        f = nodeid.split("::")[0]
        run = self.file_setup[f] + self.timings[nodeid][1]
        return Budget(self._limit(max(run, self.file_run[f]) if first_in_file else run),
                      self._limit(self.file_teardown[f]))


def _write(path: Path, tests: dict[str, list[float]], command: str) -> None:
    header = {
        "about": "Reference seconds of each graded test's [setup, call, teardown]; the grader derives per-test "
                 "time limits from them (kit/grading/timings.py). Regenerate with `make timings`.",
        "recorded": {"machine": f"{os.cpu_count()} cores, {platform.machine()}, {platform.system()}",
                     "date": time.strftime("%Y-%m-%d"), "command": command},
    }
    lines = [f"  {json.dumps(k)}: {json.dumps(tests[k])}" for k in sorted(tests)]
    body = json.dumps(header, indent=2)[:-2] + ',\n  "tests": {\n  ' + ",\n  ".join(lines) + "\n  }\n}\n"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(body)
    tmp.replace(path)


def record(durations: dict[str, list[float]], root: Path, command: str) -> list[Path]:
    """Merge measured ``{nodeid: [setup, call, teardown]}`` into the timings files; return those written.

    A file's tests that were not measured this time are dropped when others of the same file were (they
    no longer exist); tests of files not graded this time keep their old times.
    """
    written = []
    for name in FILES:
        path = root / name
        folder = Path(name).parent.as_posix() + "/"
        mine = {k: [round(x, 2) for x in v] for k, v in durations.items()
                if k.startswith(folder) and "/" not in k[len(folder):].split("::")[0]}
        if not mine:
            continue
        old = json.loads(path.read_text())["tests"] if path.exists() else {}
        measured_files = {k.split("::")[0] for k in mine}
        kept = {k: v for k, v in old.items()
                if k.split("::")[0] not in measured_files and (root / k.split("::")[0]).exists()}
        _write(path, {**kept, **mine}, command)
        written.append(path)
    return written
