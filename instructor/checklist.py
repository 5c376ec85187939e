"""``make check-test FILE=tests/test_stage4_ddp.py``: what CONTRIBUTING's checklist for a graded test says, checked.

    python -m instructor checklist tests/test_stage4_ddp.py         # one file, public or hidden
    python -m instructor checklist tests/hidden/test_stage4_hidden.py

Adding a graded test touches several places (CONTRIBUTING.md, "The judge and its workers; adding a test"). This
command reads the test file and those places, without running anything, and prints one line per check:

* ``✓``/``✗`` each test has ``@pytest.mark.points(n)`` (or is marked ``gpu``: GPU checks carry no points) and the
  file or the test has exactly one ``stage<N>`` marker, the stage ``kit/stages.py`` gives the file;
* ``✓``/``✗`` each test's name is on a ``Tests:`` line (hidden tests: ``Hidden tests:``) of its stage's chapters;
* ``✓``/``✗`` each test has a reference time in ``tests/timings.json`` (``tests/hidden/timings.json``) — ``make
  timings STAGE=N`` records it;
* ``✓``/``⚠`` a catalogued mistake of the stage is known to fail it: the test named in the last recorded verdicts
  (``instructor/mutant-verdicts.md``, ``mutants-output/stage<N>.json``) or as a mutant's ``hidden_test``. This is a
  warning, not a failure: a mutant's ``expect`` names a message, not a test, so only a run of ``make mutants
  STAGE=N`` can say which test a new mistake fails.

It exits 1 when a line is ``✗``. The test file is read with :mod:`ast`, so a points or stage marker must be
written where it can be read: a decorator ``@pytest.mark.points(n)`` / ``@pytest.mark.stage<N>`` on the test (or
its class), or a module-level ``pytestmark`` holding them.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kit import stages as registry
from kit.grading.handout_check import parse_handout

ROOT = Path(__file__).resolve().parent.parent
VERDICTS = ROOT / "instructor" / "mutant-verdicts.md"
MUTANTS_OUTPUT = ROOT / "mutants-output"
STAGE_MARK = re.compile(r"^stage(\d+)$")


@dataclass
class TestInfo:
    """What the file says about one test function."""

    name: str
    line: int
    marks: set[str] = field(default_factory=set)  # marker names: points, stage4, gpu, hidden, …


@dataclass
class Line:
    ok: bool | None  # True ✓, False ✗, None ⚠ (a warning)
    text: str

    def render(self) -> str:
        return f"{'✓' if self.ok else '✗' if self.ok is False else '⚠'} {self.text}"


def _mark_names(node: ast.expr) -> set[str]:
    """Marker names in ``pytest.mark.x``, ``pytest.mark.x(…)`` or a list/tuple of them."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return set().union(*(_mark_names(e) for e in node.elts)) if node.elts else set()
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "mark":
        return {node.attr}
    return set()


def read_tests(path: Path) -> tuple[set[str], list[TestInfo]]:
    """The module-level marks (``pytestmark``) and each test function with its own marks (its class's included)."""
    tree = ast.parse(path.read_text(), str(path))
    module_marks: set[str] = set()
    tests: list[TestInfo] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            module_marks |= _mark_names(node.value)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            tests.append(TestInfo(node.name, node.lineno, set().union(*map(_mark_names, node.decorator_list))))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            class_marks = set().union(*map(_mark_names, node.decorator_list))
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    marks = class_marks | set().union(*map(_mark_names, item.decorator_list))
                    tests.append(TestInfo(item.name, item.lineno, marks))
    return module_marks, tests


def stage_of_file(path: Path, root: Path = ROOT) -> registry.Stage | None:
    """The stage whose test files (``kit/stages.py``) include ``path``."""
    resolved = path.resolve()
    return next((s for s in registry.STAGES if resolved in {p.resolve() for p in s.test_paths(root)}), None)


def handout_names(stage: registry.Stage, root: Path = ROOT) -> dict[str, set[str]]:
    """``{"Tests": names, "Hidden tests": names}`` over the stage's chapters, read as ``make check-handout`` reads
    them (:func:`kit.grading.handout_check.parse_handout`)."""
    found: dict[str, set[str]] = {"Tests": set(), "Hidden tests": set()}
    for chapter in stage.chapter_paths(root):
        if chapter.exists():
            for problem in parse_handout(chapter):
                found["Tests"] |= set(problem.tests)
                found["Hidden tests"] |= set(problem.hidden)
    return found


