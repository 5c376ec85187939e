"""A hang costs seconds, not the submission's half hour: import checks and per-test limits from reference times."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import toy_kit

from kit.grading import reporting, running, timings

ROOT = Path(__file__).resolve().parents[2]
HANG = "    while True:\n        pass\n"


def _grade(kit: Path, sub: Path, *options: str) -> tuple[dict[str, dict], float]:
    """Grade ``sub`` with the toy kit's CLI: results.json's tests by name, and the seconds it took."""
    start = time.monotonic()
    proc = toy_kit.run(kit, "grade", "--impl", str(sub), *options, "--json", str(sub / "results.json"))
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {t["name"]: t for t in json.loads((sub / "results.json").read_text())["tests"]}, elapsed


def test_limits_cover_shared_work_whichever_test_pays_for_it():
    """A module fixture's spawn lands in one test's setup, a module-level cache in one test's call."""
    recorded = {"t.py::fixture_first": [10.0, 1.0, 0.0], "t.py::cached": [0.0, 30.0, 0.0],
                "t.py::quick": [0.0, 0.5, 2.0], "u.py::alone": [0.0, 0.1, 0.0]}
    limits = timings.Limits(recorded, cap=300, factor=6, floor=20)
    assert limits.budget("t.py::quick").run == 6 * (10 + 0.5), "any test of the file may set up its fixture"
    assert limits.budget("t.py::quick", first_in_file=True).run == 6 * 30, "the first may fill the cache"
    assert limits.budget("t.py::quick").teardown == 20 and limits.budget("u.py::alone").run == 20  # the floor
    assert limits.budget("t.py::cached").run == 240 and limits.budget("new.py::x").run == 300  # capped / unknown


def test_a_module_that_hangs_at_import_fails_its_stage_at_once_and_the_others_are_graded(tmp_path):
    kit = toy_kit.make(tmp_path / "kit", (7, 8))
    hang = toy_kit.solution(7).replace("from __future__ import annotations\n",
                                       "from __future__ import annotations\nwhile True:\n    pass\n")
    sub = toy_kit.submission(tmp_path, "sub", hang, "toy")
    (sub / "student" / "toy8.py").write_text(toy_kit.solution(8))
    tests, elapsed = _grade(kit, sub, "--stage", "7,8", "--import-timeout", "3")
    stage7 = [t for name, t in tests.items() if name.startswith("Stage 7")]
    stage8 = [t for name, t in tests.items() if name.startswith("Stage 8")]
    assert len(stage7) == len(stage8) == 3
    assert all(t["status"] == "failed" and "importing student.toy took longer than 3 s" in t["output"] for t in stage7)
    assert all(t["status"] == "passed" for t in stage8), "the other stage is graded as usual"
    assert elapsed < 60, f"a hang at import cost {elapsed:.0f} s"


def test_each_test_is_limited_by_its_recorded_reference_time_setup_included(tmp_path):
    kit = toy_kit.make(tmp_path / "kit")
    recorded = toy_kit.run(kit, "grade", "--impl", "reference", "--stage", "7", "--record-timings")
    assert recorded.returncode == 0 and "wrote tests/timings.json" in recorded.stdout, recorded.stdout + recorded.stderr
    timings = json.loads((kit / "tests" / "timings.json").read_text())["tests"]
    assert sorted(timings) == [f"tests/test_stage7_toy.py::test_{n}" for n in ("add", "double", "prepare")]
    assert all(len(v) == 3 and all(0 <= x < 5 for x in v) for v in timings.values()), timings

    # double() never returns; prepare() hangs in the module-scoped fixture, i.e. in test_prepare's setup.
    source = toy_kit.solution().replace("    return 2 * x\n", HANG).replace('    return "ready"\n', HANG)
    sub = toy_kit.submission(tmp_path, "sub", source)
    tests, elapsed = _grade(kit, sub, "--stage", "7", "--timing-floor", "2")
    assert tests["Stage 7 · P7.1 · test_add"]["status"] == "passed"
    for name, phase in (("P7.1 · test_double", "call failed"), ("P7.2 · test_prepare", "setup failed")):
        t = tests[f"Stage 7 · {name}"]
        assert t["status"] == "failed" and phase in t["output"] and "time limit of 2 s" in t["output"], t["output"]
    assert elapsed < 40, f"two stuck tests with 2 s limits cost {elapsed:.0f} s"


def test_a_test_that_ignores_its_time_limit_is_killed_and_the_rest_still_run(tmp_path):
    """A hang the alarm cannot interrupt (here: SIGALRM blocked) is killed from the grader, GRACE later."""
    sub = tmp_path / "sub" / "student"
    shutil.copytree(ROOT / "student", sub, ignore=shutil.ignore_patterns("__pycache__"))
    ref = (ROOT / "reference" / "benchmarking.py").read_text()
    marker = "    # BEGIN SOLUTION warm up, profile one call"
    stuck = "    import signal\n    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])\n" + HANG
    (sub / "benchmarking.py").write_text(ref.replace(marker, stuck + marker))
    limits = running.Limits(grace=2, timeout=300)  # the default floor: the other tests must not time out
    result = running.grade(str(sub.parent), stages=[1], limits=limits)
    stuck_test = next(t for t in result.tests if "profile_step" in t.nodeid)
    assert stuck_test.status == "failed" and "did not stop at its time limit" in stuck_test.output, stuck_test.output
    assert result.score == result.max_score - stuck_test.points, reporting.format_table(result)
    assert result.status == "ok" and "was killed" in result.message
