"""``make timings`` (``python -m instructor timings [--stage N]``): record every graded test's reference run.

Grades the reference with the hidden tests and writes, per test, the wall seconds of setup, call and
teardown and the CPU seconds its workers used in setup and call: ``tests/timings.json`` for the public
tests, ``tests/hidden/timings.json`` for the hidden ones. The grader derives each test's CPU budget from
them (:mod:`kit.grading.timings`). Each stage's entries carry their own provenance (the machine stamp of
:func:`kit.results.machine_stamp` — CPU model, instruction sets, torch's CPU capability and BLAS —, the load,
date and command), since ``--stage`` re-records one stage and leaves the others as they were. Only ``tests`` is
read back (by :mod:`kit.grading.timings`); ``recorded`` is for the people who compare budgets across machines.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kit import stages as registry
from kit.grading.timings import FILES
from kit.results import load_average, machine_stamp

ROOT = Path(__file__).resolve().parent.parent
ABOUT = ("Reference seconds of each graded test: wall [setup, call, teardown], then the CPU its workers used "
         "[setup, call]; the grader derives per-test CPU budgets from them (kit/grading/timings.py). "
         "Regenerate with `make timings`.")


def _stage_of_file(rel: str, root: Path) -> int | None:
    path = root / rel
    return next((s.number for s in registry.STAGES if path in s.test_paths(root)), None)


def _write(path: Path, tests: dict[str, list[float]], recorded: dict[str, dict]) -> None:
    header = {"about": ABOUT, "recorded": recorded}
    lines = [f"  {json.dumps(k)}: {json.dumps(tests[k])}" for k in sorted(tests)]
    body = json.dumps(header, indent=2)[:-2] + ',\n  "tests": {\n  ' + ",\n  ".join(lines) + "\n  }\n}\n"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(body)
    tmp.replace(path)


def record(durations: dict[str, list[float]], root: Path, command: str) -> list[Path]:
    """Merge measured ``{nodeid: [setup, call, teardown, cpu_setup, cpu_call]}`` into the timings files; return
    those written. A file's tests that were not measured this time are dropped when others of the same file
    were (they no longer exist); tests of files not graded this time keep their old times and provenance."""
    # The same stamp as every benchmark table: a budget recorded on one CPU is only comparable with another's
    # when both say which CPU, which instruction sets and which BLAS they ran on.
    # The tests' workers and ranks all run one torch thread (kit.spawn): that, not this process's count, is what
    # the times were measured with.
    stamp = {"machine": {**machine_stamp(), "torch_threads": 1}, "load": load_average(),
             "date": time.strftime("%Y-%m-%d"), "command": command}
    written = []
    for name in FILES:
        path = root / name
        folder = Path(name).parent.as_posix() + "/"
        mine = {k: [round(x, 3) for x in v] for k, v in durations.items()
                if k.startswith(folder) and "/" not in k[len(folder):].split("::")[0]}
        if not mine:
            continue
        old = json.loads(path.read_text()) if path.exists() else {"tests": {}, "recorded": {}}
        measured_files = {k.split("::")[0] for k in mine}
        kept = {k: v for k, v in old["tests"].items()
                if k.split("::")[0] not in measured_files and (root / k.split("::")[0]).exists()}
        recorded = {k: v for k, v in old.get("recorded", {}).items() if k.startswith("stage ")}
        for rel in measured_files:
            stage = _stage_of_file(rel, root)
            if stage is not None:
                recorded[f"stage {stage}"] = stamp
        _write(path, {**kept, **mine}, dict(sorted(recorded.items())))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    from kit.grading.running import grade

    p = argparse.ArgumentParser(prog="python -m instructor timings", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", help="only these stages, e.g. 3 or 3,4 (the others keep their times)")
    p.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    stages = registry.parse_stage_list(args.stage) if args.stage else None
    result = grade("reference", stages=stages, include_hidden=True)
    failed = [t.nodeid for t in result.tests if t.status != "passed"]
    if result.status != "ok" or failed:
        print(f"timings need a complete run with every test passing; {result.status}, failed: {failed[:5]}",
              file=sys.stderr)
        return 1
    command = "python -m instructor timings" + (f" --stage {args.stage}" if args.stage else "")
    for path in record({t.nodeid: t.durations for t in result.tests}, args.root, command):
        print(f"wrote {path.relative_to(args.root)}")
    return 0
