"""The autograder: points from outcomes, Gradescope results, batches with broken submissions."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from kit import stages
from kit.grading import batch, reporting, running, scoring, timings
from kit.grading.events import RunRecord

ROOT = Path(__file__).resolve().parents[2]
GRADESCOPE_TEST_KEYS = {"name", "score", "max_score", "status", "output", "visibility"}


def test_reference_gets_full_marks_and_valid_gradescope_json():
    result = running.grade("reference", stages=[1])
    assert result.status == "ok", result.output[-3000:]
    assert result.max_score > 0 and result.score == result.max_score, reporting.format_table(result)
    data = reporting.gradescope_json(result)
    assert {"score", "max_score", "execution_time", "tests"} <= set(data)
    for t in data["tests"]:
        assert GRADESCOPE_TEST_KEYS <= set(t), t
        assert t["status"] == "passed" and t["visibility"] == "visible"
    names = [t["name"] for t in data["tests"]]
    assert len(set(names)) == len(names), "results.json test names must be unique"
    assert all(n.startswith("Stage 1 · P1.") for n in names), names  # stage · handout problem · test


def test_stage_groups_graded_side_by_side_give_the_same_result_as_one_run():
    """``kit grade`` on a machine with 2 CPUs grades two groups of stages at once (``--jobs``): same tests, same
    verdicts, in stage order, one status."""
    one = running.grade("reference", stages=[1, 2])
    two = running.grade("reference", stages=[1, 2], jobs=2)
    assert two.status == "ok" and two.score == two.max_score == one.max_score > 0, reporting.format_table(two)
    assert [(t.nodeid, t.status) for t in two.tests] == [(t.nodeid, t.status) for t in one.tests]
    assert [t.stage for t in two.tests] == sorted(t.stage for t in two.tests)


def test_stages_are_dealt_into_groups_of_about_equal_work():
    every = [s.number for s in stages.STAGES]
    groups = running.stage_groups(every, 2)
    assert sorted(s for g in groups for s in g) == every and len(groups) == 2
    assert running.stage_groups([3], 2) == [[3]], "one stage is one group"
    assert running.stage_groups(every, 1) == [every]
    heaviest = sorted(every, key=lambda s: -sum(sum(v[:3]) for k, v in timings.load(ROOT).items()
                                                  if f"test_stage{s}" in k))[:2]
    assert not any(set(heaviest) <= set(g) for g in groups), f"the two heaviest stages {heaviest} share a group"
    parts = [scoring.GradeResult("x", status="ok", message="a"), scoring.GradeResult("x", status="timeout")]
    merged = running.merge_results(parts, "x", 1.0)
    assert merged.status == "timeout" and merged.message == "a"
    assert running.merge_results([*parts, scoring.GradeResult("x", status="error")], "x", 1.0).status == "error"


def test_test_names_are_unique_across_stages_and_match_gradebook_problems():
    """Equal function names in two stages (``test_bad_inputs_raise_clear_errors``) read apart."""
    record = RunRecord(collected=[
        {"nodeid": "tests/test_stage3_a.py::test_bad_inputs_raise_clear_errors[fp16]", "stage": 3, "points": 1,
         "hidden": False},
        {"nodeid": "tests/test_stage5_b.py::test_bad_inputs_raise_clear_errors", "stage": 5, "points": 1,
         "hidden": False},
        {"nodeid": "tests/test_stage6_c.py::test_x", "stage": 6, "points": 1, "hidden": False},
        {"nodeid": "tests/test_stage6_d.py::test_x", "stage": 6, "points": 1, "hidden": False},
    ])
    problems = {(3, "test_bad_inputs_raise_clear_errors"): "3.7", (5, "test_bad_inputs_raise_clear_errors"): "5.4"}
    titles = [t.title for t in scoring.score(record, problems)]
    assert titles == ["Stage 3 · P3.7 · test_bad_inputs_raise_clear_errors[fp16]",
                      "Stage 5 · P5.4 · test_bad_inputs_raise_clear_errors",
                      "Stage 6 · test_x (test_stage6_c.py)", "Stage 6 · test_x (test_stage6_d.py)"]
    real = scoring.problem_numbers()
    assert real[(1, "test_time_fn_statistics")] == "1.1", "problem numbers come from the handout chapters"


def test_hidden_tests_are_graded_after_published():
    result = running.grade("reference", stages=[1], include_hidden=True)
    hidden = [t for t in reporting.gradescope_json(result)["tests"] if t["visibility"] == "after_published"]
    assert hidden and all(t["status"] == "passed" for t in hidden)


def test_stubs_grade_zero_and_every_failure_is_not_implemented():
    """The whole generated student package: every graded test fails cleanly, none crashes the run."""
    result = running.grade("student", limits=running.Limits(per_test_timeout=120))
    assert result.status == "ok", f"{result.message}\n{result.output[-3000:]}"
    assert result.tests and result.score == 0, reporting.format_table(result)
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
    folder = tmp_path / "batch"
    _submission(folder, "correct", ref)
    _submission(folder, "stub", None)
    # Kills its worker in the middle of the run: that test fails, the tests around it still count.
    marker = "    # BEGIN SOLUTION warm up, profile one call"
    crash = ref.replace(marker, "    import os; os._exit(0)\n" + marker)
    _submission(folder, "crashing", crash)
    # Raises at import: every test fails, nothing else breaks.
    _submission(folder, "import_error", "raise RuntimeError('broken at import')\n")
    # Never returns from one function: that test hits the per-test limit, the rest still pass.
    hang = ref.replace(marker, "    import time; time.sleep(10_000)\n" + marker)
    _submission(folder, "hanging", hang)
    (folder / "correct" / "conftest.py").write_text("raise SystemExit('a submission conftest must never run')\n")

    out = tmp_path / "grades"
    limits = running.Limits(timeout=300, per_test_timeout=120, idle_limit=5)
    results = {r.submission: r for r in batch.grade_batch(folder, out, stages=[1], limits=limits, jobs=2).results}
    full = results["correct"].max_score
    assert results["correct"].score == full > 0, reporting.format_table(results["correct"])
    assert "ignored conftest.py" in results["correct"].message
    assert results["stub"].score == 0
    assert results["import_error"].score == 0 and results["import_error"].status == "ok"
    crashed = results["crashing"]
    # The test whose worker died fails, saying so; a fresh worker runs the others, and they pass.
    profile_test = next(t for t in crashed.tests if "profile_step" in t.nodeid)
    assert profile_test.status == "failed" and "exited with code 0 without reporting" in profile_test.output
    assert crashed.status == "ok" and crashed.score == full - profile_test.points, reporting.format_table(crashed)
    hanging = results["hanging"]
    stuck = next(t for t in hanging.tests if "profile_step" in t.nodeid)
    assert stuck.status == "failed" and "made no progress for 5 s" in stuck.output, stuck.output[-2000:]
    assert "in profile_step" in stuck.output, "where it was stuck"
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
    limits = running.Limits(timeout=20, per_test_timeout=1000, timing_floor=1000)
    result = running.grade(str(sub), stages=[1], limits=limits)
    assert result.status == "timeout"
    assert 0 < result.score < result.max_score


def test_unknown_impl_path_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="--impl must be"):
        running.grade("/no/such/folder")


def test_one_cuda_detection_without_torch(monkeypatch):
    """kit/__init__ (Triton interpreter or not) and the sandbox (address-space limit or not) share it."""
    import kit
    from kit.grading import sandbox

    assert sandbox.cuda_present is kit.cuda_present
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert not kit.cuda_present()
