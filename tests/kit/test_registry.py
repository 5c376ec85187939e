"""The stage registry is the one list of stages: a new stage needs one entry there and nothing else edited."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import toy_kit

from kit import stages

ROOT = Path(__file__).resolve().parents[2]


def test_registry_parses_stage_lists_and_marker_expressions():
    assert stages.parse_stage_list("1,3") == [1, 3] and stages.parse_stage_list(None) is None
    assert stages.marker_expression([2, 5]) == "stage2 or stage5"
    for bad in ("0", "1,x", "99"):
        with pytest.raises(ValueError, match="stages are numbers"):
            stages.parse_stage_list(bad)
    for s in stages.STAGES:
        assert s.test_paths(), f"stage {s.number} has no test files matching {s.tests}"
        assert all(p.exists() for p in s.chapter_paths()), f"stage {s.number}'s chapters {s.chapters}"


@pytest.mark.parametrize("expression, chosen", [
    ("stage4", [4]), (" stage1 or stage3 ", [1, 3]), ("stage4 and not slow", [4]),
    ("(stage1 or stage2) and not hidden", [1, 2]), ("(stage3)", [3]), ("stage2 or stage1 and not hidden", [1, 2]),
    ("", None), (None, None), ("not stage4", None), ("stage4 or gpu", None), ("stage4 and gpu or stage1", None),
    ("stage4 and (gpu or hidden)", None), ("(stage1 or stage2) or gpu", None), ("hidden", None),
])
def test_a_marker_expression_names_the_stages_it_can_select(expression, chosen):
    # Where it names them, a run collects those stages' files only (the grader's runs among them).
    assert stages.selected_by(expression) == chosen


def _collected(expression: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "--impl", "reference", "-m", expression], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return sorted(line for line in proc.stdout.splitlines() if "::" in line)


def test_collecting_only_the_named_stages_files_selects_the_same_tests():
    # The grader's expression, collected from its stages' files only, against the same selection written so
    # that selected_by cannot read it (parentheses after `and`): pytest then imports every file.
    graded = "(stage1 or stage3) and not hidden"
    narrow, everything = _collected(graded), _collected(f"{graded} and (stage1 or stage3)")
    assert narrow == everything and len(narrow) > 20, (len(narrow), len(everything))


def test_a_toy_stage_7_is_picked_up_by_grade_check_handout_and_release(tmp_path: Path):
    kit, n = toy_kit.make(tmp_path / "kit", full=True), toy_kit.FIRST

    listed = toy_kit.run(kit, "stages", "--marker-expression")
    assert listed.stdout.split() == " or ".join(f"stage{i}" for i in [*stages.numbers(), n]).split(), listed.stdout

    graded = toy_kit.run(kit, "grade", "--impl", "reference", "--stage", str(n), "--json", "out/results.json")
    assert graded.returncode == 0, graded.stdout[-3000:] + graded.stderr[-3000:]
    assert f"| {n}     | Toy stage {n}" in graded.stdout and "4/4" in graded.stdout, graded.stdout
    names = [t["name"] for t in json.loads((kit / "out" / "results.json").read_text())["tests"]]
    assert names == [f"Stage {n} · P{n}.1 · test_add", f"Stage {n} · P{n}.1 · test_double",
                     f"Stage {n} · P{n}.2 · test_prepare"]

    checked = toy_kit.run(kit, "check-handout")
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]

    built = toy_kit.run(kit, "release", "--build", "--out", str(tmp_path / "release"), module="instructor")
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    release = tmp_path / "release"
    stub = f'raise NotImplementedError("add: add them (handout 0{n} §1)")'
    assert stub in (release / "student" / "toy.py").read_text()
    assert (release / "tests" / f"test_stage{n}_toy.py").exists() and (release / "handout" / f"0{n}-toy.md").exists()
    assert not (release / "tests" / "hidden").exists()

    # The release has no hidden tests: the handout's "Hidden tests:" lines are not errors there.
    checked = toy_kit.run(release, "check-handout")
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    stubs = toy_kit.run(release, "grade", "--stage", str(n))
    assert stubs.returncode == 0 and "0/4" in stubs.stdout and "implement add" in stubs.stdout, stubs.stdout


def test_a_test_marked_for_another_stage_is_refused(tmp_path: Path):
    n, other = toy_kit.FIRST, toy_kit.SECOND
    kit = toy_kit.make(tmp_path / "kit", (n, other))
    test_file = kit / "tests" / f"test_stage{n}_toy.py"
    test_file.write_text(test_file.read_text().replace(f"pytest.mark.stage{n}", f"pytest.mark.stage{other}"))
    proc = toy_kit.run_pytest(kit, "--collect-only", "-q")
    assert proc.returncode != 0 and f"kit/stages.py lists this file under stage {n}" in proc.stdout + proc.stderr


def _make(kit: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["make", *args], cwd=kit, env=toy_kit.env(), capture_output=True, text=True,
                          timeout=timeout)


def test_the_recipe_in_contributing_adds_a_stage_that_passes_what_ci_runs(tmp_path: Path):
    """CONTRIBUTING.md's "Adding a stage", step by step as written, then CI's own commands on the result."""
    kit = toy_kit.make(tmp_path / "kit", ())  # the machinery only: no stage yet
    shutil.copy2(ROOT / "tests" / "test_notebooks.py", kit / "tests" / "test_notebooks.py")
    (kit / ".venv").symlink_to(ROOT / ".venv")  # the same pinned environment; `make setup` finds nothing to do
    n = toy_kit.FIRST
    recipe = (ROOT / "CONTRIBUTING.md").read_text()
    steps = [f"make new-stage N={n} NAME=toy_sum", "make student notebooks", f"make timings STAGE={n}", "make test",
             f"make mutants STAGE={n}"]
    for step in steps:  # the recipe says these, in this order
        assert step.split(f"={n}")[0].split(" NAME")[0] in recipe, f"CONTRIBUTING.md no longer says `{step}`"
    done = _make(kit, "new-stage", f"N={n}", "NAME=toy_sum", "TITLE=Toy sum")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for args in (["student", "notebooks"], ["timings", f"STAGE={n}"], ["test"], ["mutants", f"STAGE={n}"]):
        done = _make(kit, *args)
        assert done.returncode == 0, f"make {' '.join(args)}:\n" + done.stdout[-4000:] + done.stderr[-3000:]
    assert "1/1 catalogued mistakes caught" in done.stdout, done.stdout[-2000:]
    smoke = subprocess.run([sys.executable, "-m", "benchmarks.bench_toy_sum", "--smoke", "--impl", "reference"],
                           cwd=kit, env=toy_kit.env(), capture_output=True, text=True, timeout=120)
    assert smoke.returncode == 0, smoke.stdout[-2000:] + smoke.stderr[-2000:]
    again = _make(kit, "new-stage", f"N={n}", "NAME=toy_sum", "TITLE=Toy sum")
    assert again.returncode != 0 and "exists already" in again.stdout + again.stderr, "a stage is added once"


def test_a_number_or_module_two_stages_claim_is_refused():
    twin = stages.Stage(1, "Twin", ("twin",), ("99-twin.md",), ("test_stage99_*.py",))
    with pytest.raises(ValueError, match="number 1 belongs to stage 1 and to stage 1"):
        stages.check((*stages.STAGES, twin))
    thief = stages.Stage(99, "Thief", ("ddp",), ("99-thief.md",), ("test_stage99_*.py",))
    with pytest.raises(ValueError, match="module 'ddp' belongs to stage 4 and to stage 99"):
        stages.check((*stages.STAGES, thief))
