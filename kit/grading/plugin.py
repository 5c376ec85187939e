"""The judge: the pytest plugin of the graded process (``-p kit.grading.plugin --grading-log FILE``).

The graded process runs pytest and decides every verdict, and it never imports, unpickles or calls the
code under test: the tests hand named checks to worker processes and compare the data that comes back
(:mod:`kit.checks`). This plugin makes that a property of the process, not a convention, and reports:

* **no implementation here.** While grading, importing ``student`` or ``reference`` in this process fails
  (a meta-path guard): a test that tried would be a kit bug, caught by the kit's own suite;
* **workers confined.** Every worker is forked from a zygote confined with Landlock
  (:mod:`kit.spawn.confine`): it reads the Python installation, the kit, the submission and the public
  tests (and the worker halves of the hidden tests), writes only its scratch folder, and cannot signal or
  trace this process, which is also made non-dumpable;
* **limits that tell a hang from a slow machine.** Each test's workers get a CPU budget from the
  reference's recorded CPU time and an idle limit (:mod:`kit.grading.timings`, :mod:`kit.spawn.watch`);
  the wall clock (``--per-test-timeout``) is only the last resort;
* **the judge's own work metered.** The judge's CPU in one test's setup and call is limited too
  (``--judge-cpu-limit`` CPU-seconds, :data:`JUDGE_CPU_LIMIT` by default, 0: none): reading and comparing
  what workers send is bounded by :mod:`kit.spawn.wire`'s limits, and whatever else could make this process
  spin (an answer too costly to check, a kit bug) fails that one test, saying so, and grading goes on. A
  ``SIGPROF`` timer (``ITIMER_PROF``) runs while setup and call do, on the main thread, where there is one;
* **imports first.** Before any test, each graded module is imported once in a worker under
  ``--import-timeout``; one that hangs or fails at import is unavailable from then on, so the tests that use
  it fail at once, naming it and why, and every other test is graded as usual (:mod:`kit.grading.imports`).

Outside grading it also gives pytest ``--inline`` (:func:`kit.spawn.parent.set_inline`): a test's checks run in this
process, so that a ``breakpoint()`` in the implementation stops in the terminal. With ``--grading-log`` it is refused,
and so is grading on the portable path or off Linux (:func:`kit.setup.portable.grader_refusal`).

It appends one JSON line per event to the log, flushed at once, so the grader still knows what passed
if this process dies halfway:

* ``{"event": "collected", "tests": [...]}`` — every graded test with its points, stage and visibility;
* ``{"event": "import" | "imported", "stage", "module", …}`` — the import checks;
* ``{"event": "start", "nodeid", "limit"}`` — a test begins and may take ``limit`` seconds of wall clock;
* ``{"event": "report", "nodeid", "when", "outcome", "longrepr", "duration", "cpu"}`` — each phase's result
  (``cpu``: seconds of CPU its workers used);
* ``{"event": "flag", "nodeid", "what"}`` — something a submission did that grading does not allow;
* ``{"event": "finished", "leftovers"}`` — the session ended normally; its workers had left ``leftovers``
  processes running (daemons), now killed.

Every event carries a sequence number and an HMAC under a key the grader passes through a pipe (its descriptor's
number in ``KIT_GRADING_KEY_FD``; the key itself is in no process's environment, where ``/proc/PID/environ``
would show it), read and closed before any worker starts, so a line a worker appends to the log is detected
and ignored.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import json
import os
import signal
import site
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import pytest

from kit import stages as registry
from kit.grading import timings
from kit.grading.events import signer
from kit.grading.sandbox import KEY_FD_ENV
from kit.setup.portable import grader_refusal
from kit.spawn import parent as workers
from kit.spawn.confine import Rules, keep_out_of_reach

IMPLEMENTATIONS = ("student", "reference")
JUDGE_CPU_LIMIT = timings.JUDGE_CPU_LIMIT


class _State:
    log = None
    log_path: str | None = None
    sign = staticmethod(signer(b""))
    seq = 0
    limits: timings.Limits | None = None
    idle = timings.IDLE
    files_started: set[str] = set()  # test files of which a test has begun in this process
    import_timeout = 0.0
    import_failures: dict[str, str] = {}  # module → why it did not import
    cpu_at_phase_start = 0.0
    judge_cpu_limit = 0.0  # while grading, where a CPU timer can interrupt the main thread; 0: not metered
    judge_cpu_left = 0.0  # of the current test's
    judge_cpu_spent = False  # the current test used it all
    leftovers = 0  # processes the workers had left running when they were stopped before the session's end


class JudgeGuard(importlib.abc.MetaPathFinder):
    """In the judge, the implementation packages cannot be imported: a verdict never rests on their code."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in IMPLEMENTATIONS:
            raise ImportError(f"{name}: the grading process never imports the implementation; a test reaches it "
                              "through a worker (kit.checks)", name=name)
        return None


