"""`make check-test FILE=…` (instructor/checklist.py): CONTRIBUTING's checklist for a graded test file, checked."""

from __future__ import annotations

import json
from pathlib import Path

from instructor import checklist

ROOT = Path(__file__).resolve().parents[2]

GOOD = '''import pytest

pytestmark = pytest.mark.stage4


@pytest.mark.points(2)
def test_ranks_agree(worker):
    pass


@pytest.mark.gpu
def test_on_a_gpu(worker):
    pass
'''


def _toy_kit(root: Path, test_source: str) -> Path:
    """A kit holding just what the checklist reads for Stage 4: the test file, its chapter and the timings."""
    (root / "tests").mkdir()
    (root / "handout").mkdir()
    test_file = root / "tests" / "test_stage4_toy.py"
    test_file.write_text(test_source)
    (root / "handout" / "04-ddp.md").write_text("### Problem 4.1 — Toy (2 points)\nTests: `test_ranks_agree`\n")
    (root / "tests" / "timings.json").write_text(json.dumps(
        {"tests": {"tests/test_stage4_toy.py::test_ranks_agree": [0.1, 0.2, 0.0, 0.0, 0.1]}}))
    return test_file


def test_a_complete_test_file_passes_with_a_warning_for_the_uncatalogued_test(tmp_path: Path):
    lines = checklist.checklist(_toy_kit(tmp_path, GOOD), root=tmp_path)
    rendered = [line.render() for line in lines]
    assert not [r for r in rendered if r.startswith("✗")], rendered
    assert any(r.startswith("⚠ test_ranks_agree") and "catalogued mistake" in r for r in rendered), rendered
    assert not any("test_on_a_gpu" in r and "Tests:" in r for r in rendered), "a GPU check carries no points"


def test_a_test_without_points_fails(tmp_path: Path, capsys):
    test_file = _toy_kit(tmp_path, GOOD.replace("@pytest.mark.points(2)\n", ""))
    lines = checklist.checklist(test_file, root=tmp_path)
    failed = [line.render() for line in lines if line.ok is False]
    assert failed == ["✗ test_ranks_agree (line 6): points and marker — no @pytest.mark.points(n)"], failed


def test_a_missing_handout_line_and_timing_fail(tmp_path: Path):
    test_file = _toy_kit(tmp_path, GOOD.replace("test_ranks_agree", "test_something_new"))
    failed = [line.render() for line in checklist.checklist(test_file, root=tmp_path) if line.ok is False]
    assert len(failed) == 2 and "Tests:" in failed[0] and "make timings STAGE=4" in failed[1], failed


def test_the_kit_stage_4_file_passes_the_command():
    assert checklist.main([str(ROOT / "tests" / "test_stage4_ddp.py")]) == 0
