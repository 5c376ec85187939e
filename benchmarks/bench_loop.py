"""The feedback loop: how long a student, an instructor and CI wait for the kit's own commands.

    python -m benchmarks.bench_loop                       # every row below, reference and stubs (~6 min, 2 cores)
    python -m benchmarks.bench_loop --smoke               # the spawns and Stage 1 only (seconds)
    python -m benchmarks.bench_loop --rows spawn stage3   # some rows
    python -m benchmarks.bench_loop --impl reference --save   # the committed benchmarks/results/loop.* tables
    make bench-loop                                        # the same as --impl reference --save

Each row is one command, run from the repository root in a fresh process and timed on the wall clock
(start-up included: that is what the person typing it waits for):

* ``stageN``: one stage's tests, ``pytest -q -m stageN`` on the chosen implementation, the first time:
  the graded compile checks find Triton's compile cache (``kit.triton_compile.user_cache_dir``) empty, as on
  a fresh machine (every row runs with ``XDG_CACHE_HOME`` in a folder of this benchmark's own). In this
  repository that includes the stage's hidden tests; ``public_s`` is the same run without them
  (``-m "stageN and not hidden"``, with a compile cache of its own): what a student's release runs;
* ``stage3-again``: the same for Stage 3 once more, as a student's next run: the kernels did not change, so
  the compile check finds them in the cache the run before left;
* ``grade``: the whole graded suite, ``python -m kit grade --impl reference``;
* ``grade-stubs``: the generated stubs, ``python -m kit grade --impl student`` (every test fails);
* ``grade-hidden``: the graded suite with the hidden tests, ``python -m kit grade --impl reference --hidden``;
* ``spawn2``, ``spawn8``: ``kit.spawn.run_on_ranks`` of a function that does nothing, on 2 and 8 ranks.

The goal column holds the goals of the fast-loop issue (a quiet 2-core machine); a row says whether it
met its goal. The machine's load is in the stamp: numbers measured next to other work are slower.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit import bench
from kit import stages as registry

ROOT = Path(__file__).resolve().parent.parent
GOALS_S = {"stage": 15.0, "grade": 60.0, "grade-stubs": 20.0, "grade-hidden": 90.0}
AGAIN = "stage3-again"  # the stage whose compile check dominates, run a second time
# Every command of one benchmark run keeps its caches here, so the first run of each command is a cold one.
# The public runs have their own, so that theirs is a first run too.
CACHE_HOME = Path(tempfile.mkdtemp(prefix="bench-loop-cache-"))
atexit.register(shutil.rmtree, CACHE_HOME, ignore_errors=True)


def _nothing() -> None:
    """What the empty spawns run: the time is start-up, joining the group and tearing it down."""


def _spawn_seconds(world: int) -> float:
    from kit.spawn import run_on_ranks

    start = time.perf_counter()
    run_on_ranks(_nothing, world, timeout=300, backend="gloo")
    return time.perf_counter() - start


def _command_seconds(command: list[str], impl: str, cache: str = "all") -> tuple[float, int]:
    (CACHE_HOME / cache).mkdir(exist_ok=True)
    env = {**os.environ, "LLMSYS_IMPL": impl, "XDG_CACHE_HOME": str(CACHE_HOME / cache)}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start, done.returncode


def rows_to_run(names: list[str] | None, smoke: bool) -> list[str]:
    stages = [f"stage{s.number}" for s in registry.STAGES]
    stages.insert(stages.index(AGAIN.removesuffix("-again")) + 1, AGAIN)
    every = stages + ["grade", "grade-stubs", "grade-hidden", "spawn2", "spawn8"]
    if smoke:
        return ["spawn2", "spawn8", "stage1"]
    if not names:
        return every
    chosen = [r for r in every if any(r == n or (n == "spawn" and r.startswith("spawn"))
                                      or (n == "stage" and r.startswith("stage")) for n in names)]
    unknown = [n for n in names if n not in ("spawn", "stage") and n not in every]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; choose from {every} (or 'stage', 'spawn')")
    return chosen


def measure(row: str, impl: str) -> dict:
    python = sys.executable
    if row.startswith("spawn"):
        world = int(row[5:])
        return {"row": row, "command": f"run_on_ranks(nothing, {world})", "impl": "-",
                "seconds": _spawn_seconds(world), "public_s": None, "goal_s": None, "exit": 0}
    public = None
    if row.startswith("stage"):
        marker = row.removesuffix("-again")
        command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker]
        goal, used = GOALS_S["stage"], impl
        public_command = [*command[:-1], f"{marker} and not hidden"]
        if row == AGAIN and not (CACHE_HOME / "all").is_dir():
            _command_seconds(command, used)  # run alone: the first run, untimed, fills the cache
            _command_seconds(public_command, used, cache="public")
        public, public_code = _command_seconds(public_command, used, cache="public")
    elif row == "grade":
        command, goal, used = [python, "-m", "kit", "grade", "--impl", impl], GOALS_S["grade"], impl
    elif row == "grade-stubs":
        command, goal, used = [python, "-m", "kit", "grade", "--impl", "student"], GOALS_S["grade-stubs"], "student"
    else:
        command, goal, used = [python, "-m", "kit", "grade", "--impl", impl, "--hidden"], GOALS_S["grade-hidden"], impl
    seconds, code = _command_seconds(command, used)
    if public is not None:
        code = code or public_code
    shown = " ".join(["python" if c == python else c for c in command])
    return {"row": row, "command": shown, "impl": used, "seconds": seconds, "public_s": public, "goal_s": goal,
            "exit": code}


def _met(seconds: float, goal: float) -> str:
    over = seconds - goal
    return "yes" if over <= 0 else f"no (+{over:.0f} s)" if over >= 10 else f"no (+{over:.1f} s)"


def main(argv: list[str] | None = None) -> list[dict]:
    p = bench.parser(__doc__)
    p.add_argument("--rows", nargs="+", default=None,
                   help=f"rows to run: stage1 … stage7, {AGAIN}, grade, grade-stubs, grade-hidden, spawn2, spawn8; "
                        "'stage' or 'spawn' for all of a kind (default: all)")
    args = bench.parse(p, argv)
    rows = []
    for row in bench.progress(rows_to_run(args.rows, args.smoke), "commands", unit="command"):
        result = measure(row, args.impl)
        goal = result["goal_s"]
        result["met"] = "" if goal is None else _met(result["seconds"], goal)
        result["public_met"] = None if result["public_s"] is None else _met(result["public_s"], goal)
        rows.append(result)
    bench.save("loop", rows, args, title="The feedback loop: wall seconds per command (start-up included)",
               columns=["row", "command", "impl", "seconds", "goal_s", "met", "public_s", "public_met", "exit"])
    fig, ax = bench.subplots(figsize=(8, 4))
    ax.barh([r["row"] for r in rows], [r["seconds"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        if r["goal_s"] is not None:
            ax.plot([r["goal_s"]] * 2, [i - 0.4, i + 0.4], color="tab:red")
    ax.invert_yaxis()
    ax.set(xlabel="seconds (wall clock)", title="Feedback loop (red: goal)")
    bench.save_figure(fig, "loop", args)
    return rows


if __name__ == "__main__":
    main()