def timed_tests(path: Path, root: Path = ROOT) -> set[str]:
    """Test names of ``path`` that have a reference time in the timings file beside the suite."""
    hidden = "hidden" in path.resolve().relative_to(root.resolve()).parts
    timings = root / "tests" / ("hidden/timings.json" if hidden else "timings.json")
    if not timings.exists():
        return set()
    rel = path.resolve().relative_to(root.resolve()).as_posix()
    names = set()
    for node in json.loads(timings.read_text()).get("tests", {}):
        file, _, test = node.partition("::")
        if file == rel:
            names.add(test.split("[", 1)[0])
    return names


def mutant_targets(stage: int, root: Path = ROOT) -> set[str]:
    """Tests a catalogued mistake of ``stage`` is known to fail: the last recorded verdicts and the catalogue's
    ``hidden_test`` fields."""
    names: set[str] = set()
    verdicts = root / "instructor" / "mutant-verdicts.md"
    if verdicts.exists():
        section = re.search(rf"^## Stage {stage}\b.*?(?=^## |\Z)", verdicts.read_text(), re.M | re.S)
        for row in (section.group(0).splitlines() if section else []):
            cells = [c.strip() for c in row.strip().strip("|").split("|")]
            if len(cells) >= 3:
                names |= set(re.findall(r"\btest_\w+", cells[2]))
    output = root / "mutants-output" / f"stage{stage}.json"
    if output.exists():
        try:
            names |= {v["test"].split("[", 1)[0] for v in json.loads(output.read_text()) if v.get("test")}
        except (ValueError, TypeError, KeyError):
            pass
    catalogue = root / "tests" / "kit" / "mutants"
    if (catalogue / f"stage{stage}.py").exists():
        from instructor.mutants import load_catalogue

        names |= {m.hidden_test for m in load_catalogue(stage, catalogue) if m.hidden_test}
    return names


def checklist(path: Path, root: Path = ROOT) -> list[Line]:
    """The checklist's lines for one test file."""
    if not path.is_file():
        return [Line(False, f"{path}: no such file")]
    stage = stage_of_file(path, root)
    if stage is None:
        return [Line(False, f"{path}: kit/stages.py lists it under no stage (a graded test file is "
                            "tests/test_stage<N>_<topic>.py or tests/hidden/test_stage<N>_*.py)")]
    module_marks, tests = read_tests(path)
    if not tests:
        return [Line(False, f"{path}: no test functions found")]
    hidden = "hidden" in path.resolve().relative_to(root.resolve()).parts
    chapters = ", ".join(f"handout/{c}" for c in stage.chapters)
    listed = handout_names(stage, root)["Hidden tests" if hidden else "Tests"]
    timed = timed_tests(path, root)
    targets = mutant_targets(stage.number, root)
    timings = "tests/hidden/timings.json" if hidden else "tests/timings.json"
    lines: list[Line] = []
    for test in tests:
        marks = module_marks | test.marks
        where = f"{test.name} (line {test.line})"
        stages = sorted(m for m in marks if STAGE_MARK.match(m))
        has_points = "points" in marks or "gpu" in marks
        stage_ok = stages == [stage.marker]
        lines.append(Line(has_points and stage_ok,
                          f"{where}: points and marker" + ("" if has_points else " — no @pytest.mark.points(n)")
                          + ("" if stage_ok else f" — stage markers {stages or 'none'}, expected [{stage.marker}]")))
        if "gpu" in marks and "points" not in marks:
            continue  # a GPU check carries no points: no problem names it, the grader does not time it
        kind = "Hidden tests:" if hidden else "Tests:"
        lines.append(Line(test.name in listed, f"{where}: on a `{kind}` line of {chapters}"
                          + ("" if test.name in listed else " — add it to its problem's line")))
        lines.append(Line(test.name in timed, f"{where}: reference time in {timings}"
                          + ("" if test.name in timed else f" — run `make timings STAGE={stage.number}`")))
        lines.append(Line(True if test.name in targets else None,
                          f"{where}: a catalogued mistake fails it" + ("" if test.name in targets else
                          f" — none recorded: catalogue one (tests/kit/mutants/stage{stage.number}.py), "
                          f"then `make mutants STAGE={stage.number}`")))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m instructor checklist", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="test files (tests/test_stage<N>_*.py, tests/hidden/…)")
    args = parser.parse_args(argv)
    failed = 0
    for path in args.files:
        lines = checklist(path)
        print(f"{path}:")
        for line in lines:
            print("  " + line.render())
        failed += sum(line.ok is False for line in lines)
    print(f"{failed} unchecked item(s): see CONTRIBUTING.md, 'The judge and its workers; adding a test'" if failed
          else "every item checked (⚠: a warning)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
