"""The benchmark skeleton: what every ``benchmarks/bench_*.py`` shares, and nothing more.

A benchmark is a module run from the repository root (``python -m benchmarks.bench_<topic>``) that reads
top to bottom: its own options on top of :func:`parser`'s, its configurations in a loop under
:func:`progress`, one row per configuration, then :func:`save` for the stamped table and
:func:`save_figure` for the plot. ``main(argv)`` returns the rows. For example::

    def main(argv: list[str] | None = None) -> list[dict]:
        p = bench.parser(__doc__)
        p.add_argument("--sizes", nargs="+", type=int, default=[64, 128])
        args = bench.parse(p, argv)                       # args.smoke, args.impl, args.out
        impl = load(args.impl)
        rows = [measure(impl, n) for n in bench.progress(args.sizes, "sizes")]
        bench.save("demo", rows, args, title="What was measured")
        fig, ax = bench.subplots()
        ax.plot([r["n"] for r in rows], [r["ms"] for r in rows])
        bench.save_figure(fig, "demo", args)
        return rows

Where results go — never over the committed tables by accident:

* by default into ``bench-output/`` (git-ignored), with ``--smoke`` into ``bench-output/smoke/``;
* with ``--out DIR`` into DIR;
* with ``--save`` into ``benchmarks/results/``, the committed tables. Only a full run (no ``--smoke``) of
  the reference (``--impl reference``) may write there; ``--out benchmarks/results`` obeys the same rule.

Every table is stamped with the machine that made it (:func:`kit.results.machine_stamp`: CPU model, instruction
sets, bf16 units, torch's CPU capability and BLAS). A benchmark that times bf16 on a CPU passes
:func:`bf16_notes` to :func:`save`: on a CPU without bf16 units its bf16 rows are emulated, slower than fp32.

Distributed benchmarks time a step on every rank with :func:`step_time`, start their ranks with
:func:`kit.launch.on_ranks` (spawned here, or this process is one of torchrun's ranks) and let rank 0 alone save
(:func:`kit.launch.is_main`).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .impl import CHOICES, ENV_VAR, selected
from .results import RESULTS_DIR, SCRATCH_DIR, bf16_note, machine_stamp, save_results


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark has: ``--smoke``, ``--impl``, ``--out``, ``--save``.

    ``doc`` (the benchmark's module docstring) is its ``--help`` text.
    """
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds on a CPU (the test suite runs it)")
    p.add_argument("--impl", choices=CHOICES, default=None,
                   help=f"implementation to measure (default: ${ENV_VAR}, else student)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"folder for tables and plots (default: {SCRATCH_DIR.name}/, or {SCRATCH_DIR.name}/smoke/)")
    p.add_argument("--save", action="store_true",
                   help="write the committed tables under benchmarks/results/ (full reference runs only)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads on a CPU (default 1, as each spawned rank has: stable timings when other "
                        "processes share the machine)")
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` and settle the shared options: ``args.impl`` becomes a package name, ``args.out`` the
    folder this run writes to (see the module docstring), and a CPU run uses ``args.threads`` threads. A run
    that may not write the committed tables but asks to is refused with a usage error."""
    import torch

    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    args.impl = selected(args.impl)
    if args.save and args.out is not None:
        p.error("--save writes benchmarks/results/; give --save or --out DIR, not both")
    out = RESULTS_DIR if args.save else args.out or (SCRATCH_DIR / "smoke" if args.smoke else SCRATCH_DIR)
    args.out = Path(out).resolve()
    if args.out.is_relative_to(RESULTS_DIR.resolve()):
        if args.smoke:
            p.error("--smoke never writes benchmarks/results/: those tables are full-size measurements")
        if args.impl != "reference":
            p.error(f"benchmarks/results/ holds the reference's measurements; this run measures {args.impl!r}. "
                    f"Leave out --save (results go to {SCRATCH_DIR.name}/) or pass --out DIR")
    # Spawned ranks call kit.impl.load() themselves: they inherit the choice through the environment.
    os.environ[ENV_VAR] = args.impl
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    return args


def progress(items: Iterable, desc: str, unit: str = "config"):
    """A tqdm progress bar over ``items``; inside a process group, or under a launcher, only rank 0 draws it."""
    import torch.distributed as dist
    from tqdm import tqdm

    from .launch import is_main

    # Under torchrun every process runs main(): rank 0 alone draws, before and inside the process group.
    quiet = (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0) or not is_main()
    return tqdm(items, desc=desc, unit=unit, disable=quiet, dynamic_ncols=True)


def bf16_notes(measures_bf16: bool) -> list[str]:
    """The notes for a table that times bf16 on this CPU: one line, printed now (before a long run) and to be
    passed to :func:`save`, when the CPU has no bf16 units (or may have none), so that nobody reads its bf16 rows
    as what bf16 does elsewhere. Nothing when ``measures_bf16`` is false or the rows run on a GPU."""
    import torch

    if not measures_bf16 or torch.cuda.is_available():
        return []
    note = bf16_note(machine_stamp())
    if note is None:
        return []
    print(f"Note: {note}", flush=True)
    return [note]


def save(name: str, rows: list[dict], args: argparse.Namespace, *, title: str,
         columns: list[str] | None = None, notes: list[str] | None = None) -> dict[str, Path]:
    """Print the markdown table and write ``<name>.{md,csv,json}`` into ``args.out``, stamped with the device,
    versions, date, command, implementation (and the launcher, under torchrun) and the machine (CPU model,
    instruction sets, BLAS: :func:`kit.results.machine_stamp`), with ``notes`` (e.g. :func:`bf16_notes`) above
    the table. Returns the paths by suffix."""
    from .launch import describe, launched

    stamp = {"impl": args.impl}
    launch = launched()
    if launch is not None:
        stamp["launcher"] = describe(launch)
    return save_results(name, rows, out_dir=args.out, columns=columns, title=title, stamp=stamp, notes=notes)


def subplots(*args: Any, **kwargs: Any):
    """``matplotlib.pyplot.subplots`` on the headless Agg backend: ``(fig, axes)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_figure(fig, name: str, args: argparse.Namespace) -> Path:
    """Lay out, write ``<name>.png`` into ``args.out`` and close ``fig`` (a long run must not keep figures)."""
    import matplotlib.pyplot as plt

    path = Path(args.out) / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")
    return path


def step_time(step: Callable[[], Any], device=None, group=None) -> float:
    """Seconds one ``step()`` takes on the ranks of ``group`` (default: all), the slowest rank's time.

    Every rank waits for its device's queued work and for the others (barrier) so that all start
    together, times its own call up to the end of its device work, then the maximum over the ranks is
    taken (all-reduce MAX): a synchronous step is as slow as its slowest rank. Call it on every rank.
    ``device`` defaults to this rank's (``kit.spawn.rank_device``).
    """
    import torch
    import torch.distributed as dist

    from .spawn import rank_device

    device = device or rank_device()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    dist.barrier(group=group)
    start = time.perf_counter()
    step()
    sync()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed.item())
