"""What a grade looks like to people: the score table with what to work on first, and Gradescope's results.json."""

from __future__ import annotations

import re
from collections import Counter

from kit import stages as registry
from kit.grading.scoring import ROOT, GradeResult, TestResult
from kit.setup.portable import NEEDS_TRITON


def gradescope_json(result: GradeResult, extra: dict | None = None) -> dict:
    """Gradescope's results.json: score, max_score, execution_time, tests[] (with visibility) and output.

    Each test's ``name`` is unique and readable (``Stage 3 · P3.7 · test_x[fp16]``); ``tags`` hold its stage
    and problem. ``extra_data`` holds the run's status, the submission, flags and whatever ``extra`` adds.
    """
    return {
        "score": round(result.score, 4),
        "max_score": round(result.max_score, 4),
        "execution_time": round(result.execution_time, 2),
        "output": result.message or f"{result.score:g} / {result.max_score:g} points",
        "stdout_visibility": "hidden",
        "visibility": "visible",
        "tests": [
            {
                "name": t.title or t.name,
                "number": str(i + 1),
                "score": t.score,
                "max_score": t.points,
                "status": "passed" if t.status == "passed" else "failed",  # Gradescope knows these two
                "output": t.output[-8000:],
                "tags": [f"stage{t.stage}", *([f"P{t.problem}"] if t.problem else [])],
                "visibility": "after_published" if t.hidden else "visible",
            }
            for i, t in enumerate(result.tests)
        ],
        "extra_data": {"status": result.status, "submission": result.submission, "flags": result.flags,
                       **(extra or {})},
    }


_NOT_IMPLEMENTED = re.compile(r"NotImplementedError: (.+)")
# A check that depends on another's result quotes that failure after this line (kit.checks.Failure.reraise).
_BECAUSE = re.compile(r"because that failed:\s*\n(?:E\s+)?(.+)")
_ASSERTION = re.compile(r"^E\s+(?:AssertionError: )?(.+)$", re.M)


def _first_problem(t: TestResult) -> str:
    m = _NOT_IMPLEMENTED.search(t.output)
    if m:
        cause = _BECAUSE.search(t.output, m.start()) if m.group(1).rstrip().endswith("because that failed:") else None
        return "implement " + (cause or m).group(1).strip()
    m = _ASSERTION.search(t.output)
    if m:  # without the harness's own exception class: what the student reads is the worker's error
        return re.sub(r"^(?:kit\.checks\.RankCheckError|kit\.spawn\.Rank\w+Error): ", "", m.group(1).strip())[:200]
    # A failure reported as a plain message (a stage that did not import): its first lines, not its traceback.
    lines = [ln.strip() for ln in t.output.splitlines() if ln.strip() and not re.fullmatch(r"\[\w+ \w+\]", ln.strip())]
    first = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else "")
    return first[:200]


def _title(stage: int) -> str:
    try:
        return registry.get(stage).title
    except KeyError:
        return "?"


def format_table(result: GradeResult) -> str:
    """The score table per stage, then the first stage's failures grouped by cause, with the chapter to read."""
    stages = result.by_stage()
    # The topic column is as wide as the longest title it shows ("Sharded data parallel: ZeRO-1 and FSDP" is 38).
    width = max([28, *(len(_title(stage)) for stage in stages)])
    lines = [f"Grading {result.submission}", "", f"| Stage | {'Topic':<{width}} | Tests   | Points      |",
             f"|-------|{'-' * (width + 2)}|---------|-------------|"]
    for stage, (passed, n, pts, max_pts) in stages.items():
        lines.append(f"| {stage:<5} | {_title(stage):<{width}} | {passed:>3}/{n:<3} | {pts:>5g}/{max_pts:<5g} |")
    lines.append(f"| Total | {'':<{width}} | {sum(t.status == 'passed' for t in result.tests):>3}/"
                 f"{len(result.tests):<3} | {result.score:>5g}/{result.max_score:<5g} |")
    skipped = Counter(t.stage for t in result.tests if t.status == "skipped")
    if skipped:  # a machine without Triton: those tests did not run (not a failure of the submission)
        lines.append("")
        lines += [f"Stage {stage}: {n} of {stages[stage][1]} tests skipped: {NEEDS_TRITON}"
                  for stage, n in sorted(skipped.items())]
    if result.message:
        lines += ["", f"Note: {result.message}"]
    failed = [t for t in result.tests if t.status == "failed"]
    if failed:
        stage = min(t.stage for t in failed)
        seen: dict[str, list[str]] = {}
        for t in failed:
            if t.stage == stage:
                seen.setdefault(_first_problem(t), []).append(t.name)
        try:
            chapters = [p.relative_to(ROOT).as_posix() for p in registry.get(stage).chapter_paths(ROOT)]
        except KeyError:
            chapters = []
        lines += ["", f"What to work on first (Stage {stage}, {', '.join(chapters) or 'the handout'}):"]
        for problem, names in list(seen.items())[:12]:
            more = f" (+{len(names) - 1} more)" if len(names) > 1 else ""
            lines.append(f"  - {problem}\n      failing: {names[0]}{more}")
    return "\n".join(lines)
