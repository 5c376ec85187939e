"""The misconception catalogue and the alternative designs stay in step with the reference (``make mutants``).

Running every mutant takes an hour, so CI does not; what CI can check cheaply is that the catalogue still
describes the reference (each patch applies and yields valid Python), that each stage has the mistakes and
designs issue 12 asks for, and that the runner tells a killed mutant from a survivor and from a stale one.
"""

from __future__ import annotations

import ast
import re
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from instructor import mutants
from instructor.designs import build, load_designs, load_shortcuts, shortcut_expectation
from instructor.release import solution_blocks
from kit import stages

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "reference"
MAX_SHARED_LINES = 30  # a design's definitions may quote the reference briefly, not copy it


def _hidden_test_names(stage: int) -> set[str]:
    names = set()
    for path in (ROOT / "tests" / "hidden").glob(f"test_stage{stage}*.py"):
        tree = ast.parse(path.read_text())
        names |= {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    return names


@pytest.mark.parametrize("stage", stages.numbers())
def test_catalogue_applies_to_the_reference(stage: int, tmp_path: Path) -> None:
    catalogue = mutants.load_catalogue(stage)
    # Every module a student writes code in has at least one catalogued mistake: without one there is no evidence
    # that its tests tell a wrong answer from a right one.
    written = sorted({b.path.relative_to("reference").as_posix() for b in solution_blocks()
                      if b.path.relative_to("reference").parts[0].removesuffix(".py") in stages.get(stage).modules})
    bare = [module for module in written if not any(m.file == module for m in catalogue)]
    assert not bare, (f"stage {stage}: no catalogued mistake in {bare} (tests/kit/mutants/stage{stage}.py): add the "
                      "mistakes the handout warns about for the code written there")
    hidden = _hidden_test_names(stage)
    for mutant in catalogue:
        package = tmp_path / mutant.name
        target = package / mutant.file
        target.parent.mkdir(parents=True)
        shutil.copy2(REFERENCE / mutant.file, target)
        mutants.apply(mutant, package)  # LookupError names the mutant when its find text drifted
        try:
            compile(target.read_text(), str(target), "exec")
        except SyntaxError as exc:
            pytest.fail(f"stage {stage} mutant {mutant.name}: the patched {mutant.file} is not valid Python "
                        f"({exc.msg}, line {exc.lineno}); a mutant must be a mistake a student could run")
        assert mutant.find != mutant.replace, f"stage {stage} mutant {mutant.name}: replace equals find"
        assert mutant.mistake.strip(), f"stage {stage} mutant {mutant.name}: say what the mistake is"
        re.compile(mutant.expect)  # a bad regex fails here, not after an hour of mutants
        if mutant.survives:
            assert mutant.hidden_test in hidden, (
                f"stage {stage} mutant {mutant.name} is a justified survivor, so it must name the hidden test "
                f"that catches it; {mutant.hidden_test!r} is not a test in tests/hidden/test_stage{stage}*.py")


def _longest_shared_run(a: str, b: str) -> int:
    """The longest run of consecutive non-blank lines two texts share (whitespace at the ends ignored)."""
    x, y = [line.strip() for line in a.splitlines()], [line.strip() for line in b.splitlines()]
    best, previous = 0, [0] * (len(y) + 1)
    for i in range(1, len(x) + 1):
        current = [0] * (len(y) + 1)
        for j in range(1, len(y) + 1):
            if x[i - 1] and x[i - 1] == y[j - 1]:
                current[j] = previous[j - 1] + 1
                best = max(best, current[j])
        previous = current
    return best


@pytest.mark.parametrize("stage", stages.numbers())
def test_every_design_builds_and_holds_only_its_own_definitions(stage: int, tmp_path: Path) -> None:
    """Cheap, on every commit: a design whose overrides no longer fit the reference fails here, not on the day CI
    rotates to its stage; and a design that copies the reference would have to be merged by hand at every change."""
    designs = load_designs(stage)
    required = stages.get(stage).designs_required
    assert len(designs) >= required, (
        f"stage {stage}: {len(designs)} alternative designs under tests/kit/designs/stage{stage}/; its registry entry "
        f"asks for {required} (a stage whose tests observe collectives, hooks or event order needs designs that "
        "prove they judge behaviour, not the reference's internals)")
    for design in designs:
        readme = design / "README.md"
        assert readme.exists() and readme.read_text().strip(), (
            f"design {design.name}: README.md's first line must say how the design differs from the reference")
        package = tmp_path / design.name
        shutil.copytree(REFERENCE, package, ignore=shutil.ignore_patterns("__pycache__"))
        for rel in build(design, package):  # OverrideError when a design no longer fits the reference
            compile((package / rel).read_text(), str(package / rel), "exec")
            shared = _longest_shared_run((design / rel).read_text(), (REFERENCE / rel).read_text())
            assert shared <= MAX_SHARED_LINES, (
                f"design {design.name} shares a run of {shared} lines with reference/{rel}: a design holds only what "
                f"it writes differently (at most {MAX_SHARED_LINES} in common: instructor/overrides.py merges it)")


@pytest.mark.parametrize("stage", stages.numbers())
def test_every_shortcut_builds_and_says_what_must_catch_it(stage: int, tmp_path: Path) -> None:
    """Cheap, on every commit: each library shortcut (tests/kit/shortcuts) still fits the reference, and its README
    says what it skips and which message must fail it (``make mutants`` judges it)."""
    for shortcut in load_shortcuts(stage):
        summary, expect = shortcut_expectation(shortcut)  # OverrideError without an 'expect:' line
        assert summary and re.compile(expect), f"shortcut {shortcut.name}: README.md's first line says what it skips"
        package = tmp_path / shortcut.name
        shutil.copytree(REFERENCE, package, ignore=shutil.ignore_patterns("__pycache__"))
        for rel in build(shortcut, package):
            compile((package / rel).read_text(), str(package / rel), "exec")


@pytest.fixture(scope="module")
def stage1_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = mutants.build_tree(tmp_path_factory.mktemp("mutant-tree"))
    (tree / "student").rename(tree / "student.pristine")
    return tree


def test_runner_reports_a_killed_mutant_with_the_test_and_message(stage1_tree: Path) -> None:
    wrong_scale = mutants.Mutant(
        "scale-by-d", "benchmarking.py",
        find="scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])",
        replace="scores = q @ k.transpose(-2, -1) / q.shape[-1]",
        mistake="scales the scores by 1/d", expect="attention|output")
    verdict = mutants.judge(1, wrong_scale, stage1_tree, timeout=300)
    assert verdict.verdict == "killed", verdict
    assert verdict.test.startswith("test_annotated_attention"), verdict
    unpointed = replace(wrong_scale, expect="a message no test prints")
    assert mutants.judge(1, unpointed, stage1_tree, timeout=300).verdict == "unpointed"


def test_a_mutant_run_stops_at_the_first_failure_that_points_at_the_mistake(stage1_tree: Path) -> None:
    """Stopping early never changes a verdict: it ends at the first failure whose message matches, and a
    pattern no failure matches runs every test, as the whole run would."""
    import xml.etree.ElementTree as ET

    from instructor.trials import failures, run_tests

    def ran(junit: Path) -> list[str]:
        return [case.get("name", "") for case in ET.parse(junit).getroot().iter("testcase")]

    package = stage1_tree / "student"
    shutil.rmtree(package, ignore_errors=True)
    shutil.copytree(stage1_tree / "student.pristine", package)
    mutants.apply(mutants.Mutant("scale-by-d", "benchmarking.py",
                                 find="scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])",
                                 replace="scores = q @ k.transpose(-2, -1) / q.shape[-1]", mistake=""), package)
    _, whole, _ = run_tests(stage1_tree, 1, timeout=300)
    every_failure = failures(whole)
    assert every_failure, "the mutant must fail some stage 1 test for this check to mean anything"
    first_name = every_failure[0][0]
    _, stopped, _ = run_tests(stage1_tree, 1, stop_when=re.escape(every_failure[0][1][:40]), timeout=300)
    assert ran(stopped)[-1] == first_name and len(ran(stopped)) < len(ran(whole)), ran(stopped)
    _, unmatched, _ = run_tests(stage1_tree, 1, stop_when="a message no test prints", timeout=300)
    assert ran(unmatched) == ran(whole) and failures(unmatched) == every_failure


def test_the_stop_matches_the_message_the_verdict_reads() -> None:
    """pytest shortens a long message for the junit report the verdict is judged on: a pattern that only the
    dropped lines match must not stop the run (it did, and two stage 7 mutants read as unpointed)."""
    from types import SimpleNamespace

    from instructor.stop_on_match import junit_message

    long = "x" * 450 + "\nthe gradient is off\nrank 0: the parameter w after the first step is 1.0"
    report = SimpleNamespace(longrepr=SimpleNamespace(reprcrash=SimpleNamespace(message=long)))
    assert junit_message(report).startswith("x" * 450)
    assert not re.search(r"parameter .* after the first step", junit_message(report), re.I | re.S)


def test_runner_reports_survivors_and_stale_entries(stage1_tree: Path) -> None:
    harmless = mutants.Mutant("comment-only", "benchmarking.py", find="import math\n",
                              replace="import math  # a change no test can see\n", mistake="none")
    assert mutants.judge(1, harmless, stage1_tree, timeout=300).verdict == "survived"
    unexplained = replace(harmless, survives="cosmetic")
    assert mutants.judge(1, unexplained, stage1_tree, timeout=300).verdict == "hidden-missed"
    stale = mutants.Mutant("stale", "benchmarking.py", find="text that is not in the module", replace="x",
                           mistake="none")
    verdict = mutants.judge(1, stale, stage1_tree, timeout=300)
    assert verdict.verdict == "stale" and "update the catalogue" in verdict.message


def _reference_tree(dest: Path) -> Path:
    """A stand-in for ``build_tree`` where the judging is stubbed: the reference staged as the student package."""
    shutil.copytree(REFERENCE, dest / "tree" / "student")
    return dest / "tree"


def test_budget_starts_no_new_mutant_after_it_and_names_the_rest(monkeypatch, tmp_path: Path) -> None:
    """CI's ``--budget``: at least one item per stage is judged, none starts after the budget, and the report
    names those left over (the runner's own logic: the judging is stubbed, each 'mutant' taking 0.2 s)."""

    def fake_judge(stage, mutant, tree, timeout):
        time.sleep(0.2)
        return mutants.Verdict(stage, mutant.name, mutant.mistake, "killed")

    monkeypatch.setattr(mutants, "judge", fake_judge)
    monkeypatch.setattr(mutants, "build_tree", _reference_tree)
    catalogue = mutants.load_catalogue(1)
    verdicts = mutants.run([1], budget=0.5, baseline=False, designs=False, out=tmp_path, jobs=1)
    assert 1 <= len(verdicts) <= 4, [v.name for v in verdicts]  # 0.2 s each: the fourth would start after 0.6 s
    report = (tmp_path / "stage1.md").read_text()
    left = re.search(r"Not run within the 0.5 s budget \((\d+);.*\): (.*)", report)
    assert left, report
    assert int(left.group(1)) == len(catalogue) - len(verdicts)
    named = set(left.group(2).split(", ")) | {v.name for v in verdicts}
    assert named == {m.name for m in catalogue}, "every catalogued mutant is either judged or named as left over"
    assert mutants.run([1], budget=0.0, baseline=False, designs=False, out=tmp_path), "each stage judges one"


def test_mutants_are_judged_side_by_side_each_in_a_tree_of_its_own(tmp_path, monkeypatch):
    busy: set[Path] = set()
    at_once: list[int] = []
    lock = threading.Lock()

    def fake_judge(stage, mutant, tree, timeout):
        with lock:
            assert tree not in busy, f"two runs at once in {tree}"
            busy.add(tree)
            at_once.append(len(busy))
        time.sleep(0.05)
        with lock:
            busy.discard(tree)
        return mutants.Verdict(stage, mutant.name, mutant.mistake, "killed")

    monkeypatch.setattr(mutants, "judge", fake_judge)
    monkeypatch.setattr(mutants, "build_tree", _reference_tree)
    verdicts = mutants.run([1], baseline=False, designs=False, out=tmp_path, jobs=2)
    assert [v.name for v in verdicts] == [m.name for m in mutants.load_catalogue(1)], "the catalogue's order"
    assert max(at_once) == 2, "two mutants are judged at once"
