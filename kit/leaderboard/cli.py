"""``python -m kit leaderboard`` (and ``python -m kit.leaderboard``): the command line; its help is the package's
docstring."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from .entries import collect, write_entry
from .steps import _options_rank, impl_builder, naive_builder
from .tasks import BASELINES, CHOICES, OUTPUT, ROOT, TASKS, check_launch, get_task, hardware_problem, step_config
from .timing import run_entry


def _parse_sets(pairs: list[str]) -> dict[str, Any]:
    """``["loss=fused", "micro_batches=2"]`` → ``{"loss": "fused", "micro_batches": 2}`` (JSON values where they
    parse, strings otherwise)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--set takes key=value, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    from kit.launch import exit_on_launch_error

    with exit_on_launch_error("leaderboard"):  # a wrong launch: a message and exit status 2 on every rank
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(prog="python -m kit leaderboard", description=sys.modules[__package__].__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="cpu", help=f"one of {sorted(TASKS)} (default cpu)")
    p.add_argument("--step", choices=("impl", "naive"), default="impl",
                   help="impl: the implementation's build_train_step (default); naive: the kit's naive step")
    p.add_argument("--impl", choices=("student", "reference"), default=None,
                   help="which implementation (default: $LLMSYS_IMPL, else student)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override one of your leaderboard_options ({', '.join(CHOICES)})")
    p.add_argument("--name", default=None, help="the entry's name in the table (default: the implementation's)")
    p.add_argument("--out", type=Path, default=None, help=f"folder for the entry (default {OUTPUT.name}/)")
    p.add_argument("--warmup", type=int, default=None, help="override the task's warm-up steps (not for entries "
                   "you submit)")
    p.add_argument("--steps", type=int, default=None, help="override the task's timed steps (idem)")
    p.add_argument("--collect", type=Path, default=None, metavar="DIR", help="rank the entries in DIR instead")
    p.add_argument("--baselines", type=Path, default=BASELINES, help="baseline entries added to --collect's table")
    args = p.parse_args(argv)
    if args.collect is not None:
        if not args.collect.is_dir():
            p.error(f"--collect {args.collect}: not a folder")
        paths = collect(args.collect, baselines=args.baselines, out=args.out)
        print(paths["md"].read_text())
        print(f"wrote {paths['md']} and {paths['png']}")
        return 0
    from kit.impl import ENV_VAR, selected
    from kit.launch import is_main, launched
    from kit.spawn import run_on_ranks

    try:
        task = get_task(args.task)
        sets = _parse_sets(args.set)
    except ValueError as exc:
        p.error(str(exc))
    launch = launched()  # under torchrun: this process is one rank; checked before any rank waits for a peer
    check_launch(task, launch)
    problem = hardware_problem(task, launch)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    impl = selected(args.impl)
    os.environ[ENV_VAR] = impl  # the ranks load the same implementation
    if args.step == "naive":
        kind, builder, options, code = "naive", naive_builder, {}, None
    else:
        kind = "reference" if impl == "reference" else "student"
        builder = impl_builder
        # Your leaderboard_options, read in a worker rank: this process never runs the implementation. Under a
        # launcher it is one of the ranks, which run the implementation anyway (see the module's docstring).
        mine = (_options_rank(task.name, task.device) if launch is not None else
                run_on_ranks(_options_rank, 1, args=(task.name, task.device), timeout=120)[0])
        options = {**mine, **sets}
        code = ROOT / impl
    try:
        step_config(task, options, gate=False)
    except ValueError as exc:
        p.error(str(exc))
    log_name = args.name or ("naive" if kind == "naive" else impl)
    main_rank = is_main()  # alone, or rank 0 under torchrun: the one that prints and writes the entry
    if main_rank:
        print(f"leaderboard task {task.name}: {task.title}\n{kind} step, options {options}")
    entry = run_entry(task, kind=kind, options=options, builder=builder, name=log_name, code=code,
                      warmup=args.warmup, steps=args.steps)
    passed = entry["gate"]["passed"] and entry["within_budget"]
    if not main_rank:
        return 0 if passed else 1
    path = write_entry(entry, args.out or OUTPUT)
    timing = entry.get("timing", {})
    if "median_s" in timing:
        mfu = f", MFU {timing['mfu']:.1%}" if timing.get("mfu") else ""
        print(f"median step {timing['median_s']:.4g} s (IQR {timing['iqr_s']:.3g} s, {timing['steps']} steps), "
              f"{timing['tokens_per_s']:.4g} tokens/s{mfu}, peak {timing['peak_memory_mib']:.0f} MiB "
              f"({timing['memory_kind']}); wall {entry['wall_s']} s of {task.budget_s:.0f}")
    print(f"wrote {path}")
    return 0 if entry["gate"]["passed"] and entry["within_budget"] else 1
