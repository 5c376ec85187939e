"""Write benchmark results the same way everywhere: a markdown table on stdout, CSV + JSON under
``benchmarks/results/``, each stamped with the device, library versions, date and the command line."""

from __future__ import annotations

import csv
import datetime as dt
import json
import platform
import shlex
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def environment() -> dict[str, str]:
    """Device, versions, date and command: what a reader needs to trust or reproduce a number."""
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
    return {
        "device": device,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": sys.version.split()[0],
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
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


def save_results(name: str, rows: list[dict], *, out_dir: Path | None = None, columns: list[str] | None = None,
                 title: str | None = None) -> dict[str, Path]:
    """Print the table and write ``<name>.csv``, ``<name>.json`` and ``<name>.md``; return their paths."""
    out_dir = Path(out_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    table = markdown_table(rows, columns)
    stamp = " · ".join(f"{k}: {v}" for k, v in env.items())
    header = f"## {title or name}\n\n{stamp}\n\n"
    print(header + table)
    paths = {"csv": out_dir / f"{name}.csv", "json": out_dir / f"{name}.json", "md": out_dir / f"{name}.md"}
    columns = columns or list(rows[0]) if rows else []
    with open(paths["csv"], "w", newline="") as f:
        f.write("".join(f"# {k}: {v}\n" for k, v in env.items()))
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    paths["json"].write_text(json.dumps({"environment": env, "rows": rows}, indent=2, default=str))
    paths["md"].write_text(header + table + "\n")
    return paths
