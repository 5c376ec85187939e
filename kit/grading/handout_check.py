"""Check that the handout, the tests and the points agree.

A common failure of course kits is a handout that names functions the tests no longer use, or points
that no longer add up. The handout states each graded problem as::

    ### Problem 4.2 — Bucketed DDP (12 points)
    Tests: `test_bucketed_matches_single_process`, `test_bucket_assignment`
    Hidden tests: `test_bucketed_uneven_sizes` (2 points)

and this module checks, against the collected test suite, that every named test exists in that stage,
that the points in the heading equal the sum of the named tests' points (all parametrisations counted),
that every graded test belongs to exactly one problem, and that nothing is left over. Which chapters
belong to which stage comes from the stage registry (:mod:`kit.stages`); a stage may have several.
Where ``tests/hidden`` is absent (the student release), ``Hidden tests:`` lines are not checked.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from kit import stages as registry

ROOT = Path(__file__).resolve().parents[2]
PROBLEM = re.compile(r"^###\s+Problem\s+(?P<stage>\d+)\.(?P<num>\d+)\s+[—-]+\s+(?P<title>.+?)\s+"
                     r"\((?P<kind>(?P<points>\d+(?:\.\d+)?)\s+points?|written[^)]*)\)\s*$")
TESTS_LINE = re.compile(r"^Tests:\s*(?P<names>.+)$")
HIDDEN_LINE = re.compile(r"^Hidden tests:\s*(?P<names>.+)$")
NAME = re.compile(r"`(test_\w+)`(?:\s*\((?P<points>\d+(?:\.\d+)?)\s+points?\))?")


@dataclass
class Problem:
    stage: int
    number: str
    title: str
    points: float | None  # None for written problems
    tests: list[str] = field(default_factory=list)
    hidden: dict[str, float | None] = field(default_factory=dict)
    where: str = ""


def parse_handout(path: Path) -> list[Problem]:
    problems: list[Problem] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if m := PROBLEM.match(line):
            points = float(m.group("points")) if m.group("points") else None
            problems.append(Problem(int(m.group("stage")), f"{m.group('stage')}.{m.group('num')}", m.group("title"),
                                    points, where=f"{path.name}:{lineno}"))
        elif line.startswith("### Problem"):
            problems.append(Problem(0, "?", line, None, where=f"{path.name}:{lineno} malformed heading"))
        elif problems and (m := TESTS_LINE.match(line)):
            problems[-1].tests += [n.group(1) for n in NAME.finditer(m.group("names"))]
        elif problems and (m := HIDDEN_LINE.match(line)):
            for n in NAME.finditer(m.group("names")):
                problems[-1].hidden[n.group(1)] = float(n.group("points")) if n.group("points") else None
    return problems


def collect_graded_tests(root: Path = ROOT) -> list[dict]:
    """Every graded test (public and hidden) with its points, stage and visibility, as pytest collects them."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "events.jsonl"
        cmd = [sys.executable, "-m", "pytest", "tests", "--collect-only", "-q", "-p", "kit", "-p", "no:cacheprovider",
               "-p", "kit.grading.plugin", f"--grading-log={log}", "--impl=reference", "-o", "addopts=",
               "--ignore=tests/kit"]
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
        events = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    collected = next((e["tests"] for e in events if e["event"] == "collected"), None)
    if collected is None:
        raise RuntimeError(f"could not collect the test suite:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return collected


def _function(nodeid: str) -> str:
    return nodeid.split("::")[-1].split("[")[0]


def _check_stage(stage: registry.Stage, root: Path, points: dict, claimed: dict, hidden_present: bool) -> list[str]:
    errors: list[str] = []
    n = stage.number
    problems: list[Problem] = []
    for chapter in stage.chapter_paths(root):
        if not chapter.exists():
            errors.append(f"kit/stages.py names handout/{chapter.name} for stage {n}, which does not exist")
            continue
        problems += parse_handout(chapter)
    for p in problems:
        if p.stage != n:
            errors.append(f"{p.where}: problem {p.number} is in a stage {n} chapter "
                          f"(headings read `### Problem {n}.k — Title (P points)`)")
            continue
        if p.points is None:
            if p.tests:
                errors.append(f"{p.where}: written problem {p.number} names tests; give it points instead")
            continue
        if not p.tests:
            errors.append(f"{p.where}: problem {p.number} has points but no `Tests:` line")
        total = 0.0
        for name in p.tests:
            key = (n, name, False)
            if key not in points:
                errors.append(f"{p.where}: problem {p.number} names `{name}`, which is not a graded stage {n} test")
                continue
            if key in claimed:
                errors.append(f"{p.where}: `{name}` is already claimed by problem {claimed[key]}")
            claimed[key] = p.number
            total += points[key]
        if abs(total - p.points) > 1e-9:
            errors.append(f"{p.where}: problem {p.number} says {p.points:g} points, its tests are worth {total:g}")
        for name, stated in p.hidden.items() if hidden_present else ():
            key = (n, name, True)
            if key not in points:
                errors.append(f"{p.where}: problem {p.number} names hidden `{name}`, which is not a hidden "
                              f"stage {n} test")
                continue
            claimed[key] = p.number
            if stated is not None and abs(stated - points[key]) > 1e-9:
                errors.append(f"{p.where}: hidden `{name}` is said to be worth {stated:g}, "
                              f"the test is worth {points[key]:g}")
    return errors


def check(root: Path = ROOT) -> list[str]:
    """Every disagreement between the handout and the suite, as readable lines (empty when all agree)."""
    errors: list[str] = []
    points: dict[tuple[int, str, bool], float] = defaultdict(float)
    for t in collect_graded_tests(root):
        points[(t["stage"], _function(t["nodeid"]), t["hidden"])] += t["points"]
    claimed: dict[tuple[int, str, bool], str] = {}
    hidden_present = (root / "tests" / "hidden").is_dir()
    for stage in registry.STAGES:
        errors += _check_stage(stage, root, points, claimed, hidden_present)
    known = set(registry.numbers())
    for key in sorted(points):
        stage, name, hidden = key
        if stage not in known:
            errors.append(f"test `{name}` is marked stage{stage}, but kit/stages.py has no stage {stage}")
        elif key not in claimed:
            errors.append(f"{'hidden ' if hidden else ''}test `{name}` (stage {stage}, {points[key]:g} points) "
                          "belongs to no problem in the handout")
    return errors


def main() -> int:
    errors = check()
    for e in errors:
        print(e)
    print("handout, tests and points agree" if not errors else f"{len(errors)} disagreement(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
