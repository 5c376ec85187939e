"""A folder of submissions: each subfolder graded, ``jobs`` at a time, resumable after an interruption.

For each submission ``out/<name>/results.json`` is written when its grading completes, and its
``gradebook.csv`` row is replaced at once. A results.json records what its grade depends on: a hash of
exactly the files graded (:func:`kit.grading.staging.content_hash`), a hash of the kit, the tests, their
recorded timings and the handout (:func:`kit.grading.staging.grader_hash`), the stages, the hidden flag and
the limits. Running the same batch again grades only the submissions without a complete result under all of
these — never graded, interrupted, changed since, or graded by another kit, other tests or other options —
and says why each is regraded, unless ``force``. Submissions whose earlier grading took longest
(an interrupted one included) go last, so a hanging submission occupies one worker while the others finish.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kit.grading import gradebook, processes
from kit.grading.reporting import gradescope_json
from kit.grading.running import Limits, grade
from kit.grading.scoring import GradeResult
from kit.grading.staging import content_hash, grader_hash


@dataclass
class BatchReport:
    results: list[GradeResult] = field(default_factory=list)  # graded in this run, interrupted ones included
    skipped: list[str] = field(default_factory=list)  # already had a complete result for their current files
    regraded: dict[str, str] = field(default_factory=dict)  # had a result, graded again: why
    interrupted: bool = False


def _fingerprint(submission: Path, stages: list[int] | None, include_hidden: bool, limits: Limits | None,
                 grader: str) -> dict:
    try:
        digest = content_hash(submission)
    except (FileNotFoundError, OSError):
        digest = None
    return {"content_hash": digest, "grader_hash": grader, "stages": stages or "all", "hidden": include_hidden,
            "limits": asdict(limits or Limits())}


WHY = {"content_hash": "its files changed", "grader_hash": "the kit, the tests or their recorded timings changed",
       "stages": "other stages are graded", "hidden": "the hidden tests are graded, or no longer",
       "limits": "the grading limits changed"}


def _stale(previous: dict, fingerprint: dict) -> str | None:
    """Why a previous result no longer stands (None: it does)."""
    extra = previous.get("extra_data", {})
    if not previous or fingerprint["content_hash"] is None:
        return "never graded" if not previous else "its files cannot be read"
    if extra.get("status") in (None, "interrupted"):
        return "its grading was interrupted"
    changed = [WHY[k] for k, v in fingerprint.items() if extra.get(k) != v]
    return "; ".join(changed) if changed else None


def _previous(out: Path, name: str) -> dict:
    try:
        return json.loads((out / name / "results.json").read_text())
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def _submissions(folder: Path, only: list[str] | None) -> list[Path]:
    submissions = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    if only:
        missing = sorted(set(only) - {p.name for p in submissions})
        if missing:
            raise FileNotFoundError(f"no submission folder named {missing} in {folder}")
        submissions = [p for p in submissions if p.name in only]
    if not submissions:
        raise FileNotFoundError(f"{folder} has no submission subfolders")
    return submissions


def grade_batch(folder: Path, out: Path, *, stages: list[int] | None = None, include_hidden: bool = False,
                limits: Limits | None = None, jobs: int = 1, only: list[str] | None = None,
                force: bool = False) -> BatchReport:
    """Grade every subfolder of ``folder`` (or just ``only``, always regraded) into ``out``, ``jobs`` at a time.

    Writes ``out/<name>/results.json``, ``out/gradebook.csv`` (after each submission) and
    ``out/gradebook.png`` (a histogram of the scores, when the batch was not interrupted).
    """
    from tqdm import tqdm

    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"jobs must be a positive int, got {jobs!r}")
    out.mkdir(parents=True, exist_ok=True)
    book = out / "gradebook.csv"
    report = BatchReport()
    todo: list[tuple[float, Path, dict]] = []
    rows = gradebook.read(book)
    grader = grader_hash(include_hidden)
    for sub in _submissions(folder, only):
        fingerprint, previous = _fingerprint(sub, stages, include_hidden, limits, grader), _previous(out, sub.name)
        why = _stale(previous, fingerprint)
        if not force and not only and why is None:
            report.skipped.append(sub.name)
            continue
        if previous:
            report.regraded[sub.name] = "--force" if force or only else why
        # Longest earlier grading last; never graded (time unknown) first.
        seconds = previous.get("execution_time") or float(rows.get(sub.name, {}).get("time_s") or 0)
        todo.append((seconds, sub, fingerprint))
    todo.sort(key=lambda item: (item[0], item[1].name))

    def one(sub: Path, fingerprint: dict) -> GradeResult | None:
        if processes.INTERRUPTED.is_set():
            return None  # never started: no row, graded on the next run
        (out / sub.name / "results.json").unlink(missing_ok=True)  # obsolete from now on
        try:
            result = grade(str(sub), stages=stages, include_hidden=include_hidden, limits=limits)
        except Exception as exc:  # a malformed submission must not stop the batch
            result = GradeResult(submission=str(sub), status="error", message=f"{type(exc).__name__}: {exc}")
        result.submission = sub.name
        gradebook.update([result], book)  # the row first: a results.json always has its row
        if result.status != "interrupted":
            _write_json(out / sub.name / "results.json", gradescope_json(result, fingerprint))
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(one, sub, fingerprint) for _, sub, fingerprint in todo]
        for future in tqdm(as_completed(futures), total=len(futures), desc="grading", unit="submission"):
            if (result := future.result()) is not None:
                report.results.append(result)
    report.results.sort(key=lambda r: r.submission)
    report.interrupted = processes.INTERRUPTED.is_set()
    if not report.interrupted and book.exists():
        gradebook.plot_histogram(book, out / "gradebook.png")
    return report