def worker_rules(root: Path, impl: str) -> Rules:
    """What a worker may read when grading ``impl`` in the tree ``root``: the Python installation, the kit,
    the implementation, the public tests and the hidden tests' worker halves — never ``reference/`` (unless
    it is what is graded), the judge's half of a hidden test, the grading log or anything else."""
    python = {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages(), site.getusersitepackages()}
    python |= {p for p in sys.path if p and not Path(p).resolve().is_relative_to(root.resolve())}
    python |= {str(Path(p).resolve()) for p in python if Path(p).exists()}
    tests = root / "tests"
    read = sorted(python) + [str(root / "kit"), str(root / impl), str(root / "pyproject.toml")]
    read += [str(p) for p in sorted(tests.glob("*.py"))] + [str(p) for p in sorted(tests.glob("support"))]
    read += [str(p) for p in sorted((tests / "hidden").glob("*_worker.py"))]
    return Rules(read=read, list_only=[str(root), str(tests), str(tests / "hidden")])


def pytest_addoption(parser: pytest.Parser) -> None:
    from kit import impl

    # Here, not in tests/conftest.py: this plugin is loaded by addopts before any conftest, so `pytest -m stage1
    # --impl reference` works without naming the tests folder (a conftest's options exist only once it is found).
    parser.addoption("--impl", default=None, choices=impl.CHOICES,
                     help=f"implementation to grade: student (default) or reference; ${impl.ENV_VAR} works too")
    group = parser.getgroup("kit grading")
    group.addoption("--grading-log", default=None, help="append per-test grading events (JSON lines) here")
    group.addoption("--per-test-timeout", type=float, default=0.0,
                    help="most seconds of wall clock a test may take (0: none); hangs are caught sooner")
    group.addoption("--timing-factor", type=float, default=timings.FACTOR,
                    help="a test's CPU budget = factor × its reference CPU time…")
    group.addoption("--timing-floor", type=float, default=timings.FLOOR, help="…but at least this many CPU-seconds")
    group.addoption("--idle-limit", type=float, default=timings.IDLE,
                    help="seconds a test's workers may make no progress before they count as blocked")
    group.addoption("--import-timeout", type=float, default=0.0,
                    help="import each graded stage's modules first, failing the stage past this many seconds")
    group.addoption("--failed-imports", default=None, help="JSON {module: reason}: modules already known not to import")
    group.addoption("--judge-cpu-limit", type=float, default=JUDGE_CPU_LIMIT,
                    help="while grading, most CPU-seconds this process may spend on a test's setup and call (0: none)")
    parser.getgroup("kit debugging").addoption(
        "--inline", action="store_true", default=False,
        help="debug a test: run its checks in this process (rank 0 of a spawn too, its other ranks in workers), so "
             "that breakpoint() in your code stops here; no time limits. Never in a grade.")


