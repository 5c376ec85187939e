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
import ctypes
import hmac
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
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
    flags: list[str] = field(default_factory=list)

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

# Files that would change how pytest or Python start up, never taken from a submission.
IGNORED_NAMES = ("conftest.py", "sitecustomize.py", "usercustomize.py", "pytest.ini", "setup.py")


def find_student_package(submission: Path) -> Path:
    """The submission's ``student/`` folder: ``submission/student``, one level down (an unzipped repository),
    ``submission`` itself when it is named ``student``, or a folder of the stage modules uploaded loose."""
    if submission.name == "student" and not (submission / "student").is_dir():
        return submission
    if (submission / "student").is_dir():
        return submission / "student"
    nested = sorted(p for p in submission.glob("*/student") if p.is_dir())
    if len(nested) == 1:
        return nested[0]
    if any(submission.glob("*.py")) or any(submission.glob("*/__init__.py")):
        return submission
    raise FileNotFoundError(f"submission {submission} has no student/ folder")



def stage_submission(submission: Path, dest: Path, *, include_hidden: bool = False) -> list[str]:
    """Build a grading tree in ``dest``: a clean copy of the kit plus the submission's ``student/**/*.py``.

    ``submission`` is a folder holding ``student/`` or the ``student/`` folder itself. Returns notes on
    what was ignored (anything but ``.py`` files under ``student/``).
    """
    submission = submission.resolve()
    student = find_student_package(submission)
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
        if path.suffix != ".py" or path.name in IGNORED_NAMES or rel.parts[0] in ("tests", "reference"):
            notes.append(f"ignored student/{rel} (only the student package's modules are graded)")
            continue
        target = dest / "student" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    for extra in sorted(submission.iterdir()) if student != submission else []:
        if extra != student and extra.name != student.parent.name:
            notes.append(f"ignored {extra.name} (only student/**/*.py is graded)")
    (dest / "student").mkdir(exist_ok=True)
    return notes


# ---------------------------------------------------------------------------------------------- running


ALLOWED_ENV = {"PATH", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "TZ", "USER", "LOGNAME", "SHELL", "VIRTUAL_ENV",
               "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS", "MKL_NUM_THREADS"}
ALLOWED_PREFIXES = ("TRITON_", "NCCL_", "CUDA_", "NVIDIA_", "TORCH_")
MAX_RESUMES = 8


@dataclass
class Limits:
    """What one submission may use. Times in seconds; memory per process (CPU only)."""

    timeout: float = 1800.0
    per_test_timeout: float = 300.0
    memory_gb: float | None = 8.0
    file_gb: float | None = 2.0


def _child_env(impl: str, home: Path, grading_id: str, key: str) -> dict[str, str]:
    """Only what the tests need: no tokens, credentials or the grader's own settings reach student code."""
    env = {
        k: v for k, v in os.environ.items()
        if (k in ALLOWED_ENV or k.startswith(ALLOWED_PREFIXES)) and not any(h in k.upper() for h in SECRET_HINTS)
    }
    env.update(
        LLMSYS_IMPL=impl, PYTHONHASHSEED="0", PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1",
        HOME=str(home), TMPDIR=str(home), MPLBACKEND="Agg", KIT_GRADING_ID=grading_id, KIT_GRADING_KEY=key,
    )
    return env


def _marker_expr(stages: list[int] | None) -> str:
    return " or ".join(f"stage{s}" for s in (stages or sorted(STAGE_TITLES)))


def read_events(log: Path, key: str) -> tuple[list[dict], int]:
    """The log's events whose sequence number and HMAC check out, and how many did not (forged lines)."""
    from kit.grading_plugin import signer

    sign = signer(key.encode())
    events, forged, seq = [], 0, 0
    if not log.exists():
        return events, forged
    for line in log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
            mac = event.pop("mac")
        except (ValueError, KeyError, AttributeError):
            forged += 1
            continue
        if event.get("seq") != seq or not hmac.compare_digest(str(mac), sign(event)):
            forged += 1
            continue
        events.append(event)
        seq += 1
    return events, forged


_ACTIVE_CHILDREN: set[int] = set()
_ACTIVE_LOCK = threading.Lock()


