"""``python -m instructor {release,autograder,mutants,answers,gpu-check,timings,numerics,new-stage,clean-machine,
checklist,figures}``:
instructor tools.

Each command's own ``--help`` says more; the Makefile targets call these (``make student``, ``make release``,
``make autograder``, ``make mutants``, ``make answers``, ``make gpu-check``, ``make timings``, ``make new-stage``,
``make test-clean-machine``, ``make check-test``, ``make figures``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_release(args: argparse.Namespace) -> int:
    from instructor import release

    if not (args.student or args.check or args.build):
        print("python -m instructor release: say what to do: --student (regenerate student/, `make student`), "
              "--check (fail when student/ is stale) or --build (dist/student-release/, `make release`)",
              file=sys.stderr)
        return 2
    if args.student:
        written = release.write_student(level=args.level)
        print(f"regenerated student/ from reference/ at the {args.level} level ({len(written)} files)")
    if args.check:
        stale = release.stale_student_files()
        if stale:
            print("student/ is stale — run `make student`: " + ", ".join(stale), file=sys.stderr)
            return 1
        print("student/ is up to date with reference/")
    if args.build:
        out = release.build_release(Path(args.out) if args.out else release.ROOT / "dist" / "student-release",
                                    level=args.level)
        print(f"built the student release in {out}")
    return 0


def cmd_autograder(args: argparse.Namespace) -> int:
    from instructor.autograder import build_autograder

    print(f"built {build_autograder(Path(args.out)) if args.out else build_autograder()}")
    return 0


# Commands whose options belong to their own module (``--help`` included): the rest of the line goes there.
PASS_THROUGH = {
    "mutants": ("instructor.mutants", "does each catalogued mistake fail a public test; do the designs pass"),
    "answers": ("instructor.answer_key", "render the answer key into answers-output/"),
    "gpu-check": ("instructor.gpu_check", "on a CUDA machine: the whole GPU path → benchmarks/results/gpu/"),
    "timings": ("instructor.timings", "record every graded test's reference run in tests/timings.json"),
    "numerics": ("instructor.numerics", "grade the reference on each CPU code path (MKL_CBWR × ATEN_CPU_CAPABILITY)"),
    "new-stage": ("instructor.scaffold", "write the skeletons of a new stage and its registry entry"),
    "clean-machine": ("instructor.clean_machine", "make setup and the README's commands in a clean Debian root, timed"),
    "checklist": ("instructor.checklist", "CONTRIBUTING's checklist for a graded test file, checked (make check-test)"),
    "figures": ("instructor.figures", "the docs' measured figures from their stamped results (make figures)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in PASS_THROUGH:
        import importlib

        return importlib.import_module(PASS_THROUGH[argv[0]][0]).main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m instructor", description="LLM Systems Lab: instructor tools")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("release", help="regenerate student/, check it, or build the student release")
    r.add_argument("--student", action="store_true", help="regenerate student/ from reference/")
    r.add_argument("--check", action="store_true", help="fail when student/ is stale")
    r.add_argument("--build", action="store_true", help="build dist/student-release/")
    r.add_argument("--out", help="release folder (default dist/student-release)")
    r.add_argument("--level", choices=("guided", "open"), default="guided",
                   help="stubs: guided (default, what student/ holds) or open (public API only)")
    r.set_defaults(func=cmd_release)
    b = sub.add_parser("autograder", help="build dist/autograder.zip for Gradescope")
    b.add_argument("--out", help="bundle path (default dist/autograder.zip)")
    b.set_defaults(func=cmd_autograder)
    for name, (_, summary) in PASS_THROUGH.items():
        sub.add_parser(name, help=f"{summary} (its options: python -m instructor {name} --help)", add_help=False)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
