"""The autograder: points from outcomes, Gradescope results, batches with broken submissions."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from kit import grader

ROOT = Path(__file__).resolve().parents[2]
GRADESCOPE_TEST_KEYS = {"name", "score", "max_score", "status", "output", "visibility"}


def test_reference_gets_full_marks_and_valid_gradescope_json():
    result = grader.grade("reference", stages=[1])
    assert result.status == "ok", result.output[-3000:]
    assert result.max_score > 0 and result.score == result.max_score, grader.format_table(result)
    data = grader.gradescope_json(result)
    assert {"score", "max_score", "execution_time", "tests"} <= set(data)
    for t in data["tests"]:
        assert GRADESCOPE_TEST_KEYS <= set(t), t
        assert t["status"] == "passed" and t["visibility"] == "visible"


def test_hidden_tests_are_graded_after_published():
    result = grader.grade("reference", stages=[1], include_hidden=True)
    hidden = [t for t in grader.gradescope_json(result)["tests"] if t["visibility"] == "after_published"]
    assert hidden and all(t["status"] == "passed" for t in hidden)


def test_stubs_grade_zero_and_every_failure_is_not_implemented():
    """The whole generated student package: every graded test fails cleanly, none crashes the run."""
    result = grader.grade("student", limits=grader.Limits(per_test_timeout=120))
    assert result.status == "ok", f"{result.message}\n{result.output[-3000:]}"
    assert result.tests and result.score == 0, grader.format_table(result)
    unclear = [t.nodeid for t in result.tests if "NotImplementedError" not in t.output]
    assert not unclear, f"these stub failures do not say NotImplementedError: {unclear}"


def _submission(root: Path, name: str, benchmarking_source: str | None) -> Path:
    sub = root / name / "student"
    shutil.copytree(ROOT / "student", sub, ignore=shutil.ignore_patterns("__pycache__"))
    if benchmarking_source is not None:
        (sub / "benchmarking.py").write_text(benchmarking_source)
    return sub.parent


def test_batch_grades_correct_stub_crashing_and_hanging_submissions(tmp_path: Path):
    ref = (ROOT / "reference" / "benchmarking.py").read_text()
    batch = tmp_path / "batch"
    _submission(batch, "correct", ref)
    _submission(batch, "stub", None)
    # Kills the interpreter in the middle of the run: the tests that passed before still count.
    marker = "    # BEGIN SOLUTION warm up, profile one call"
    crash = ref.replace(marker, "    import os; os._exit(0)\n" + marker)
    _submission(batch, "crashing", crash)
    # Raises at import: every test fails, nothing else breaks.
    _submission(batch, "import_error", "raise RuntimeError('broken at import')\n")
    # Never returns from one function: that test hits the per-test limit, the rest still pass.
    hang = ref.replace(marker, "    import time; time.sleep(10_000)\n" + marker)
    _submission(batch, "hanging", hang)
    (batch / "correct" / "conftest.py").write_text("raise SystemExit('a submission conftest must never run')\n")

    out = tmp_path / "grades"
    limits = grader.Limits(timeout=300, per_test_timeout=20)
    results = {r.submission: r for r in grader.grade_batch(batch, out, stages=[1], limits=limits, jobs=2)}
    full = results["correct"].max_score
    assert results["correct"].score == full > 0, grader.format_table(results["correct"])
    assert "ignored conftest.py" in results["correct"].message
    assert results["stub"].score == 0
    assert results["import_error"].score == 0 and results["import_error"].status == "ok"
    crashed = results["crashing"]
    # The test that killed the interpreter fails; every other test is rerun in a fresh process and passes.
    profile_test = next(t for t in crashed.tests if "profile_step" in t.nodeid)
    assert profile_test.status == "failed" and "exited during this test" in profile_test.output
    assert crashed.status == "crashed" and crashed.score == full - profile_test.points, grader.format_table(crashed)
    hanging = results["hanging"]
    stuck = next(t for t in hanging.tests if "profile_step" in t.nodeid)
    assert stuck.status == "failed" and "time limit" in stuck.output, stuck.output[-2000:]
    assert hanging.score == full - stuck.points

    for name in results:
        data = json.loads((out / name / "results.json").read_text())
        assert data["max_score"] == full and data["score"] == results[name].score
    with open(out / "gradebook.csv") as f:
        book = {row["submission"]: row for row in csv.DictReader(f)}
    assert set(book) == set(results)
    assert float(book["correct"]["stage1"]) == full and float(book["stub"]["score"]) == 0


def test_whole_submission_timeout_keeps_what_passed(tmp_path: Path):
    ref = (ROOT / "reference" / "benchmarking.py").read_text()
    hang = ref.replace("    # BEGIN SOLUTION warm up, profile one call",
                       "    import time; time.sleep(10_000)\n    # BEGIN SOLUTION warm up, profile one call")
    sub = _submission(tmp_path, "slow", hang)
    result = grader.grade(str(sub), stages=[1], limits=grader.Limits(timeout=20, per_test_timeout=1000))
    assert result.status == "timeout"
    assert 0 < result.score < result.max_score


def test_unknown_impl_path_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="--impl must be"):
        grader.grade("/no/such/folder")