def _write(event: dict) -> None:
    if _State.log is None:
        return
    event = {"seq": _State.seq, **event}
    event["mac"] = _State.sign(event)
    _State.seq += 1
    _State.log.write(json.dumps(event) + "\n")
    _State.log.flush()


def _read_key() -> str:
    """The grading log's key, from the pipe the grader handed over (then closed); "" outside a grading run."""
    fd = os.environ.pop(KEY_FD_ENV, "")
    if not fd.isdigit():
        return ""
    chunks = []
    try:
        while chunk := os.read(int(fd), 4096):
            chunks.append(chunk)
        os.close(int(fd))
    except OSError:
        return ""
    return b"".join(chunks).decode()


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--grading-log")
    if path and config.getoption("--inline"):
        raise pytest.UsageError("--inline is for debugging a test with pytest; a grade (--grading-log) always runs the "
                                "checks in confined worker processes, never in the grading process")
    if path and grader_refusal() is not None:
        raise pytest.UsageError(f"cannot grade here: {grader_refusal()}")
    workers.set_inline(bool(config.getoption("--inline")))
    key = _read_key()  # before any worker is started
    _State.sign = staticmethod(signer(key.encode()))
    cap = config.getoption("--per-test-timeout") or 0.0
    _State.limits = timings.Limits(timings.load(Path(config.rootpath)), cap=cap or float("inf"),
                                   factor=config.getoption("--timing-factor"), floor=config.getoption("--timing-floor"))
    _State.idle = config.getoption("--idle-limit")
    _State.import_timeout = config.getoption("--import-timeout") or 0.0
    known = config.getoption("--failed-imports")
    if known:
        _State.import_failures = dict(json.loads(Path(known).read_text()))
    if path:
        _State.log_path = os.path.abspath(path)
        _State.log = open(path, "a", encoding="utf-8")  # noqa: SIM115 — stays open for the whole session
        from kit.impl import selected

        sys.meta_path.insert(0, JudgeGuard())
        keep_out_of_reach()
        workers.confine_workers(worker_rules(Path(config.rootpath), selected()))
        limit = config.getoption("--judge-cpu-limit") or 0.0
        if limit > 0 and hasattr(signal, "ITIMER_PROF") and threading.current_thread() is threading.main_thread():
            _State.judge_cpu_limit = limit
            signal.signal(signal.SIGPROF, _judge_cpu_spent)


def pytest_enter_pdb(config: pytest.Config, pdb) -> None:
    workers.note_debugger(pdb)  # pytest --inline: quitting it ends the check, whatever the check catches


def pytest_sessionstart(session: pytest.Session) -> None:
    # Every option and conftest has set the environment the workers inherit by now. The zygote's start then
    # overlaps the collection, instead of following it; an xdist controller runs no test and starts none.
    config = session.config
    controller = bool(config.getoption("numprocesses", None)) and not hasattr(config, "workerinput")
    if not config.getoption("collectonly") and not controller:
        workers.start_zygote()


def graded_info(item: pytest.Item) -> dict | None:
    """Points, stage and visibility of a graded test, or None when the test is not graded."""
    points = item.get_closest_marker("points")
    if points is None:
        return None
    doc = (getattr(item, "obj", None).__doc__ or "").strip().split("\n")[0] if hasattr(item, "obj") else ""
    return {
        "nodeid": item.nodeid,
        "points": float(points.args[0]),
        "stage": registry.stage_of(item) or 0,
        "hidden": item.get_closest_marker("hidden") is not None,
        "doc": doc,
    }