def _become_subreaper() -> None:
    # Orphans of graded runs (daemonised ranks, setsid'd sleepers) are re-parented to the grader, which kills them.
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
        except OSError:
            pass


def kill_leftovers(grading_id: str) -> int:
    """Kill every process started for this grading run (by its environment marker) and every orphan
    re-parented to the grader. Returns how many were killed."""
    if not os.path.isdir("/proc"):
        return 0
    me, killed = os.getpid(), 0
    marker = f"KIT_GRADING_ID={grading_id}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                ours = marker in f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            state, ppid = fields[0], int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
        with _ACTIVE_LOCK:
            orphan = ppid == me and pid not in _ACTIVE_CHILDREN
        if state != "Z" and (ours or orphan):
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        if orphan:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
    return killed


def _run_once(tree: Path, cmd: list[str], env: dict, out: Path, timeout: float) -> int | None:
    with open(out, "ab") as output:
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=output, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        with _ACTIVE_LOCK:
            _ACTIVE_CHILDREN.add(proc.pid)
        try:
            return proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            return None
        finally:
            _kill_group(proc)
            with _ACTIVE_LOCK:
                _ACTIVE_CHILDREN.discard(proc.pid)


def run_suite(
    tree: Path,
    impl: str,
    *,
    stages: list[int] | None = None,
    include_hidden: bool = False,
    limits: Limits | None = None,
    submission: str | None = None,
) -> GradeResult:
    """Run the graded tests of ``tree`` against ``impl`` in a sandboxed child process group and score them.

    If the child dies mid-run (``os._exit``, a segfault, the memory limit), the test it was running fails
    and the tests it never reached run again in a fresh child, so one bad test costs one test.
    """
    limits = limits or Limits()
    _become_subreaper()
    start = time.monotonic()
    deadline = start + limits.timeout
    result = GradeResult(submission=submission or str(tree))
    grading_id, key = secrets.token_hex(8), secrets.token_hex(32)
    selection = ["-m", f"({_marker_expr(stages)})" + ("" if include_hidden else " and not hidden"),
                 "--ignore=tests/kit"] + ([] if include_hidden else ["--ignore=tests/hidden"])
    collected: list[dict] | None = None
    reports: dict[str, dict[str, dict]] = {}
    flags: list[str] = []
    notes: list[str] = []
    code: int | None = 0
    with tempfile.TemporaryDirectory(prefix="kit-grade-") as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        out = Path(tmp) / "output.txt"
        env = _child_env(impl, home, grading_id, key)
        targets: list[str] = ["tests"]
        for attempt in range(MAX_RESUMES + 1):
            log = Path(tmp) / f"events-{attempt}.jsonl"
            cmd = [sys.executable, "-m", "kit.sandbox", f"--memory-gb={limits.memory_gb or 0}",
                   f"--file-gb={limits.file_gb or 0}", "--",
                   sys.executable, "-m", "pytest", *targets, "-q", "-p", "kit", "-p", "no:cacheprovider",
                   "-p", "kit.grading_plugin", f"--grading-log={log}", f"--per-test-timeout={limits.per_test_timeout}",
                   f"--impl={impl}", *selection, "-o", "addopts=", "--tb=short"]
            code = _run_once(tree, cmd, env, out, deadline - time.monotonic())
            leftovers = kill_leftovers(grading_id)
            if leftovers:
                notes.append(f"killed {leftovers} process(es) the submission left running")
            events, forged = read_events(log, key)
            if forged:
                flags.append(f"{forged} forged or altered line(s) in the grading log were ignored")
            if collected is None:
                collected = next((e["tests"] for e in events if e["event"] == "collected"), None)
                if collected is None:
                    break
            for e in events:
                if e["event"] == "report":
                    reports.setdefault(e["nodeid"], {})[e["when"]] = e
                elif e["event"] == "flag":
                    flags.append(f"{e['nodeid'].split('::')[-1] or 'collection'}: {e['what']}")
            finished = any(e["event"] == "finished" for e in events)
            if code is None or finished or time.monotonic() >= deadline:
                break
            unreported = [t["nodeid"] for t in collected if "teardown" not in reports.get(t["nodeid"], {})]
            if not unreported:
                break
            # The first unreported test (one with a setup report, if any) was running when the child died.
            culprit = next((n for n in unreported if n in reports), unreported[0])
            reports.setdefault(culprit, {})["call"] = {
                "outcome": "failed", "when": "call",
                "longrepr": f"the test process exited during this test (exit code {code}): os._exit, a crash, "
                            "or the memory limit. The remaining tests were run again in a fresh process.",
            }
            reports[culprit]["teardown"] = {"outcome": "passed", "when": "teardown", "longrepr": ""}
            notes.append(f"the test process died during {culprit.split('::')[-1]} (exit code {code})")
            targets = [n for n in unreported if n != culprit]
            if not targets:
                break
        result.output = _tail(out)
    result.execution_time = time.monotonic() - start

    if collected is None:
        result.status = "error"
        result.message = f"the test suite did not start (exit code {code}); see the output"
        return result
    for info in collected:
        t = TestResult(info["nodeid"], info["stage"], info["points"], info["hidden"], doc=info.get("doc", ""))
        phases = reports.get(info["nodeid"], {})
        if all(phases.get(w, {}).get("outcome") == "passed" for w in ("setup", "call", "teardown")):
            t.status, t.score = "passed", t.points
        else:
            failed = [p for p in phases.values() if p["outcome"] != "passed"]
            if failed:
                t.output = "\n".join(f"[{p['when']} {p['outcome']}]\n{p['longrepr']}" for p in failed)
            else:
                t.output = "did not finish: the run ran out of time before this test reported"
        result.tests.append(t)
    result.flags = flags
    if code is None or time.monotonic() >= deadline:
        result.status = "timeout"
        notes.insert(0, f"the submission ran past its {limits.timeout:g} s limit and was stopped")
    elif notes and any("died" in n for n in notes):
        result.status = "crashed"
    result.message = "; ".join(notes + ([f"FLAGGED: {'; '.join(flags)}"] if flags else []))
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
        "extra_data": {"status": result.status, "submission": result.submission, "flags": result.flags},
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
    lines = [f"Grading {result.submission}", "", f"| Stage | {'Topic':<28} | Tests   | Points      |",
             f"|-------|{'-' * 30}|---------|-------------|"]
    for stage, (passed, n, pts, max_pts) in result.by_stage().items():
        title = STAGE_TITLES.get(stage, "?")
        lines.append(f"| {stage:<5} | {title:<28} | {passed:>3}/{n:<3} | {pts:>5g}/{max_pts:<5g} |")
    lines.append(f"| Total | {'':<28} | {sum(t.status == 'passed' for t in result.tests):>3}/{len(result.tests):<3} "
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
    limits: Limits | None = None,
) -> GradeResult:
    """Grade ``student``/``reference`` in this kit, or a submission folder at a path (staged in a clean copy)."""
    if impl in ("student", "reference"):
        return run_suite(ROOT, impl, stages=stages, include_hidden=include_hidden, limits=limits, submission=impl)
    path = Path(impl)
    if not path.exists():
        raise FileNotFoundError(f"--impl must be 'student', 'reference' or an existing folder, got {impl!r}")
    with tempfile.TemporaryDirectory(prefix="kit-submission-") as tmp:
        notes = stage_submission(path, Path(tmp), include_hidden=include_hidden)
        result = run_suite(Path(tmp), "student", stages=stages, include_hidden=include_hidden, limits=limits,
                           submission=str(path))
    if notes:
        result.message = "; ".join(filter(None, [result.message, *notes]))
    return result


