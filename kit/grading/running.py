"""Run the graded suite on one tree in a sandboxed child process, and keep going whatever the code does.

The child (``python -m kit.grading.sandbox … -- python -m pytest …``) is the judge: pytest with the grading plugin
(:mod:`kit.grading.plugin`), which never runs the submission itself but hands it to confined worker
processes. It gets a reduced environment, resource limits and its own process group, and reports every test
to a signed log. The grader watches that log while the child runs:

* a test whose workers spin past their CPU budget or stay blocked past the idle limit is stopped by the
  judge, which dumps their stacks into the test's failure and goes on; the grader kills the judge itself
  only if a test outlives its wall-clock cap by ``Limits.grace`` (a fault of the kit, not of a submission);
* if the child dies or is killed mid-run, the test it was in fails and the tests it never reached run
  again in a fresh child (at most ``MAX_RESUMES`` times), so one bad test costs one test;
* if it dies or hangs while checking a module's import, the tests that use that module fail and the others
  are graded;
* past the submission's time limit, or when grading is interrupted, it stops with what it has.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kit import stages as registry
from kit.grading import processes, scoring, timings
from kit.grading.events import Activity, RunRecord, SignedLog
from kit.grading.sandbox import KEY_FD_ENV
from kit.grading.staging import ROOT, stage_submission
from kit.setup.portable import grader_refusal

SECRET_HINTS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "API_KEY", "PRIVATE_KEY", "AWS_", "GITHUB_")
ALLOWED_ENV = {"PATH", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "TZ", "USER", "LOGNAME", "SHELL", "VIRTUAL_ENV",
               "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
               "LLMSYS_FORCE_NO_TRITON"}  # the kit's own tests of a grade on a machine without Triton (kit.setup)
ALLOWED_PREFIXES = ("TRITON_", "NCCL_", "CUDA_", "NVIDIA_", "TORCH_")
OUTPUT_TAIL_BYTES = 64_000
MAX_RESUMES = 8
LINGER = 30.0  # seconds a child that finished may take to exit (student threads that never end)
POLL = 0.25


class GraderPlatformError(RuntimeError):
    """This machine cannot grade: not Linux, or the portable path forced (:func:`kit.setup.portable.grader_refusal`)."""


@dataclass
class Limits:
    """What one submission may use. Times in seconds; memory per process (CPU only).

    A test's workers may use ``max(timing_floor, timing_factor × the reference's CPU time)`` CPU-seconds and
    make no progress for at most ``idle_limit`` seconds (:mod:`kit.grading.timings`); ``per_test_timeout``
    caps its wall clock, the last resort. The judge enforces these, and spends at most ``judge_cpu_limit``
    CPU-seconds of its own on a test (0: no limit); the grader kills the judge itself only when a test
    outlives its wall-clock cap by ``grace`` (a fault of the kit, never of a submission).
    """

    timeout: float = 1800.0
    per_test_timeout: float = 300.0
    import_timeout: float = 30.0
    grace: float = 30.0
    timing_factor: float = timings.FACTOR
    timing_floor: float = timings.FLOOR
    idle_limit: float = timings.IDLE
    judge_cpu_limit: float = timings.JUDGE_CPU_LIMIT
    memory_gb: float | None = 8.0
    file_gb: float | None = 2.0


def child_env(impl: str, home: Path, grading_id: str) -> dict[str, str]:
    """Only what the tests need: no tokens, credentials or the grader's own settings reach student code. The
    grading log's key is not here either: it travels through a pipe (:func:`key_pipe`), since a process's initial
    environment stays readable in ``/proc/PID/environ`` after it removes a variable."""
    env = {
        k: v for k, v in os.environ.items()
        if (k in ALLOWED_ENV or k.startswith(ALLOWED_PREFIXES)) and not any(h in k.upper() for h in SECRET_HINTS)
    }
    env.update(
        LLMSYS_IMPL=impl, PYTHONHASHSEED="0", PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1",
        HOME=str(home), TMPDIR=str(home), MPLBACKEND="Agg", KIT_GRADING_ID=grading_id,
    )
    return env


def key_pipe(key: str) -> int:
    """The read end of a pipe that holds ``key`` (and then its end): the judge reads it once and closes it."""
    read, write = os.pipe()
    os.write(write, key.encode())
    os.close(write)
    return read


def tail(path: Path) -> str:
    size = path.stat().st_size if path.exists() else 0
    if not size:
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, size - OUTPUT_TAIL_BYTES))
        text = f.read().decode("utf-8", "replace")
    return (f"[… {size - OUTPUT_TAIL_BYTES} bytes of output cut …]\n" if size > OUTPUT_TAIL_BYTES else "") + text


class SuiteRun:
    """One grading of one tree: child processes ("attempts") until every test has reported or time is up."""

    def __init__(self, tree: Path, impl: str, limits: Limits, stages: list[int] | None, include_hidden: bool):
        self.tree, self.impl, self.limits = tree, impl, limits
        markers = f"({registry.marker_expression(stages)})" + ("" if include_hidden else " and not hidden")
        self.selection = ["-m", markers, "--ignore=tests/kit"] + ([] if include_hidden else ["--ignore=tests/hidden"])
        self.record = RunRecord()
        self.notes: list[str] = []
        self.status = "ok"
        self.grading_id, self.key = processes.new_grading_id(), secrets.token_hex(32)
        self.deadline = time.monotonic() + limits.timeout

    def run(self, tmp: Path) -> str:
        """Run attempts until done; return the tail of the children's output."""
        home, out = tmp / "home", tmp / "output.txt"
        home.mkdir()
        env = child_env(self.impl, home, self.grading_id)
        targets = ["tests"]
        for attempt in range(MAX_RESUMES + 1):
            outcome, code = self._attempt(tmp, attempt, targets, env, out)
            targets = self._resume_targets(outcome, code)
            if not targets:
                break
        return tail(out)

    def _command(self, log: Path, failed_imports: Path, leftovers: Path, targets: list[str]) -> list[str]:
        lim = self.limits
        return [sys.executable, "-m", "kit.grading.sandbox", f"--memory-gb={lim.memory_gb or 0}",
                f"--file-gb={lim.file_gb or 0}", f"--grader-pid={os.getpid()}", f"--leftovers-file={leftovers}", "--",
                sys.executable, "-m", "pytest", *targets, "-q", "-p", "kit", "-p", "no:cacheprovider",
                "-p", "kit.grading.plugin", f"--grading-log={log}", f"--per-test-timeout={lim.per_test_timeout}",
                f"--timing-factor={lim.timing_factor}", f"--timing-floor={lim.timing_floor}",
                f"--idle-limit={lim.idle_limit}", f"--judge-cpu-limit={lim.judge_cpu_limit}",
                f"--import-timeout={lim.import_timeout}", f"--failed-imports={failed_imports}",
                f"--impl={self.impl}", *self.selection, "-o", "addopts=", "--tb=short"]

    def _attempt(self, tmp: Path, n: int, targets: list[str], env: dict, out: Path) -> tuple[str, int | None]:
        """One child process: returns how it ended (exited, hung, lingered, timeout, interrupted) and its exit code."""
        log, failed_imports = tmp / f"events-{n}.jsonl", tmp / f"failed-imports-{n}.json"
        leftovers = tmp / f"leftovers-{n}.txt"
        failed_imports.write_text(json.dumps(self.record.import_failures))
        reader = SignedLog(log, self.key)
        self.record.finished = False
        judged_before = self.record.leftovers
        with open(out, "ab") as output:
            key = key_pipe(self.key)
            try:
                proc = processes.start(self._command(log, failed_imports, leftovers, targets), cwd=self.tree,
                                       env={**env, KEY_FD_ENV: str(key)}, output=output, grading_id=self.grading_id,
                                       pass_fds=(key,))
            except InterruptedError:
                return "interrupted", None
            finally:
                os.close(key)
            try:
                outcome = self._watch(proc, reader)
            finally:
                processes.stop(proc)
        # The watchdog killed what the run left behind (it knows its own orphans); the grader then sweeps
        # for anything carrying this run's marker that escaped the watchdog's process tree.
        killed = processes.kill_leftovers(self.grading_id)
        if leftovers.exists():
            killed += int(leftovers.read_text() or 0)
        for event in reader.read_new():
            self.record.apply(event)
        killed += self.record.leftovers - judged_before  # what the judge killed with its zygotes' cgroups
        if killed:
            self.notes.append(f"killed {killed} process(es) the submission left running")
        if reader.forged:
            self.record.flags.append(f"{reader.forged} forged or altered line(s) in the grading log were ignored")
        return outcome, proc.returncode

    def _watch(self, proc, reader: SignedLog) -> str:
        finished_at = None
        while True:
            for event in reader.read_new():
                self.record.apply(event)
            exited = proc.poll() is not None
            if processes.INTERRUPTED.is_set():
                return "interrupted"
            if exited:
                return "exited"
            if time.monotonic() >= self.deadline:
                return "timeout"
            if self.record.activity is not None and self.record.activity.overdue(self.limits.grace):
                return "hung"
            if self.record.finished:
                finished_at = finished_at or time.monotonic()
                if time.monotonic() - finished_at > LINGER:
                    return "lingered"
            time.sleep(POLL)

    def _resume_targets(self, outcome: str, code: int | None) -> list[str]:
        """After an attempt: the tests to run in a fresh child (none: the run is over)."""
        record = self.record
        if outcome in ("interrupted", "timeout"):
            self.status = outcome
            return []
        if record.collected is None or record.finished:
            return []
        activity = record.activity
        if activity is not None and activity.kind == "import":
            self._import_failed(activity, outcome, code)
        elif not self._test_failed(activity, outcome, code):
            return []
        record.activity = None
        return record.unreported()

    def _import_failed(self, activity: Activity, outcome: str, code: int | None) -> None:
        """The judge hung or died checking a module's import: that module is unavailable to the tests that use it."""
        why = (f"importing {activity.what} did not stop at its time limit of {activity.limit:g} s and was killed"
               if outcome == "hung" else f"the test process exited (code {code}) while importing {activity.what}")
        self.record.import_failures.setdefault(activity.what, why)
        self.notes.append(why)
        if outcome != "hung":
            self.status = "crashed"

    def _test_failed(self, activity: Activity | None, outcome: str, code: int | None) -> bool:
        """The child hung or died in a test: that test fails. False if no test was running (nothing to resume)."""
        unreported = self.record.unreported()
        culprit = activity.what if activity is not None else next(
            (n for n in unreported if n in self.record.reports), unreported[0] if unreported else None)
        if culprit is None:
            return False
        name = culprit.split("::")[-1]
        if outcome == "hung":
            self.record.fail(culprit, f"the test did not stop at its time limit of {activity.limit:g} s and was "
                                      "killed; the remaining tests were run again in a fresh process")
            self.notes.append(f"{name} did not stop at its time limit and was killed")
        else:
            self.record.fail(culprit, f"the test process exited during this test (exit code {code}): os._exit, "
                                      "a crash, or the memory limit. The remaining tests were run again in a fresh "
                                      "process.")
            self.notes.append(f"the test process died during {name} (exit code {code})")
            self.status = "crashed"
        return True

    def result(self, submission: str, output: str, elapsed: float) -> scoring.GradeResult:
        result = scoring.GradeResult(submission=submission, output=output, execution_time=elapsed)
        if self.record.collected is None and self.status != "interrupted":
            result.status = "error"
            result.message = "the test suite did not start; see the output"
            return result
        result.tests = scoring.score(self.record, scoring.problem_numbers())
        result.flags = self.record.flags
        result.status = self.status
        if self.status == "timeout":
            self.notes.insert(0, f"the submission ran past its {self.limits.timeout:g} s limit and was stopped")
        elif self.status == "interrupted":
            self.notes.insert(0, "grading was interrupted before it finished: this is not a grade")
        flagged = [f"FLAGGED: {'; '.join(result.flags)}"] if result.flags else []
        result.message = "; ".join(self.notes + flagged)
        return result


