"""The kit's command line, what a student's copy and a grading machine use:
``python -m kit {grade,autograde,check-handout,stages,doctor,nsys-summary,leaderboard}``.

``--help`` on each for details. The instructor's tools (release, autograder bundle, mutants, answer key,
GPU check, timings) are ``python -m instructor``, which never ships.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _stages(text: str | None, option: str = "--stage") -> list[int] | None:
    from kit.stages import parse_stage_list

    try:
        return parse_stage_list(text)
    except ValueError as exc:
        raise SystemExit(f"{option}: {exc}") from None


def limits_of(args: argparse.Namespace):
    from kit.grading.running import Limits

    return Limits(timeout=args.timeout, per_test_timeout=args.per_test_timeout, import_timeout=args.import_timeout,
                  timing_factor=args.timing_factor, timing_floor=args.timing_floor, idle_limit=args.idle_limit,
                  judge_cpu_limit=args.judge_cpu_limit, memory_gb=args.memory_gb or None)


def _grade_batch(args: argparse.Namespace, **kwargs) -> int:
    from kit.grading import processes
    from kit.grading.batch import grade_batch

    out = Path(args.out or Path(args.batch) / "_grades")
    only = args.only.split(",") if args.only else None
    report = grade_batch(Path(args.batch), out, jobs=args.jobs or 1, only=only, force=args.force, **kwargs)
    for r in report.results:
        print(f"{r.submission:<30} {r.score:>6g} / {r.max_score:<6g} {r.status} {r.message}")
    if report.skipped:
        print(f"skipped {len(report.skipped)} submission(s) already graded with their current files, this kit, "
              "these tests and these options (--force regrades them)")
    for name, why in sorted(report.regraded.items()):
        print(f"regraded {name}: {why}")
    print(f"\nwrote {out}/<submission>/results.json and {out / 'gradebook.csv'}")
    if report.interrupted:
        print("interrupted: the gradebook holds every submission finished so far; run the same command again "
              "to grade the rest", file=sys.stderr)
        return processes.interrupted_exit_code() or 1
    return 0


def _refuse_to_grade(args: argparse.Namespace) -> str | None:
    """Why this command cannot grade here (not Linux, the portable path, ``--inline``), or None."""
    from kit.setup.portable import grader_refusal

    if getattr(args, "inline", False):
        return ("--inline is for debugging one test with pytest (`.venv/bin/pytest --inline -k NAME`); a grade always "
                "runs the checks in confined worker processes, never in the grading process")
    return grader_refusal()


def cmd_grade(args: argparse.Namespace) -> int:
    from kit.grading import processes, reporting, running

    refusal = _refuse_to_grade(args)
    if refusal is not None:
        print(f"error: python -m kit grade: {refusal}", file=sys.stderr)
        return 2
    processes.install_interrupt_handlers()
    _warn_below_floor()
    kwargs = dict(stages=_stages(args.stage), include_hidden=args.hidden, limits=limits_of(args))
    if args.jobs is not None and args.jobs < 1:
        print(f"error: --jobs must be at least 1, got {args.jobs}", file=sys.stderr)
        return 2
    if args.batch:
        return _grade_batch(args, **kwargs)
    try:
        result = running.grade(args.impl, jobs=args.jobs or running.grading_jobs(), **kwargs)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if result.status == "error":
        print(result.output[-6000:], file=sys.stderr)
        print(f"error: could not grade {args.impl}: {result.message}", file=sys.stderr)
        return 2
    print(reporting.format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(reporting.gradescope_json(result), indent=2))
        print(f"\nwrote {args.json}")
    if result.status == "interrupted":
        return processes.interrupted_exit_code() or 1
    return 0  # a score of 0 is a result, not an error


def cmd_autograde(args: argparse.Namespace) -> int:
    from kit.grading import processes
    from kit.grading.autograde import autograde

    refusal = _refuse_to_grade(args)
    if refusal is not None:
        print(f"error: python -m kit autograde: {refusal}", file=sys.stderr)
        return 2
    processes.install_interrupt_handlers()
    _warn_below_floor()
    data = autograde(Path(args.submission), Path(args.results), stages=_stages(args.stage), limits=limits_of(args))
    print(f"{data['score']:g} / {data.get('max_score', 0):g} points → {args.results}")
    return processes.interrupted_exit_code() or 0


def cmd_stages(args: argparse.Namespace) -> int:
    from kit import stages

    if args.marker_expression is not None:
        print(stages.marker_expression(_stages(args.marker_expression, "--marker-expression")))
        return 0
    for s in stages.STAGES:
        print(f"{s.number}  {s.title:<28} modules: {', '.join(s.modules):<22} handout: {', '.join(s.chapters)}")
    return 0


def cmd_check_handout(args: argparse.Namespace) -> int:
    from kit.grading.handout_check import main

    return main()


def cmd_doctor(args: argparse.Namespace) -> int:
    from kit.setup.doctor import grader_report, report

    print(grader_report() if args.grader else report())
    return 0


def _warn_below_floor() -> None:
    """Before grading: say what this machine lacks (CPUs, memory, Landlock), so a slow run is not a surprise."""
    from kit.setup.doctor import grader_floor

    for problem in grader_floor():
        print(f"note: {problem}", file=sys.stderr)


def cmd_nsys_summary(args: argparse.Namespace) -> int:
    from kit.nsys import format_summary, summarize_nsys_csv

    if args.steps is not None and args.steps < 1:
        print(f"--steps must be at least 1, got {args.steps}", file=sys.stderr)
        return 2
    rows = summarize_nsys_csv(Path(args.nvtx_csv), Path(args.kern_csv) if args.kern_csv else None, steps=args.steps)
    print(format_summary(rows))
    return 0


def add_limit_options(p: argparse.ArgumentParser) -> None:
    from kit.grading import timings

    p.add_argument("--timeout", type=float, default=1800.0, help="wall-clock seconds per submission")
    p.add_argument("--per-test-timeout", type=float, default=300.0,
                   help="most wall-clock seconds per test: the last resort (hangs are stopped by the CPU budget and "
                        "the idle limit)")
    p.add_argument("--import-timeout", type=float, default=30.0,
                   help="CPU (or idle) seconds each stage's modules may take to import before that stage fails")
    p.add_argument("--timing-factor", type=float, default=timings.FACTOR,
                   help="a test's workers may use this many times the CPU the reference's used…")
    p.add_argument("--timing-floor", type=float, default=timings.FLOOR, help="…but at least this many CPU-seconds")
    p.add_argument("--idle-limit", type=float, default=timings.IDLE,
                   help="seconds a test's workers may make no progress (blocked) before they are stopped")
    p.add_argument("--judge-cpu-limit", type=float, default=timings.JUDGE_CPU_LIMIT,
                   help="CPU-seconds the judge itself may spend on one test (reading and checking what the workers "
                        "sent; 0: none)")
    p.add_argument("--memory-gb", type=float, default=8.0, help="address-space limit per process (CPU; 0: none)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kit", description="LLM Systems Lab tools")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("grade", help="grade student/, reference/, a submission folder, or a batch of them")
    g.add_argument("--impl", default="student", help="student (default), reference, or a submission folder")
    g.add_argument("--stage", help="only these stages, e.g. 1 or 1,2")
    g.add_argument("--json", help="write Gradescope results.json here")
    g.add_argument("--batch", help="grade every subfolder of this folder")
    g.add_argument("--out", help="with --batch: where results and gradebook.csv go (default BATCH/_grades)")
    g.add_argument("--hidden", action="store_true", help="include the instructor-only hidden tests")
    add_limit_options(g)
    g.add_argument("--inline", action="store_true", help=argparse.SUPPRESS)  # refused, saying why (pytest's option)
    g.add_argument("--jobs", type=int, default=None,
                   help="with --batch: submissions graded in parallel (default 1); otherwise: groups of stages graded "
                        "side by side (default 2 with 2+ CPUs and 6 GiB free, else 1)")
    g.add_argument("--only", help="with --batch: regrade these submissions (comma-separated); other rows stay")
    g.add_argument("--force", action="store_true",
                   help="with --batch: regrade every submission (default: skip those already graded as they are)")
    g.set_defaults(func=cmd_grade)

    a = sub.add_parser("autograde", help="grade one uploaded submission (what Gradescope's run_autograder calls)")
    a.add_argument("--submission", required=True, help="the uploaded submission folder")
    a.add_argument("--results", required=True, help="where results.json goes")
    a.add_argument("--stage", help="only these stages (for quick local checks)")
    add_limit_options(a)
    a.set_defaults(func=cmd_autograde)

    c = sub.add_parser("check-handout", help="check that the handout, the tests and the points agree")
    c.set_defaults(func=cmd_check_handout)

    st = sub.add_parser("stages", help="the stage registry (kit/stages.py): numbers, titles, modules, chapters")
    st.add_argument("--marker-expression", nargs="?", const="", metavar="STAGES",
                    help="print the pytest -m expression selecting these stages (default: all), e.g. 1,3")
    st.set_defaults(func=cmd_stages)

    d = sub.add_parser("doctor", help="what this machine can run: versions, CUDA, Triton mode, nsys")
    d.add_argument("--grader", action="store_true",
                   help="instead: this machine against what grading needs (CPUs, memory, Landlock)")
    d.set_defaults(func=cmd_doctor)

    n = sub.add_parser("nsys-summary", help="kernel time per NVTX range from `nsys stats` CSV files")
    n.add_argument("nvtx_csv", help="CSV of `nsys stats --report nvtx_sum --format csv`")
    n.add_argument("kern_csv", nargs="?", help="CSV of `nsys stats --report cuda_gpu_kern_sum --format csv`")
    n.add_argument("--steps", type=int, default=None,
                   help="steps in the capture (bench_model's --iters): adds invocations per step")
    n.set_defaults(func=cmd_nsys_summary)

    sub.add_parser("leaderboard", add_help=False,
                   help="time a whole training step after a correctness gate; --collect DIR ranks entries "
                        "(python -m kit leaderboard --help)")

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["leaderboard"]:  # its own parser, options and all (kit/leaderboard/cli.py)
        from kit.leaderboard import main as leaderboard

        return leaderboard(argv[1:])
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