def grade_batch(
    folder: Path,
    out: Path,
    *,
    stages: list[int] | None = None,
    include_hidden: bool = False,
    limits: Limits | None = None,
    jobs: int = 1,
    only: list[str] | None = None,
) -> list[GradeResult]:
    """Grade every subfolder of ``folder`` (or just ``only``), ``jobs`` at a time.

    Writes ``out/<name>/results.json``, ``out/gradebook.csv`` (one row per submission; regrading some
    replaces only their rows) and ``out/gradebook.png`` (a histogram of the scores).
    """
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from tqdm import tqdm

    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive int, got {jobs!r}")
    submissions = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    if only:
        missing = sorted(set(only) - {p.name for p in submissions})
        if missing:
            raise FileNotFoundError(f"no submission folder named {missing} in {folder}")
        submissions = [p for p in submissions if p.name in only]
    if not submissions:
        raise FileNotFoundError(f"{folder} has no submission subfolders")
    out.mkdir(parents=True, exist_ok=True)

    def one(sub: Path) -> GradeResult:
        try:
            result = grade(str(sub), stages=stages, include_hidden=include_hidden, limits=limits)
        except Exception as exc:  # a malformed submission must not stop the batch
            result = GradeResult(submission=str(sub), status="error", message=f"{type(exc).__name__}: {exc}")
        result.submission = sub.name
        (out / sub.name).mkdir(exist_ok=True)
        (out / sub.name / "results.json").write_text(json.dumps(gradescope_json(result), indent=2))
        return result

    results = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(one, sub) for sub in submissions]
        for future in tqdm(as_completed(futures), total=len(futures), desc="grading", unit="submission"):
            results.append(future.result())
    results.sort(key=lambda r: r.submission)
    update_gradebook(results, out / "gradebook.csv")
    plot_histogram(out / "gradebook.csv", out / "gradebook.png")
    return results