def pytest_collection_finish(session: pytest.Session) -> None:
    tests = [info for item in session.items if (info := graded_info(item)) is not None]
    _write({"event": "collected", "tests": tests, "time": time.time(),
            "confinement": workers.confinement() if _State.log is not None else ""})
    if _State.import_timeout > 0 and _State.log is not None:
        from kit.grading.imports import check_imports
        from kit.impl import selected

        check_imports(selected(), sorted({t["stage"] for t in tests}), _State.import_timeout,
                      _State.import_failures, _write, Path(session.config.rootpath))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Stop the workers here, not at exit, so the log says how many processes they left running (killed with the
    # zygotes' cgroups): the grade reports them.
    leftovers = _State.leftovers + (workers.shutdown() if _State.log is not None else 0)
    _write({"event": "finished", "exitstatus": int(exitstatus), "time": time.time(),
            "leftovers": leftovers})


def _judge_cpu_spent(signum: int, frame: FrameType | None) -> None:
    """The SIGPROF handler: the judge used its CPU allowance for this test; fail the test where it is."""
    _State.judge_cpu_spent = True
    where = ""
    if frame is not None:
        where = f"; stopped in {frame.f_code.co_name}, {Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
    raise pytest.fail.Exception(
        f"the judge spent more than {_State.judge_cpu_limit:g} CPU-seconds of its own on this test "
        f"(--judge-cpu-limit{where}): a worker's answer that is too costly to check — far more values, or "
        "values far larger, than the check asks for — or a fault of the kit. The judge only reads and compares "
        "what workers send, in about a second at most for every test of the reference; return what the check "
        "asks for, numbers as tensors.", pytrace=False)


def _meter_judge_cpu(on: bool) -> None:
    """Run (``on``) or pause the judge's CPU timer of the current test: setup and call, not pytest's reports
    in between nor teardown."""
    if not _State.judge_cpu_limit:
        return
    if on:
        if not _State.judge_cpu_spent:  # a timer of 0 would be no timer: at least a millisecond
            signal.setitimer(signal.ITIMER_PROF, max(_State.judge_cpu_left, 1e-3))
    else:
        _State.judge_cpu_left = signal.setitimer(signal.ITIMER_PROF, 0)[0]


@contextlib.contextmanager
def _judge_cpu_metered():
    """The judge's CPU timer runs inside (a phase of the current test), and is paused after."""
    _meter_judge_cpu(True)
    try:
        yield
    finally:
        _meter_judge_cpu(False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    file = item.nodeid.split("::")[0]
    first_in_file = file not in _State.files_started
    _State.files_started.add(file)
    budget = _State.limits.budget(item.nodeid, first_in_file=first_in_file)
    _write({"event": "start", "nodeid": item.nodeid, "limit": budget.total if budget.total < float("inf") else 0.0})
    # Setup and call share one allowance: a module-scoped spawn in setup is the test's work too. A test that hangs
    # on purpose (the kit's own tests of the idle limit) may shorten its idle limit with @pytest.mark.idle_limit(s).
    marker = item.get_closest_marker("idle_limit")
    idle = min(_State.idle, float(marker.args[0])) if marker else _State.idle
    if workers.inline():  # someone may be stepping through it: no limit
        workers.set_allowance(workers.Allowance(idle=float("inf")))
    else:
        workers.set_allowance(workers.Allowance(cpu=budget.cpu, idle=idle, wall=budget.run))
    _State.cpu_at_phase_start = 0.0
    _State.judge_cpu_left, _State.judge_cpu_spent = _State.judge_cpu_limit, False
    with _judge_cpu_metered():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _judge_cpu_metered():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem):
    try:
        return (yield)
    finally:
        workers.set_allowance(workers.Allowance(idle=float("inf") if workers.inline() else _State.idle))
        if _State.judge_cpu_spent:  # stopped anywhere, even inside a request: the next test starts fresh workers
            _State.leftovers += workers.shutdown()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    longrepr = ""
    if report.failed or report.skipped:
        longrepr = report.longreprtext if hasattr(report, "longreprtext") else str(report.longrepr)
    spent = workers.allowance().spent
    cpu, _State.cpu_at_phase_start = spent - _State.cpu_at_phase_start, spent
    _write({
        "event": "report",
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "longrepr": longrepr[-20_000:],
        "duration": report.duration,
        "cpu": round(cpu, 3) if report.when != "teardown" else 0.0,
    })
