"""Turn ``nsys stats`` CSV output into a per-NVTX-range summary.

Run on the profiled machine::

    nsys stats --report nvtx_sum --format csv --output prof report.nsys-rep          # → prof_nvtx_sum.csv
    nsys stats --report cuda_gpu_kern_sum --format csv --output prof report.nsys-rep # → prof_cuda_gpu_kern_sum.csv
    python -m kit nsys-summary prof_nvtx_sum.csv prof_cuda_gpu_kern_sum.csv

Column names differ slightly between nsys versions ("Time (%)" vs "Time(%)", "Range" vs "Name"), so
columns are matched by normalised name. Times are nanoseconds unless nsys was given ``--timeunit``.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path


def _norm(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _read_csv(path: Path) -> list[dict[str, str]]:
    text = path.read_text()
    # nsys may print a banner before the header; the header is the first line with several commas.
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.count(",") >= 3), 0)
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    return [{_norm(k): (v or "").strip() for k, v in row.items() if k is not None} for row in reader]


def _get(row: dict[str, str], *names: str) -> str:
    for n in names:
        if _norm(n) in row:
            return row[_norm(n)]
    raise KeyError(f"none of the columns {names} in nsys CSV (have {sorted(row)})")


def summarize_nsys_csv(nvtx_csv: Path, kern_csv: Path | None = None, steps: int | None = None) -> list[dict]:
    """Rows of ``{range, instances, total_ms, avg_ms, share}`` sorted by total time, plus the top kernels.

    Kernels are not attributed to ranges by ``nsys stats`` CSVs; the kernel table is appended as rows
    with ``kind == "kernel"`` so one table shows where the time goes. With ``steps`` (the number of steps
    the capture holds: ``bench_model --iters``), each row also has ``per_step``: its invocations per step.
    """
    rows = []
    for r in _read_csv(nvtx_csv):
        total_ns = float(_get(r, "Total Time (ns)", "Total Time", "TotalTime"))
        rows.append({
            "kind": "nvtx",
            "name": _get(r, "Range", "Name").lstrip(":"),
            "instances": int(float(_get(r, "Instances", "Count", "Num Calls"))),
            "total_ms": total_ns / 1e6,
            "avg_ms": float(_get(r, "Avg (ns)", "Average", "Avg")) / 1e6,
        })
    if kern_csv is not None:
        for r in _read_csv(kern_csv):
            rows.append({
                "kind": "kernel",
                "name": _get(r, "Name"),
                "instances": int(float(_get(r, "Instances", "Count"))),
                "total_ms": float(_get(r, "Total Time (ns)", "Total Time")) / 1e6,
                "avg_ms": float(_get(r, "Avg (ns)", "Average", "Avg")) / 1e6,
            })
    if steps is not None:
        for r in rows:
            r["per_step"] = r["instances"] / steps
    for kind in ("nvtx", "kernel"):
        total = sum(r["total_ms"] for r in rows if r["kind"] == kind) or 1.0
        for r in rows:
            if r["kind"] == kind:
                r["share"] = r["total_ms"] / total
    return sorted(rows, key=lambda r: (r["kind"] != "nvtx", -r["total_ms"]))


def format_summary(rows: list[dict]) -> str:
    per_step = any("per_step" in r for r in rows)
    out = ["| kind | name | instances |" + (" per step |" if per_step else "") + " total ms | avg ms | share |",
           "|---|---|---:|" + ("---:|" if per_step else "") + "---:|---:|---:|"]
    for r in rows:
        name = r["name"] if len(r["name"]) <= 70 else r["name"][:67] + "…"
        step = f" {r['per_step']:g} |" if per_step else ""
        out.append(f"| {r['kind']} | {name} | {r['instances']} |{step} {r['total_ms']:.3f} | {r['avg_ms']:.4f} | "
                   f"{100 * r['share']:.1f}% |")
    return "\n".join(out)
