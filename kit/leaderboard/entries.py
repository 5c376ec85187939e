"""Entries: the JSON file a run writes (hashed, stamped), and ``--collect``: a folder of entries → a ranked table
and a plot."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from pathlib import Path
from typing import Any

from .tasks import BASELINES, FORMAT, TASKS


def files_hash(folder: Path) -> dict[str, Any]:
    """SHA-256 over the ``.py`` files under ``folder`` (relative path and bytes of each, sorted), and their count."""
    h = hashlib.sha256()
    paths = sorted(p for p in Path(folder).rglob("*.py") if "__pycache__" not in p.parts)
    for p in paths:
        h.update(p.relative_to(folder).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return {"sha256": h.hexdigest(), "count": len(paths)}


def entry_hash(entry: dict[str, Any]) -> str:
    """SHA-256 of an entry's content without its own ``entry_sha256`` (canonical JSON)."""
    body = {k: v for k, v in entry.items() if k != "entry_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def write_entry(entry: dict[str, Any], out: Path) -> Path:
    """Write ``entry`` as ``<task>-<name>-<UTC time>.json`` into ``out``; returns the path."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    path = out / f"{entry['task']}-{_slug(entry['name'])}-{stamp}.json"
    path.write_text(json.dumps(entry, indent=2, default=str) + "\n")
    return path


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in str(text))[:40] or "entry"


# ----------------------------------------------------------------------------------------------------
# --collect: a folder of entries → a ranked table and a plot
# ----------------------------------------------------------------------------------------------------


def entry_status(entry: dict[str, Any], path: Path) -> str:
    """``ok``, or why the entry is not ranked: ``edited`` (its own hash does not match), ``failed gate``,
    ``no timing``, ``over budget``, ``hash mismatch`` (the code next to it, ``<folder>/<entry stem>/``, hashes
    differently); ``ok (code not checked)`` when there is no code next to it."""
    if entry.get("entry_sha256") != entry_hash(entry):
        return "edited"
    if not entry.get("gate", {}).get("passed"):
        return "failed gate"
    timing = entry.get("timing", {})
    if "median_s" not in timing:
        return "no timing"
    if not entry.get("within_budget"):
        return "over budget"
    code = path.with_suffix("")
    if code.is_dir():
        root = code / entry.get("files", {}).get("root", "student")
        found = files_hash(root if root.is_dir() else code)
        return "ok" if found["sha256"] == entry.get("files", {}).get("sha256") else "hash mismatch"
    return "ok (code not checked)" if entry.get("kind") == "student" else "ok"


def collect(folder: Path, *, baselines: Path | None = BASELINES, out: Path | None = None) -> dict[str, Path]:
    """Rank the entries in ``folder`` (and the baselines) per task; write ``leaderboard.md`` and ``leaderboard.png``
    into ``out`` (default ``folder``) and return their paths."""
    rows: list[dict[str, Any]] = []
    sources = [(p, False) for p in sorted(Path(folder).glob("*.json"))]
    if baselines is not None and Path(baselines).is_dir() and Path(baselines).resolve() != Path(folder).resolve():
        sources += [(p, True) for p in sorted(Path(baselines).glob("*.json"))]
    for path, baseline in sources:
        try:
            entry = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            rows.append({"task": "?", "name": path.name, "status": f"unreadable ({exc.__class__.__name__})"})
            continue
        if not isinstance(entry, dict) or entry.get("format") != FORMAT:
            rows.append({"task": "?", "name": path.name, "status": "not an entry"})
            continue
        timing = entry.get("timing", {})
        rows.append({
            "task": entry.get("task", "?"), "name": entry.get("name", path.stem), "path": path,
            "kind": ("baseline: " if baseline else "") + str(entry.get("kind", "?")),
            "status": entry_status(entry, path), "median_s": timing.get("median_s"), "iqr_s": timing.get("iqr_s"),
            "tokens_per_s": timing.get("tokens_per_s"), "mfu": timing.get("mfu"),
            "peak_memory_mib": timing.get("peak_memory_mib"),
            "options": ", ".join(f"{k}={v}" for k, v in sorted(entry.get("options", {}).items())),
            "device": entry.get("environment", {}).get("device", "?"), "date": entry.get("environment", {}).get("date"),
        })
    out = Path(out or folder)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Leaderboard — {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M UTC}", ""]
    for task in sorted({r["task"] for r in rows}):
        mine = [r for r in rows if r["task"] == task]
        ranked = sorted((r for r in mine if str(r["status"]).startswith("ok")), key=lambda r: r["median_s"])
        others = [r for r in mine if not str(r["status"]).startswith("ok")]
        title = TASKS[task].title if task in TASKS else task
        lines += [f"## {task}: {title}", "",
                  "| rank | name | kind | median step (s) | IQR (s) | tokens/s | MFU | peak MiB | options | device "
                  "| status |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for i, r in enumerate(ranked, 1):
            lines.append(f"| {i} | {r['name']} | {r['kind']} | {r['median_s']:.4g} | {_fmt(r['iqr_s'])} | "
                         f"{_fmt(r['tokens_per_s'], '.4g')} | {_fmt(r['mfu'], '.1%')} | "
                         f"{_fmt(r['peak_memory_mib'], '.0f')} | {r['options']} | {r['device']} | {r['status']} |")
        for r in others:
            lines.append(f"| — | {r['name']} | {r.get('kind', '?')} | {_fmt(r.get('median_s'))} | | | | | "
                         f"{r.get('options', '')} | {r.get('device', '')} | **{r['status']}** |")
        lines.append("")
    table = out / "leaderboard.md"
    table.write_text("\n".join(lines) + "\n")
    plot = out / "leaderboard.png"
    _plot(rows, plot)
    return {"md": table, "png": plot}


def _fmt(value: Any, spec: str = ".3g") -> str:
    return "" if value is None else format(value, spec)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Median step time (bar) with the interquartile range (error bar) of each ranked entry, one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows if str(r["status"]).startswith("ok")}) or ["(no ranked entries)"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        ranked = sorted((r for r in rows if r["task"] == task and str(r["status"]).startswith("ok")),
                        key=lambda r: r["median_s"])
        names = [r["name"] for r in ranked]
        colors = ["tab:gray" if r["kind"].startswith("baseline") else "tab:blue" for r in ranked]
        ax.barh(names, [r["median_s"] for r in ranked], xerr=[(r["iqr_s"] or 0) / 2 for r in ranked],
                color=colors)
        ax.invert_yaxis()
        ax.set_xlabel("median step time (s); grey: baselines")
        ax.set_title(task)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
