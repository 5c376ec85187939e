"""Write benchmark results the same way everywhere: a markdown table on stdout and ``<name>.{md,csv,json}``,
each stamped with the device, library versions, date, implementation and the command line.

Two folders: :data:`RESULTS_DIR` (``benchmarks/results/``) holds the committed tables, measured with the
reference at full size; :data:`SCRATCH_DIR` (``bench-output/``, git-ignored) is where every other run
writes. :mod:`kit.bench` decides which one a run may use.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
SCRATCH_DIR = ROOT / "bench-output"


def command_line() -> str:
    """The command that started this process, as typed: ``python -m benchmarks.bench_ddp --smoke``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    program = f"-m {spec.name}" if spec is not None and spec.name else shlex.quote(sys.argv[0])
    return f"python {program} " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def environment(**extra: str) -> dict[str, str]:
    """Device, versions, date and command (plus ``extra``, e.g. ``impl``): what a reader needs to trust or
    reproduce a number."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = "missing"
    if torch.cuda.is_available():
        device = f"{torch.cuda.get_device_name(0)} ×{torch.cuda.device_count()}"
    else:
        device = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    # CPU timings depend on what else runs: say how busy the machine was (1-minute load average).
    load = f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores" if hasattr(os, "getloadavg") else "unknown"
    return {
        "device": device,
        "load": load,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": sys.version.split()[0],
        **extra,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command_line().strip(),
    }


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])

    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def save_results(name: str, rows: list[dict], *, out_dir: Path, columns: list[str] | None = None,
                 title: str | None = None, stamp: dict[str, str] | None = None) -> dict[str, Path]:
    """Print the table and write ``<name>.csv``, ``<name>.json`` and ``<name>.md`` into ``out_dir``; return
    their paths. ``stamp`` adds entries to the environment stamp."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(**(stamp or {}))
    table = markdown_table(rows, columns)
    header = f"## {title or name}\n\n" + " · ".join(f"{k}: {v}" for k, v in env.items()) + "\n\n"
    print(header + table)
    paths = {"csv": out_dir / f"{name}.csv", "json": out_dir / f"{name}.json", "md": out_dir / f"{name}.md"}
    columns = columns or (list(rows[0]) if rows else [])
    with open(paths["csv"], "w", newline="") as f:
        f.write("".join(f"# {k}: {v}\n" for k, v in env.items()))
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    paths["json"].write_text(json.dumps({"environment": env, "rows": rows}, indent=2, default=str))
    paths["md"].write_text(header + table + "\n")
    return paths
