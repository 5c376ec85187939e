"""Tests and points: what the child reported, turned into a grade the grader computes itself.

A test passes when its setup, call and teardown all passed; it then scores its ``points(n)``. Each test is
named by stage, handout problem and test — ``Stage 3 · P3.7 · test_bad_inputs_raise_clear_errors[fp16]``
— the same problem numbers as the gradebook's ``P3.7`` columns, so equal function names in two stages
stay apart.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kit import stages as registry
from kit.grading.events import RunRecord
from kit.setup.portable import NEEDS_TRITON

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("setup", "call", "teardown")


@dataclass
class TestResult:
    nodeid: str
    stage: int
    points: float
    hidden: bool
    score: float = 0.0
    status: str = "failed"  # passed | failed | skipped (needs what this machine lacks: kit.setup.portable.NEEDS_TRITON)
    output: str = ""
    doc: str = ""
    problem: str = ""  # handout problem number, e.g. "3.7"; "" when no problem names the test
    # wall seconds of setup, call, teardown; then the CPU seconds its workers used in setup and call
    durations: list[float] = field(default_factory=lambda: [0.0] * 5)
    title: str = ""  # unique readable name, set by score()

    @property
    def name(self) -> str:
        """The test within its file: ``test_x[param]`` or ``TestClass::test_x``."""
        return self.nodeid.split("::", 1)[-1] if "::" in self.nodeid else self.nodeid

    @property
    def function(self) -> str:
        return self.name.split("::")[-1].split("[")[0]


@dataclass
class GradeResult:
    submission: str
    tests: list[TestResult] = field(default_factory=list)
    status: str = "ok"  # ok | timeout | crashed | error | interrupted
    message: str = ""
    execution_time: float = 0.0
    output: str = ""
    flags: list[str] = field(default_factory=list)

    @property
    def score(self) -> float:
        return sum(t.score for t in self.tests)

    @property
    def max_score(self) -> float:
        return sum(t.points for t in self.tests)

    def by_stage(self) -> dict[int, tuple[int, int, float, float]]:
        """stage → (tests passed, tests, points, max points)."""
        table: dict[int, list] = {}
        for t in self.tests:
            row = table.setdefault(t.stage, [0, 0, 0.0, 0.0])
            row[0] += t.status == "passed"
            row[1] += 1
            row[2] += t.score
            row[3] += t.points
        return {s: tuple(v) for s, v in sorted(table.items())}


def problem_numbers(root: Path = ROOT) -> dict[tuple[int, str], str]:
    """(stage, test function) → handout problem number (``"3.7"``), from every stage's chapters."""
    from kit.grading.handout_check import parse_handout

    mapping = {}
    for stage in registry.STAGES:
        for chapter in stage.chapter_paths(root):
            if chapter.exists():
                for p in parse_handout(chapter):
                    for name in [*p.tests, *p.hidden]:
                        mapping[(p.stage, name)] = p.number
    return mapping


def _titles(tests: list[TestResult]) -> None:
    """``Stage 3 · P3.7 · test_x[fp16]``; the file is added where two would otherwise read the same."""
    for t in tests:
        t.title = " · ".join([f"Stage {t.stage}", *([f"P{t.problem}"] if t.problem else []), t.name])
    counts = Counter(t.title for t in tests)
    for t in tests:
        if counts[t.title] > 1:
            t.title += f" ({Path(t.nodeid.split('::')[0]).name})"


def score(record: RunRecord, problems: dict[tuple[int, str], str]) -> list[TestResult]:
    """One :class:`TestResult` per collected test, passed only if every phase passed."""
    tests = []
    for info in record.collected or []:
        t = TestResult(info["nodeid"], info["stage"], info["points"], info["hidden"], doc=info.get("doc", ""))
        t.problem = problems.get((t.stage, t.function), "")
        phases = record.reports.get(t.nodeid, {})
        t.durations = ([float(phases.get(w, {}).get("duration", 0.0)) for w in PHASES]
                       + [float(phases.get(w, {}).get("cpu", 0.0)) for w in PHASES[:2]])
        skipped = [p for p in phases.values() if p["outcome"] == "skipped" and NEEDS_TRITON in p.get("longrepr", "")]
        if all(phases.get(w, {}).get("outcome") == "passed" for w in PHASES):
            t.status, t.score = "passed", t.points
        elif skipped:  # not a failure of the submission, not a pass either: this machine cannot run it
            t.status, t.output = "skipped", f"skipped: {NEEDS_TRITON}"
        else:
            failed = [p for p in phases.values() if p["outcome"] != "passed"]
            if failed:
                t.output = "\n".join(f"[{p['when']} {p['outcome']}]\n{p['longrepr']}" for p in failed)
            else:
                t.output = "did not finish: the run stopped before this test reported"
        tests.append(t)
    _titles(tests)
    return tests