def grading_jobs() -> int:
    """How many stage groups one submission's grading runs side by side by default: 2 where this process may use
    at least 2 CPUs and 6 GiB are free (each group is a judge, its workers and their ranks: 1–2 GiB), else 1.
    Under ``taskset -c 0``, or on a small Gradescope container, grading stays one process at a time."""
    from kit.setup.doctor import available_cpus, available_memory_gib

    return 2 if available_cpus() >= 2 and (available_memory_gib() or 0.0) >= 6.0 else 1


def stage_groups(stages: list[int], jobs: int, root: Path = ROOT) -> list[list[int]]:
    """``stages`` dealt into at most ``jobs`` groups of about equal work: the reference's recorded seconds per
    stage (``tests/timings.json``), largest first, each to the lightest group so far. Each group is sorted."""
    seconds: dict[int, float] = dict.fromkeys(stages, 0.0)
    for nodeid, (setup, call, teardown, *_) in timings.load(root).items():
        match = re.search(r"test_stage(\d+)", nodeid)
        if match and int(match.group(1)) in seconds:
            seconds[int(match.group(1))] += setup + call + teardown
    groups: list[list[int]] = [[] for _ in range(max(1, min(jobs, len(stages))))]
    load = [0.0] * len(groups)
    for stage in sorted(stages, key=lambda s: -seconds[s]):
        lightest = load.index(min(load))
        groups[lightest].append(stage)
        load[lightest] += max(seconds[stage], 1.0)
    return [sorted(g) for g in groups if g]


