"""``gradebook.csv``: one row per submission — total, a column per stage and per handout problem — and its histogram.

Rows are replaced one submission at a time and the file is rewritten atomically (a temporary file, then a
rename), so at any moment it holds every submission finished so far and is never half-written. A
submission whose grading was interrupted gets status ``interrupted`` and empty scores: not a grade.
"""

from __future__ import annotations

import csv
import threading
from pathlib import Path

from kit.grading.scoring import GradeResult

FIXED = ["submission", "score", "max_score"]
TRAILING = ["status", "time_s", "flagged", "message"]
_lock = threading.Lock()


def row(result: GradeResult) -> dict[str, str]:
    """The gradebook row of one result (scores left empty when the grading did not finish)."""
    graded = result.status != "interrupted"
    out = {"submission": result.submission, "status": result.status, "time_s": f"{result.execution_time:.0f}",
           "flagged": "yes" if result.flags else "", "message": result.message,
           "score": f"{result.score:g}" if graded else "", "max_score": f"{result.max_score:g}" if graded else ""}
    if not graded:
        return out
    per_column: dict[str, float] = {}
    for t in result.tests:
        for column in (f"stage{t.stage}", f"P{t.problem or f'{t.stage}.?'}"):
            per_column[column] = per_column.get(column, 0.0) + t.score
    out.update({k: f"{v:g}" for k, v in per_column.items()})
    return out


def read(path: Path) -> dict[str, dict[str, str]]:
    """The gradebook's rows by submission (empty when there is none yet)."""
    if not path.exists():
        return {}
    with open(path, newline="") as f:
        return {r["submission"]: r for r in csv.DictReader(f)}


def _columns(rows: dict[str, dict[str, str]]) -> list[str]:
    keys = {k for r in rows.values() for k in r}
    stages = sorted((k for k in keys if k.startswith("stage") and k[5:].isdigit()), key=lambda k: int(k[5:]))
    problems = sorted((k for k in keys if k.startswith("P")),
                      key=lambda k: [int(x) if x.isdigit() else 999 for x in k[1:].split(".")])
    return FIXED + stages + problems + TRAILING


def update(results: list[GradeResult], path: Path) -> None:
    """Write or update ``gradebook.csv``: rows of these submissions replace their old rows; others stay."""
    with _lock:  # batch workers finish concurrently
        rows = read(path)
        for r in results:
            rows[r.submission] = row(r)
        columns = _columns(rows)
        tmp = path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns, restval="")
            w.writeheader()
            for name in sorted(rows):
                w.writerow({c: rows[name].get(c, "") for c in columns})
        tmp.replace(path)  # never leave a half-written gradebook


def plot_histogram(gradebook: Path, path: Path) -> None:
    """A histogram of the graded scores (interrupted rows have none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(read(gradebook).values())
    scores = [float(r["score"]) for r in rows if r["score"]]
    top = max((float(r["max_score"]) for r in rows if r["max_score"]), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(scores, bins=min(20, max(5, len(scores))), range=(0, top), color="#4c72b0", edgecolor="white")
    ax.set(xlabel=f"score (of {top:g})", ylabel="submissions", title=f"{len(scores)} submissions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
