"""The autograder: run the graded suite in a child process, score it, report it.

    python -m kit grade                       # grade student/ and print the score table
    python -m kit grade --impl reference      # full marks, or the kit is broken
    python -m kit grade --impl PATH           # a submission folder (with student/ inside) or a student/ folder
    python -m kit grade --batch DIR           # every subfolder of DIR is a submission → results + gradebook.csv

The suite runs in a child process (its own process group, with a wall-clock limit) and reports each
test through :mod:`kit.grading_plugin`; the grader — not the child — computes the points and writes the
results. A submission that crashes, hangs or fails to import gets the points of what passed.
A submission is graded in a staging copy of the kit that holds only its ``student/**/*.py``.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

STAGE_TITLES = {
    1: "Benchmarking & profiling",
    2: "Mixed precision",
    3: "FlashAttention-2 in Triton",
    4: "Distributed data parallel",
    5: "ZeRO-1 sharding",
    6: "4D parallelism",
}
SECRET_HINTS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "API_KEY", "PRIVATE_KEY", "AWS_", "GITHUB_")
OUTPUT_TAIL_BYTES = 64_000


@dataclass
class TestResult:
    nodeid: str
    stage: int
    points: float
    hidden: bool
    score: float = 0.0
    status: str = "failed"  # passed | failed
    output: str = ""
    doc: str = ""

    @property
    def name(self) -> str:
        return self.nodeid.split("::", 1)[-1] if "::" in self.nodeid else self.nodeid


@dataclass
class GradeResult:
    submission: str
    tests: list[TestResult] = field(default_factory=list)
    status: str = "ok"  # ok | timeout | crashed | error
    message: str = ""
    execution_time: float = 0.0
    output: str = ""

    @property
    def score(self) -> float:
        return sum(t.score for t in self.tests)

    @property
    def max_score(self) -> float:
        return sum(t.points for t in self.tests)

    def by_stage(self) -> dict[int, tuple[int, int, float, float]]:
        """stage → (tests passed, tests, points, max points)."""
        table: dict[int, list] = {}
        for t in self.tests:
            row = table.setdefault(t.stage, [0, 0, 0.0, 0.0])
            row[0] += t.status == "passed"
            row[1] += 1
            row[2] += t.score
            row[3] += t.points
        return {s: tuple(v) for s, v in sorted(table.items())}


# ---------------------------------------------------------------------------------------------- staging


def stage_submission(submission: Path, dest: Path, *, include_hidden: bool = False) -> list[str]:
    """Build a grading tree in ``dest``: a clean copy of the kit plus the submission's ``student/**/*.py``.

    ``submission`` is a folder holding ``student/`` or the ``student/`` folder itself. Returns notes on
    what was ignored (anything but ``.py`` files under ``student/``).
    """
    submission = submission.resolve()
    is_package = submission.name == "student" and not (submission / "student").is_dir()
    student = submission if is_package else submission / "student"
    if not student.is_dir():
        raise FileNotFoundError(f"submission {submission} has no student/ folder")
    ignore_tree = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "kit", dest / "kit", ignore=ignore_tree)

    def tests_ignore(directory: str, names: list[str]) -> list[str]:
        skip = set(ignore_tree(directory, names))
        if Path(directory) == ROOT / "tests":
            skip |= {"kit"} | (set() if include_hidden else {"hidden"})
        return list(skip)

    shutil.copytree(ROOT / "tests", dest / "tests", ignore=tests_ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    notes = []
    for path in sorted(student.rglob("*")):
        rel = path.relative_to(student)
        if path.is_dir() or "__pycache__" in rel.parts:
            continue
        if path.suffix != ".py" or path.name in ("conftest.py", "sitecustomize.py", "usercustomize.py"):
            notes.append(f"ignored student/{rel} (only student/**/*.py is graded)")
            continue
        target = dest / "student" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    for extra in sorted(submission.iterdir()) if student != submission else []:
        if extra.name != "student":
            notes.append(f"ignored {extra.name} (only student/**/*.py is graded)")
    (dest / "student").mkdir(exist_ok=True)
    return notes


# ---------------------------------------------------------------------------------------------- running


def _child_env(impl: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not any(h in k.upper() for h in SECRET_HINTS)}
    env.update(LLMSYS_IMPL=impl, PYTHONHASHSEED="0", PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTHONPATH", None)
    return env


def _marker_expr(stages: list[int] | None) -> str:
    return " or ".join(f"stage{s}" for s in (stages or sorted(STAGE_TITLES)))


def run_suite(
    tree: Path,
    impl: str,
    *,
    stages: list[int] | None = None,
    include_hidden: bool = False,
    timeout: float = 1800.0,
    per_test_timeout: float = 300.0,
    submission: str | None = None,
) -> GradeResult:
    """Run the graded tests of ``tree`` against ``impl`` in a child process group and score them."""
    start = time.monotonic()
    result = GradeResult(submission=submission or str(tree))
    with tempfile.TemporaryDirectory(prefix="kit-grade-") as tmp:
        log = Path(tmp) / "events.jsonl"
        out = Path(tmp) / "output.txt"
        cmd = [
            sys.executable, "-m", "pytest", "tests", "-q",
            "-p", "kit", "-p", "no:cacheprovider", "-p", "kit.grading_plugin",
            f"--grading-log={log}", f"--per-test-timeout={per_test_timeout}", f"--impl={impl}",
            "-m", f"({_marker_expr(stages)})" + ("" if include_hidden else " and not hidden"),
            "--ignore=tests/kit", "-o", "addopts=", "--tb=short",
        ]
        if not include_hidden:
            cmd.append("--ignore=tests/hidden")
        with open(out, "wb") as output:
            proc = subprocess.Popen(
                cmd, cwd=tree, env=_child_env(impl), stdout=output, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                _kill_group(proc)
        result.output = _tail(out)
        events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    result.execution_time = time.monotonic() - start

    collected = next((e["tests"] for e in events if e["event"] == "collected"), None)
    if collected is None:
        result.status = "error"
        result.message = f"the test suite did not start (exit code {code}); see the output"
        return result
    reports: dict[str, dict[str, dict]] = {}
    for e in events:
        if e["event"] == "report":
            reports.setdefault(e["nodeid"], {})[e["when"]] = e
    for info in collected:
        t = TestResult(info["nodeid"], info["stage"], info["points"], info["hidden"], doc=info.get("doc", ""))
        phases = reports.get(info["nodeid"], {})
        if all(phases.get(w, {}).get("outcome") == "passed" for w in ("setup", "call")) and \
                phases.get("teardown", {}).get("outcome", "passed") == "passed":
            t.status, t.score = "passed", t.points
        else:
            failed = [p for p in phases.values() if p["outcome"] != "passed"]
            if failed:
                t.output = "\n".join(f"[{p['when']} {p['outcome']}]\n{p['longrepr']}" for p in failed)
            else:
                t.output = "did not finish: the run crashed or ran out of time before this test reported"
        result.tests.append(t)
    if code is None:
        result.status, result.message = "timeout", f"the submission ran past its {timeout:g} s limit and was stopped"
    elif code not in (0, 1) or not any(e["event"] == "finished" for e in events):
        result.status = "crashed"
        result.message = f"the test run ended before it finished (exit code {code}); unreported tests count as failed"
    return result


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path) -> str:
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size > OUTPUT_TAIL_BYTES:
            f.seek(size - OUTPUT_TAIL_BYTES)
        text = f.read().decode("utf-8", "replace")
    return (f"[… {size - OUTPUT_TAIL_BYTES} bytes of output cut …]\n" if size > OUTPUT_TAIL_BYTES else "") + text


# ---------------------------------------------------------------------------------------------- reports


def gradescope_json(result: GradeResult) -> dict:
    """Gradescope's results.json: score, max_score, execution_time, tests[] (with visibility) and output."""
    return {
        "score": round(result.score, 4),
        "max_score": round(result.max_score, 4),
        "execution_time": round(result.execution_time, 2),
        "output": result.message or f"{result.score:g} / {result.max_score:g} points",
        "stdout_visibility": "hidden",
        "visibility": "visible",
        "tests": [
            {
                "name": t.name,
                "number": str(i + 1),
                "score": t.score,
                "max_score": t.points,
                "status": t.status,
                "output": t.output[-8000:],
                "tags": [f"stage{t.stage}"],
                "visibility": "after_published" if t.hidden else "visible",
            }
            for i, t in enumerate(result.tests)
        ],
        "extra_data": {"status": result.status, "submission": result.submission},
    }


