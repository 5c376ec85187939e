"""The stage registry is the one list of stages: a new stage needs one entry there and nothing else edited."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import toy_kit

from kit import stages


def test_registry_parses_stage_lists_and_marker_expressions():
    assert stages.parse_stage_list("1,3") == [1, 3] and stages.parse_stage_list(None) is None
    assert stages.marker_expression([2, 5]) == "stage2 or stage5"
    for bad in ("0", "1,x", "99"):
        with pytest.raises(ValueError, match="stages are numbers"):
            stages.parse_stage_list(bad)
    for s in stages.STAGES:
        assert s.test_paths(), f"stage {s.number} has no test files matching {s.tests}"
        assert all(p.exists() for p in s.chapter_paths()), f"stage {s.number}'s chapters {s.chapters}"


def test_a_toy_stage_7_is_picked_up_by_grade_check_handout_and_release(tmp_path: Path):
    kit = toy_kit.make(tmp_path / "kit", full=True)

    listed = toy_kit.run(kit, "stages", "--marker-expression")
    assert listed.stdout.split() == " or ".join(f"stage{n}" for n in range(1, 8)).split(), listed.stdout

    graded = toy_kit.run(kit, "grade", "--impl", "reference", "--stage", "7", "--json", "out/results.json")
    assert graded.returncode == 0, graded.stdout[-3000:] + graded.stderr[-3000:]
    assert "| 7     | Toy stage 7" in graded.stdout and "4/4" in graded.stdout, graded.stdout
    names = [t["name"] for t in json.loads((kit / "out" / "results.json").read_text())["tests"]]
    assert names == ["Stage 7 · P7.1 · test_add", "Stage 7 · P7.1 · test_double", "Stage 7 · P7.2 · test_prepare"]

    checked = toy_kit.run(kit, "check-handout")
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]

    built = toy_kit.run(kit, "release", "--build", "--out", str(tmp_path / "release"))
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    release = tmp_path / "release"
    assert 'raise NotImplementedError("add: add them (handout 07 §1)")' in (release / "student" / "toy.py").read_text()
    assert (release / "tests" / "test_stage7_toy.py").exists() and (release / "handout" / "07-toy.md").exists()
    assert not (release / "tests" / "hidden").exists()

    # The release has no hidden tests: the handout's "Hidden tests:" lines are not errors there.
    checked = toy_kit.run(release, "check-handout")
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    stubs = toy_kit.run(release, "grade", "--stage", "7")
    assert stubs.returncode == 0 and "0/4" in stubs.stdout and "implement add" in stubs.stdout, stubs.stdout


def test_a_test_marked_for_another_stage_is_refused(tmp_path: Path):
    kit = toy_kit.make(tmp_path / "kit")
    test_file = kit / "tests" / "test_stage7_toy.py"
    test_file.write_text(test_file.read_text().replace("pytest.mark.stage7", "pytest.mark.stage1"))
    proc = toy_kit.run_pytest(kit, "--collect-only", "-q")
    assert proc.returncode != 0 and "kit/stages.py lists this file under stage 7" in proc.stdout + proc.stderr
