"""A hang costs seconds, not the submission's half hour — and a busy machine costs no points: import checks, CPU
budgets from the reference's recorded CPU time, and an idle limit for what blocks."""

from __future__ import annotations

import json
import time
from pathlib import Path

import toy_kit

from kit.grading import timings

SPIN = "    while True:\n        pass\n"


def _grade(kit: Path, sub: Path, *options: str) -> tuple[dict[str, dict], float]:
    """Grade ``sub`` with the toy kit's CLI: results.json's tests by name, and the seconds it took."""
    start = time.monotonic()
    proc = toy_kit.run(kit, "grade", "--impl", str(sub), *options, "--json", str(sub / "results.json"))
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {t["name"]: t for t in json.loads((sub / "results.json").read_text())["tests"]}, elapsed


def test_limits_cover_shared_work_whichever_test_pays_for_it():
    """A module fixture's spawn lands in one test's setup, a module-level cache in one test's call."""
    recorded = {"t.py::fixture_first": [12.0, 1.5, 0.0, 10.0, 1.0], "t.py::cached": [0.0, 40.0, 0.0, 0.0, 30.0],
                "t.py::quick": [0.1, 0.6, 2.0, 0.0, 0.5], "u.py::alone": [0.0, 0.2, 0.0, 0.0, 0.1],
                "v.py::before_cpu_was_recorded": [1.0, 2.0, 0.0]}
    limits = timings.Limits(recorded, cap=300, factor=6, floor=20)
    assert limits.budget("t.py::quick").cpu == 6 * (10 + 0.5), "any test of the file may set up its fixture"
    assert limits.budget("t.py::quick", first_in_file=True).cpu == 6 * 30, "the first may fill the cache"
    assert limits.budget("u.py::alone").cpu == 20, "the floor"
    assert limits.budget("t.py::cached").cpu == 6 * (10 + 30) and limits.budget("t.py::quick").run == 300, "wall: cap"
    assert limits.budget("new.py::x").cpu == float("inf") == limits.budget("v.py::before_cpu_was_recorded").cpu


def test_a_module_that_hangs_at_import_fails_its_stage_at_once_and_the_others_are_graded(tmp_path):
    first, second = toy_kit.FIRST, toy_kit.SECOND
    kit = toy_kit.make(tmp_path / "kit", (first, second))
    hang = toy_kit.solution(first).replace("from __future__ import annotations\n",
                                       "from __future__ import annotations\nwhile True:\n    pass\n")
    sub = toy_kit.submission(tmp_path, "sub", hang, "toy")
    (sub / "student" / f"{toy_kit.module_name(second)}.py").write_text(toy_kit.solution(second))
    tests, elapsed = _grade(kit, sub, "--stage", f"{first},{second}", "--import-timeout", "3")
    stage7 = [t for name, t in tests.items() if name.startswith(f"Stage {first} ")]
    stage8 = [t for name, t in tests.items() if name.startswith(f"Stage {second} ")]
    assert len(stage7) == len(stage8) == 3
    assert all(t["status"] == "failed" and "importing student.toy did not finish" in t["output"]
               and "more than its budget of 3.0" in t["output"] for t in stage7), stage7[0]["output"]
    assert all(t["status"] == "passed" for t in stage8), "the other stage is graded as usual"
    assert elapsed < 60, f"a hang at import cost {elapsed:.0f} s"


def test_each_test_gets_a_cpu_budget_from_its_recorded_reference_time_setup_included(tmp_path):
    kit = toy_kit.make(tmp_path / "kit")
    n = toy_kit.FIRST
    recorded = toy_kit.run(kit, "timings", "--stage", str(n), module="instructor")
    assert recorded.returncode == 0 and "wrote tests/timings.json" in recorded.stdout, recorded.stdout + recorded.stderr
    timings = json.loads((kit / "tests" / "timings.json").read_text())["tests"]
    assert sorted(timings) == [f"tests/test_stage{n}_toy.py::test_{t}" for t in ("add", "double", "prepare")]
    assert all(len(v) == 5 and all(0 <= x < 5 for x in v) for v in timings.values()), timings

    # double() never returns; prepare() spins in the module-scoped fixture, i.e. in test_prepare's setup.
    source = toy_kit.solution().replace("    return 2 * x\n", SPIN).replace('    return "ready"\n', SPIN)
    sub = toy_kit.submission(tmp_path, "sub", source)
    tests, elapsed = _grade(kit, sub, "--stage", str(n), "--timing-floor", "2")
    assert tests[f"Stage {n} · P{n}.1 · test_add"]["status"] == "passed"
    for name, phase in ((f"P{n}.1 · test_double", "call failed"), (f"P{n}.2 · test_prepare", "setup failed")):
        t = tests[f"Stage {n} · {name}"]
        assert t["status"] == "failed" and phase in t["output"] and "more than its budget of 2.0" in t["output"], (
            t["output"])
        assert "Stopped at: process 0 at " in t["output"] and "toy.py" in t["output"], "where it spun"
    assert elapsed < 40, f"two spinning tests with 2 CPU-second budgets cost {elapsed:.0f} s"


def test_what_blocks_is_stopped_by_the_idle_limit_even_deaf_to_signals(tmp_path):
    """A hang in C with every signal blocked (no alarm could interrupt it): stopped from outside, the rest run."""
    kit = toy_kit.make(tmp_path / "kit")
    deaf = ("    import signal, time\n    signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals))\n"
            "    time.sleep(10_000)\n")
    sub = toy_kit.submission(tmp_path, "sub", toy_kit.solution().replace("    return 2 * x\n", deaf))
    n = toy_kit.FIRST
    tests, elapsed = _grade(kit, sub, "--stage", str(n), "--idle-limit", "3")
    t = tests[f"Stage {n} · P{n}.1 · test_double"]
    assert t["status"] == "failed" and "made no progress for 3 s" in t["output"], t["output"]
    assert "it blocks the signal that asks for one" in t["output"], "no stack to show, and why"
    assert tests[f"Stage {n} · P{n}.2 · test_prepare"]["status"] == "passed", "the tests after it still run"
    assert elapsed < 40, f"a blocked test with a 3 s idle limit cost {elapsed:.0f} s"