_NOT_IMPLEMENTED = re.compile(r"NotImplementedError: (.+)")
_ASSERTION = re.compile(r"^E\s+(?:AssertionError: )?(.+)$", re.M)


def _first_problem(t: TestResult) -> str:
    m = _NOT_IMPLEMENTED.search(t.output)
    if m:
        return "implement " + m.group(1).strip()
    m = _ASSERTION.search(t.output)
    return (m.group(1).strip() if m else t.output.strip().split("\n")[-1])[:200]


def format_table(result: GradeResult) -> str:
    lines = [f"Grading {result.submission}", "", f"| Stage | {'Topic':<28} | Tests  | Points      |",
             f"|-------|{'-' * 30}|--------|-------------|"]
    for stage, (passed, n, pts, max_pts) in result.by_stage().items():
        title = STAGE_TITLES.get(stage, "?")
        lines.append(f"| {stage:<5} | {title:<28} | {passed:>2}/{n:<3} | {pts:>5g}/{max_pts:<5g} |")
    lines.append(f"| Total | {'':<28} | {sum(t.status == 'passed' for t in result.tests):>2}/{len(result.tests):<3} "
                 f"| {result.score:>5g}/{result.max_score:<5g} |")
    if result.message:
        lines += ["", f"Note: {result.message}"]
    failed = [t for t in result.tests if t.status != "passed"]
    if failed:
        stage = min(t.stage for t in failed)
        seen: dict[str, list[str]] = {}
        for t in failed:
            if t.stage == stage:
                seen.setdefault(_first_problem(t), []).append(t.name)
        chapter = next(iter(sorted((ROOT / "handout").glob(f"0{stage}-*.md"))), None)
        where = f"handout/{chapter.name}" if chapter else "the handout"
        lines += ["", f"What to work on first (Stage {stage}, {where}):"]
        for problem, names in list(seen.items())[:12]:
            more = f" (+{len(names) - 1} more)" if len(names) > 1 else ""
            lines.append(f"  - {problem}\n      failing: {names[0]}{more}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- entry points


def grade(
    impl: str = "student",
    *,
    stages: list[int] | None = None,
    include_hidden: bool = False,
    timeout: float = 1800.0,
    per_test_timeout: float = 300.0,
) -> GradeResult:
    """Grade ``student``/``reference`` in this kit, or a submission folder at a path."""
    if impl in ("student", "reference"):
        return run_suite(ROOT, impl, stages=stages, include_hidden=include_hidden, timeout=timeout,
                         per_test_timeout=per_test_timeout, submission=impl)
    path = Path(impl)
    if not path.exists():
        raise FileNotFoundError(f"--impl must be 'student', 'reference' or an existing folder, got {impl!r}")
    with tempfile.TemporaryDirectory(prefix="kit-submission-") as tmp:
        notes = stage_submission(path, Path(tmp), include_hidden=include_hidden)
        result = run_suite(Path(tmp), "student", stages=stages, include_hidden=include_hidden, timeout=timeout,
                           per_test_timeout=per_test_timeout, submission=str(path))
    if notes:
        result.message = "; ".join(filter(None, [result.message, *notes]))
    return result


def grade_batch(
    folder: Path,
    out: Path,
    *,
    stages: list[int] | None = None,
    include_hidden: bool = False,
    timeout: float = 1800.0,
    per_test_timeout: float = 300.0,
) -> list[GradeResult]:
    """Grade every subfolder of ``folder``; write ``out/<name>/results.json`` and ``out/gradebook.csv``."""
    from tqdm import tqdm

    submissions = sorted(p for p in folder.iterdir() if p.is_dir())
    if not submissions:
        raise FileNotFoundError(f"{folder} has no submission subfolders")
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for sub in tqdm(submissions, desc="grading", unit="submission"):
        try:
            result = grade(str(sub), stages=stages, include_hidden=include_hidden, timeout=timeout,
                           per_test_timeout=per_test_timeout)
        except Exception as exc:  # a malformed submission must not stop the batch
            result = GradeResult(submission=str(sub), status="error", message=f"{type(exc).__name__}: {exc}")
        result.submission = sub.name
        (out / sub.name).mkdir(exist_ok=True)
        (out / sub.name / "results.json").write_text(json.dumps(gradescope_json(result), indent=2))
        results.append(result)
    write_gradebook(results, out / "gradebook.csv")
    return results


def write_gradebook(results: list[GradeResult], path: Path) -> None:
    stages = sorted({t.stage for r in results for t in r.tests} | set(STAGE_TITLES))
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["submission", "score", "max_score", *[f"stage{s}" for s in stages], "status", "message"])
        for r in results:
            per = r.by_stage()
            w.writerow([r.submission, f"{r.score:g}", f"{r.max_score:g}",
                        *[f"{per[s][2]:g}" if s in per else "" for s in stages], r.status, r.message])


def result_as_dict(result: GradeResult) -> dict:
    return asdict(result)
