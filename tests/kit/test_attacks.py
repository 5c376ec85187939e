"""Hostile submissions get exactly what they legitimately pass (0 here), are reported, and the batch goes on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kit.grading import batch, reporting, running
from kit.grading.scoring import GradeResult

ATTACKS = Path(__file__).resolve().parent / "attacks"


def _processes_with(token: bytes) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if token in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> tuple[dict[str, GradeResult], Path]:
    out = tmp_path_factory.mktemp("attack-grades")
    limits = running.Limits(timeout=90, per_test_timeout=10, memory_gb=2)
    results = batch.grade_batch(ATTACKS, out, stages=[1], limits=limits, jobs=2).results
    return {r.submission: r for r in results}, out


def test_every_attack_is_graded_and_scores_zero(graded):
    results, out = graded
    names = sorted(p.name for p in ATTACKS.iterdir() if p.is_dir())
    assert sorted(results) == names, "every submission gets a result, whatever the others did"
    for name, r in results.items():
        assert r.max_score > 0, f"{name}: no tests were collected ({r.status}: {r.message})"
        assert r.score == 0, f"{name} scored {r.score}:\n{reporting.format_table(r)}"
        data = json.loads((out / name / "results.json").read_text())
        assert data["score"] == 0 and data["max_score"] == r.max_score


@pytest.mark.parametrize("name, evidence", [
    ("patch_reporting", "replaced torch.testing.assert_close"),
    ("read_reference", "tried to"),
    ("stack_peek", "inspected the call stack"),
    ("write_results", "forged or altered line"),
])
def test_tampering_is_flagged(graded, name, evidence):
    result = graded[0][name]
    assert result.flags, f"{name} was not flagged: {result.message}"
    assert any(evidence in f for f in result.flags), f"{name} flags: {result.flags}"
    assert "FLAGGED" in result.message


def test_exit_zero_cannot_hide_failures(graded):
    result = graded[0]["exit_zero"]
    assert result.status == "crashed"
    assert all(t.status == "failed" for t in result.tests)


def test_forged_results_json_is_replaced_by_the_grader(graded):
    _, out = graded
    data = json.loads((out / "write_results" / "results.json").read_text())
    # The forgery claimed 1000 points and no tests; the grader's file lists every test at 0.
    assert data["score"] == 0 and len(data["tests"]) == len(graded[0]["write_results"].tests) > 0


def test_no_process_outlives_its_grading(graded):
    leftovers = _processes_with(b"7654321")
    assert not leftovers, f"processes started by orphan_processes are still running: {leftovers}"
    assert "killed" in graded[0]["orphan_processes"].message


def test_hang_and_memory_and_output_are_contained(graded):
    results, out = graded
    assert any("time limit" in t.output for t in results["sleep_forever"].tests)
    assert any("MemoryError" in t.output or "exited during" in t.output for t in results["out_of_memory"].tests)
    size = (out / "flood_output" / "results.json").stat().st_size
    assert size < 2_000_000, f"results.json of flood_output is {size} bytes: output must be truncated"