def _problem_of() -> dict[tuple[int, str], str]:
    """(stage, test function) → handout problem number, from the handout chapters."""
    from kit.handout_check import parse_handout

    mapping = {}
    for chapter in sorted((ROOT / "handout").glob("0*-*.md")):
        for p in parse_handout(chapter):
            for name in [*p.tests, *p.hidden]:
                mapping[(p.stage, name)] = p.number
    return mapping


def gradebook_row(result: GradeResult, problems: dict[tuple[int, str], str]) -> dict[str, str]:
    row = {"submission": result.submission, "score": f"{result.score:g}", "max_score": f"{result.max_score:g}",
           "status": result.status, "flagged": "yes" if result.flags else "", "message": result.message}
    per_stage: dict[str, float] = {}
    per_problem: dict[str, float] = {}
    for t in result.tests:
        per_stage[f"stage{t.stage}"] = per_stage.get(f"stage{t.stage}", 0.0) + t.score
        number = problems.get((t.stage, t.name.split("[")[0]), f"{t.stage}.?")
        per_problem[f"P{number}"] = per_problem.get(f"P{number}", 0.0) + t.score
    row.update({k: f"{v:g}" for k, v in per_stage.items()})
    row.update({k: f"{v:g}" for k, v in per_problem.items()})
    return row


def update_gradebook(results: list[GradeResult], path: Path) -> None:
    """Write or update ``gradebook.csv``: rows of these submissions replace their old rows; others stay."""
    problems = _problem_of()
    rows: dict[str, dict[str, str]] = {}
    if path.exists():
        with open(path, newline="") as f:
            rows = {r["submission"]: r for r in csv.DictReader(f)}
    for r in results:
        rows[r.submission] = gradebook_row(r, problems)
    fixed = ["submission", "score", "max_score"]
    stage_cols = sorted({k for r in rows.values() for k in r if k.startswith("stage")}, key=lambda k: int(k[5:]))
    problem_cols = sorted({k for r in rows.values() for k in r if k.startswith("P")},
                          key=lambda k: [int(x) if x.isdigit() else 999 for x in k[1:].split(".")])
    columns = fixed + stage_cols + problem_cols + ["status", "flagged", "message"]
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, restval="")
        w.writeheader()
        for name in sorted(rows):
            w.writerow({c: rows[name].get(c, "") for c in columns})
    tmp.replace(path)  # never leave a half-written gradebook


def plot_histogram(gradebook: Path, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(gradebook, newline="") as f:
        rows = list(csv.DictReader(f))
    scores = [float(r["score"]) for r in rows if r["score"]]
    top = max((float(r["max_score"]) for r in rows if r["max_score"]), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(scores, bins=min(20, max(5, len(scores))), range=(0, top), color="#4c72b0", edgecolor="white")
    ax.set(xlabel=f"score (of {top:g})", ylabel="submissions", title=f"{len(scores)} submissions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
