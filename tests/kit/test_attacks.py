"""Hostile submissions get exactly what they legitimately pass (0 here), the evidence is reported, and the batch
goes on. See ``attacks/README.md`` for what each one tries."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from kit.grading import batch, reporting, running
from kit.grading.scoring import GradeResult
from kit.spawn.confine import landlock_abi
from kit.spawn.contain import cgroup_support

ATTACKS = Path(__file__).resolve().parent / "attacks"
ROOT = Path(__file__).resolve().parents[2]
CONFINED = landlock_abi() >= 1
CONTAINED = cgroup_support().startswith("yes")  # each run in a cgroup of its own (kit.spawn.contain)
MARKER = Path("/tmp/kit-attack-forge-channel-ran-in-the-judge")


def _processes_with(token: bytes) -> list[int]:
    """Processes with ``token`` in their command line, read per thread: a process whose main thread has exited
    (zombie_daemon) shows an empty command line for its main thread, and its live threads' for the others."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                for task in os.listdir(f"/proc/{entry}/task"):
                    with open(f"/proc/{entry}/task/{task}/cmdline", "rb") as f:
                        if token in f.read():
                            found.append(int(entry))
                            break
            except OSError:
                pass
    return found


def _tracked_files() -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in (ROOT / "kit" / "testing.py", ROOT / "tests" / "test_stage1_benchmarking.py",
                                        ROOT / "tests" / "timings.json")}


def _submissions(folder: Path) -> Path:
    """The attacks, copied into ``folder``, with what each builds from the kit at test time: testreport_init's
    ``student/benchmarking.py`` is the stubs' own (``student/``), not a committed copy that could drift from them."""
    shutil.copytree(ATTACKS, folder, dirs_exist_ok=True)
    shutil.copy2(ROOT / "student" / "benchmarking.py", folder / "testreport_init" / "student" / "benchmarking.py")
    return folder


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> tuple[dict[str, GradeResult], Path]:
    MARKER.unlink(missing_ok=True)
    before = _tracked_files()
    submissions = _submissions(tmp_path_factory.mktemp("attacks"))
    out = tmp_path_factory.mktemp("attack-grades")
    limits = running.Limits(timeout=180, per_test_timeout=60, memory_gb=2, idle_limit=5, timing_floor=5)
    results = batch.grade_batch(submissions, out, stages=[1], limits=limits, jobs=2, include_hidden=True).results
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
    # patch_reporting rewrites the kit's comparisons when it is imported: from then on its worker answers
    # "tampered" to every request (kit.spawn.checkbook), the import check first, so the stage does not import.
    text = _outputs(results["patch_reporting"])
    assert "the checks in this worker were tampered with" in text and "was replaced" in text, text[:2000]
    text = _outputs(results["patch_at_call_time"])
    assert "wrong on purpose, after patching" in text, "the worker's error, untouched by its own patches"
    assert "the checks in this worker were tampered with" in text, "the requests after the patching are refused"


def test_checks_replaced_by_forgeries_are_never_called(graded):
    # forge_checks replaces Stage 1's worker-side checks with functions returning what a correct implementation
    # records (10/28 on the last commit without the checkbook): the worker resolves checks from its checkbook,
    # so the stubs run (NotImplementedError), and it says what was replaced.
    text = _outputs(graded[0]["forge_checks"])
    assert "test_stage1_benchmarking._time_fn_with_fake_clock was replaced" in text, text[:2000]


def test_links_swapped_in_for_worker_files_reach_nothing(graded):
    # swap_output_links replaces its stdout, stderr and stack files by links to the hidden judge half and to
    # /proc/self/environ, then hangs (a stack dump) and dies (a stderr tail). On the last commit the judge opened
    # those paths and put the hidden test and its own environment, grading key included, into visible output.
    result = graded[0]["swap_output_links"]
    text = _outputs(result)
    hidden = (ROOT / "tests" / "hidden" / "test_stage1_hidden.py").read_text().splitlines()[0]
    assert hidden not in text and "KIT_GRADING" not in text and "PATH=" not in text, text[:2000]
    assert "Current thread" in text, "the hung worker's real stack is quoted, from the judge's own descriptor"


def test_a_daemon_that_hides_from_proc_is_killed_and_reported(graded):
    # zombie_daemon's daemon left its session and environment and exited its main thread: /proc shows it as a
    # zombie. On the last commit it outlived the grade (4 of them); the run's cgroup kills it, and the grade says.
    assert not _processes_with(b"7654321")
    message = graded[0]["zombie_daemon"].message
    assert "killed" in message or not CONTAINED, message


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
                                         "(INSTRUCTOR.md, threat model)")
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


def test_decode_bomb_costs_the_judge_little(graded):
    # 1.7 KB whose pickle refers to one list 2^60 times: the judge walks a million parts of it, refuses it as not
    # data (wire.MAX_NODES) and goes on, in a third of a CPU-second instead of millennia.
    result = graded[0]["decode_bomb"]
    text = _outputs(result)
    assert "the worker sent something that is not data" in text and "(wire.MAX_NODES" in text, text[:2000]
    assert all(t.status == "failed" for t in result.tests)
    assert "--judge-cpu-limit" not in text, "refused by the decoder's limit, long before the judge's CPU limit"