def merge_results(parts: list[scoring.GradeResult], submission: str, elapsed: float) -> scoring.GradeResult:
    """One result from the results of stage groups graded side by side: the tests in stage order, the worst
    status (a group that could not start makes the whole an error), every note and flag, each group's output."""
    worst = ("error", "interrupted", "timeout", "crashed", "ok")
    status = min((p.status for p in parts), key=lambda s: worst.index(s) if s in worst else 0)
    result = scoring.GradeResult(submission=submission, status=status, execution_time=elapsed)
    result.tests = sorted((t for p in parts for t in p.tests), key=lambda t: t.stage)
    result.flags = [f for p in parts for f in p.flags]
    result.message = "; ".join(p.message for p in parts if p.message)
    result.output = "\n".join(p.output for p in parts)
    return result


def run_suite(tree: Path, impl: str, *, stages: list[int] | None = None, include_hidden: bool = False,
              limits: Limits | None = None, submission: str | None = None, jobs: int = 1) -> scoring.GradeResult:
    """Run the graded tests of ``tree`` against ``impl`` in a sandboxed child process group and score them.

    With ``jobs`` > 1 the stages are split into that many groups (:func:`stage_groups`), each graded by its own
    judge at the same time (a test mostly waits on its workers, so two judges use two CPUs); the results merge
    into one. Each group has every limit a whole run has: the limits are per test, the timeout per submission."""
    refusal = grader_refusal()
    if refusal is not None:
        raise GraderPlatformError(refusal)
    processes.become_subreaper()
    limits = limits or Limits()
    groups = stage_groups(stages or [s.number for s in registry.STAGES], jobs, tree) if jobs > 1 else [stages]
    runs = [SuiteRun(tree, impl, limits, group, include_hidden) for group in groups]
    start = time.monotonic()

    def grade_group(run: SuiteRun) -> scoring.GradeResult:
        with tempfile.TemporaryDirectory(prefix="kit-grade-") as tmp:
            output = run.run(Path(tmp))
        return run.result(submission or str(tree), output, time.monotonic() - start)

    if len(runs) == 1:
        return grade_group(runs[0])
    with ThreadPoolExecutor(len(runs)) as pool:
        parts = list(pool.map(grade_group, runs))
    return merge_results(parts, submission or str(tree), time.monotonic() - start)


def grade(impl: str = "student", *, stages: list[int] | None = None, include_hidden: bool = False,
          limits: Limits | None = None, jobs: int = 1) -> scoring.GradeResult:
    """Grade ``student``/``reference`` in this kit, or a submission folder at a path (staged in a clean copy);
    ``jobs`` stage groups at a time (:func:`run_suite`)."""
    if impl in ("student", "reference"):
        return run_suite(ROOT, impl, stages=stages, include_hidden=include_hidden, limits=limits, submission=impl,
                         jobs=jobs)
    path = Path(impl)
    if not path.exists():
        raise FileNotFoundError(f"--impl must be 'student', 'reference' or an existing folder, got {impl!r}")
    with tempfile.TemporaryDirectory(prefix="kit-submission-") as tmp:
        notes = stage_submission(path, Path(tmp), include_hidden=include_hidden)
        result = run_suite(Path(tmp), "student", stages=stages, include_hidden=include_hidden, limits=limits,
                           submission=str(path), jobs=jobs)
    if notes:
        result.message = "; ".join(filter(None, [result.message, *notes]))
    return result
