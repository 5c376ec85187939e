"""Hostile submissions get exactly what they legitimately pass (0 here), the evidence is reported, and the batch
goes on. See ``attacks/README.md`` for what each one tries."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kit.grading import batch, reporting, running
from kit.grading.scoring import GradeResult
from kit.spawn.confine import landlock_abi

ATTACKS = Path(__file__).resolve().parent / "attacks"
ROOT = Path(__file__).resolve().parents[2]
CONFINED = landlock_abi() >= 1
MARKER = Path("/tmp/kit-attack-forge-channel-ran-in-the-judge")


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


def _tracked_files() -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in (ROOT / "kit" / "testing.py", ROOT / "tests" / "test_stage1_benchmarking.py",
                                        ROOT / "tests" / "timings.json")}


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> tuple[dict[str, GradeResult], Path]:
    MARKER.unlink(missing_ok=True)
    before = _tracked_files()
    out = tmp_path_factory.mktemp("attack-grades")
    limits = running.Limits(timeout=180, per_test_timeout=60, memory_gb=2, idle_limit=5, timing_floor=5)
    results = batch.grade_batch(ATTACKS, out, stages=[1], limits=limits, jobs=2, include_hidden=True).results
    assert _tracked_files() == before, "a submission changed the kit's own files on disk"
    return {r.submission: r for r in results}, out


def _outputs(result: GradeResult) -> str:
    return "\n".join(t.output for t in result.tests)


def test_every_attack_is_graded_and_scores_zero(graded):
    results, out = graded
    names = sorted(p.name for p in ATTACKS.iterdir() if p.is_dir())
    assert sorted(results) == names, "every submission gets a result, whatever the others did"
    for name, r in results.items():
        assert r.max_score > 0, f"{name}: no tests were collected ({r.status}: {r.message})"
        assert r.score == 0, f"{name} scored {r.score}:\n{reporting.format_table(r)}"
        data = json.loads((out / name / "results.json").read_text())
        assert data["score"] == 0 and data["max_score"] == r.max_score


def test_patches_in_the_worker_never_reach_a_verdict(graded):
    results, _ = graded
    assert all("NotImplementedError" in t.output for t in results["testreport_init"].tests), (
        "testreport_init: the stubs' own failures are reported as they are")
    assert "wrong on purpose" in _outputs(results["patch_reporting"]), "the worker's error, untouched by its patches"
    text = _outputs(results["patch_at_call_time"])
    assert "wrong on purpose, after patching" in text, "the worker's error, untouched by its own patches"


def test_what_claims_to_equal_anything_arrives_as_plain_data(graded):
    # The float subclass arrives as a float, the agreeable tensor subclass as a plain tensor of zeros: the judge
    # compares numbers, with torch's own comparisons, and reports what it got.
    text = _outputs(graded[0]["equal_to_anything"])
    assert "attention output (full)" in text and "got 0, expected" in text, text[:2000]


def test_forged_channel_messages_are_data_at_most(graded):
    result = graded[0]["forge_channel"]
    assert not MARKER.exists(), "a pickle a worker sent was unpickled by the judge"
    assert "not data" in _outputs(result), _outputs(result)[:2000]


def test_exit_zero_cannot_hide_failures(graded):
    result = graded[0]["exit_zero"]
    assert all(t.status == "failed" for t in result.tests)
    assert "exited with code 0 without reporting" in _outputs(result)


def test_forged_log_lines_and_results_are_ignored(graded):
    results, out = graded
    assert any("forged or altered line" in f for f in results["write_results"].flags) or CONFINED, (
        "unconfined, the forged lines reach the log and must be detected")
    data = json.loads((out / "write_results" / "results.json").read_text())
    # The forgery claimed 1000 points and no tests; the grader's file lists every test at 0.
    assert data["score"] == 0 and len(data["tests"]) == len(results["write_results"].tests) > 0


@pytest.mark.skipif(not CONFINED, reason="without Landlock, workers can read and write what their user can "
                                         "(README, threat model)")
@pytest.mark.parametrize("name, evidence", [
    ("read_reference", "PermissionError"),
    ("read_hidden", "PermissionError"),
    ("rewrite_the_kit", "PermissionError"),
    ("kill_the_judge", "PermissionError" if landlock_abi() >= 6 else "Error"),
])
def test_confinement_refuses_and_the_refusal_is_reported(graded, name, evidence):
    text = _outputs(graded[0][name])
    assert evidence in text, f"{name}: {text[:2000]}"


def test_no_process_outlives_its_grading(graded):
    leftovers = _processes_with(b"7654321")
    assert not leftovers, f"processes started by orphan_processes are still running: {leftovers}"
    # Who kills them depends on timing: the spawn layer kills a worker's whole process tree with it (while the
    # sleepers are still its descendants), the watchdog sweeps what re-parented to it and says so in the grade
    # ("killed N process(es)"). Under load (make test at load 6-8) the first got them all and the grade
    # rightly said nothing; the guarantee either way is the one above: nothing outlives the grading.
    message = graded[0]["orphan_processes"].message
    assert not message or "killed" in message, message


def test_hang_and_memory_and_output_are_contained(graded):
    results, out = graded
    assert any("made no progress for 5 s" in t.output for t in results["sleep_forever"].tests)
    assert any("MemoryError" in t.output or "without reporting" in t.output for t in results["out_of_memory"].tests)
    size = (out / "flood_output" / "results.json").stat().st_size
    assert size < 2_000_000, f"results.json of flood_output is {size} bytes: output must be truncated"
