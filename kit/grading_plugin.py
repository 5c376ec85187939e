"""pytest plugin the grader loads (``-p kit.grading_plugin --grading-log FILE``).

It appends one JSON line per event to the log, flushed at once, so the grader still knows what passed
if the interpreter dies halfway:

* ``{"event": "collected", "tests": [...]}`` — every graded test with its points, stage and visibility;
* ``{"event": "import" | "imported", "stage", "module", …}`` — the import checks (below);
* ``{"event": "start", "nodeid", "limit"}`` — a test begins and may take ``limit`` seconds in all;
* ``{"event": "report", "nodeid", "when", "outcome", "longrepr", "duration"}`` — each phase's result;
* ``{"event": "flag", "nodeid", "what"}`` — something a submission did that grading does not allow;
* ``{"event": "finished"}`` — the session ended normally (a run that calls ``os._exit(0)`` never writes it).

Every event carries a sequence number and an HMAC under a key the grader passes in ``KIT_GRADING_KEY``;
the plugin removes the key from the environment before any student code is imported, so events forged
by a submission are detected and ignored.

Defences inside the test process (the grader runs it as a separate process group with time and memory
limits; see docs in README "Instructor workflow" for what the container must be trusted for):

* an audit hook refuses imports of ``reference`` and opening any path under a ``reference/`` folder or
  the grading log, and refuses call-stack inspection (``sys._getframe``, ``frame.f_back``, …) from code
  under ``student/`` — the way a submission would read a test's expected values;
* after every test, the functions grading depends on (pytest's reporting, ``torch.testing.assert_close``,
  ``kit.testing``) are compared with the originals; a replaced one fails that test, is flagged and restored;
* a per-test time limit raises inside the test (:mod:`kit.grading.deadlines`), so an endless loop costs
  one test: each test's budget comes from its recorded reference time (:mod:`kit.grading.timings`;
  ``--per-test-timeout`` is the cap and the limit of tests with no recorded time) and covers setup and
  call together — module-scoped fixtures charge their spawn to the first test's setup — and, separately,
  teardown;
* before any test runs, each stage's implementation modules are imported once under ``--import-timeout``;
  a module that hangs or fails at import fails its stage's tests at once, with the reason, and the other
  stages are graded as usual. ``--failed-imports FILE`` (JSON, stage → reason) carries such failures into
  a resumed run without importing those modules again.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from kit.grading import deadlines, timings

KEY_ENV = "KIT_GRADING_KEY"
FRAME_ATTRIBUTES = frozenset({"f_back", "f_locals", "f_globals", "tb_frame", "gi_frame", "cr_frame", "ag_frame"})
# (module, attribute path) of everything a passing verdict depends on.
GUARDED = (
    ("torch.testing", "assert_close"), ("torch", "allclose"), ("torch", "equal"), ("torch", "isclose"),
    ("kit.testing", "assert_close"), ("kit.testing", "assert_equal"), ("kit.testing", "raises"),
    ("kit.testing", "raises.__exit__"), ("pytest", "approx"), ("pytest", "raises"),
    ("_pytest.runner", "call_and_report"), ("_pytest.runner", "call_runtest_hook"),
    ("_pytest.runner", "pytest_runtest_makereport"), ("_pytest.reports", "TestReport.from_item_and_call"),
    ("_pytest.python", "Function.runtest"), ("_pytest.python", "pytest_pyfunc_call"),
)


def signer(key: bytes):
    """HMAC-SHA256 over the event's canonical JSON; ``None`` key signs nothing (local runs)."""
    def sign(event: dict) -> str:
        body = json.dumps(event, sort_keys=True).encode()
        return hmac.new(key, body, hashlib.sha256).hexdigest() if key else ""
    return sign


class _State:
    log = None
    log_path: str | None = None
    sign = staticmethod(signer(b""))
    seq = 0
    limits: timings.Limits | None = None
    alarm = deadlines.Alarm()
    files_started: set[str] = set()  # test files of which a test has begun in this process
    import_timeout = 0.0
    import_failures: dict[int, str] = {}
    originals: dict = {}
    flags: list[str] = []
    student_root: str = ""
    in_hook = threading.local()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kit grading")
    group.addoption("--grading-log", default=None, help="append per-test grading events (JSON lines) here")
    group.addoption("--per-test-timeout", type=float, default=0.0,
                    help="most seconds a test may take, and the limit of tests with no recorded time (0: none)")
    group.addoption("--timing-factor", type=float, default=timings.FACTOR, help="limit = factor × reference time…")
    group.addoption("--timing-floor", type=float, default=timings.FLOOR, help="…but at least this many seconds")
    group.addoption("--import-timeout", type=float, default=0.0,
                    help="import each graded stage's modules first, failing the stage past this many seconds")
    group.addoption("--failed-imports", default=None, help="JSON {stage: reason}: stages already known not to import")


def _write(event: dict) -> None:
    if _State.log is None:
        return
    event = {"seq": _State.seq, **event}
    event["mac"] = _State.sign(event)
    _State.seq += 1
    _State.log.write(json.dumps(event) + "\n")
    _State.log.flush()


def _raw(owner, attr: str):
    # On a class, compare the descriptor itself: a classmethod gives a new bound method at each access.
    return owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)


def _snapshot() -> None:
    for module, path in GUARDED:
        try:
            owner = importlib.import_module(module)
            *parents, attr = path.split(".")
            for part in parents:
                owner = getattr(owner, part)
        except (ImportError, AttributeError):
            continue
        _State.originals[(module, path)] = (owner, attr, _raw(owner, attr))


def _check_and_restore() -> list[str]:
    replaced = []
    for (module, path), (owner, attr, original) in _State.originals.items():
        if _raw(owner, attr) is not original:
            replaced.append(f"{module}.{path}")
            setattr(owner, attr, original)
    return replaced


def _caller_is_student(frame) -> bool:
    root = _State.student_root
    return bool(root) and frame is not None and frame.f_code.co_filename.startswith(root)


def _audit(event: str, args: tuple) -> None:
    if getattr(_State.in_hook, "active", False):
        return
    _State.in_hook.active = True
    try:
        if event == "import" and args and isinstance(args[0], str) and args[0].split(".")[0] == "reference":
            _flag("tried to import the reference solutions")
            raise ImportError("the reference solutions are not available when grading")
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            if "reference" in Path(path).parts:
                _flag(f"tried to open {path}")
                raise PermissionError(f"{path}: reference solutions are not readable when grading")
            if _State.log_path and os.path.abspath(path) == _State.log_path:
                _flag("tried to open the grading log")
                raise PermissionError("the grading log is not writable by tests")
        if event == "sys._getframe" or event == "sys._current_frames" or (
            event == "object.__getattr__" and len(args) > 1 and args[1] in FRAME_ATTRIBUTES
        ):
            caller = sys._getframe(1)  # the frame doing the inspection (this call re-enters the hook: ignored)
            if _caller_is_student(caller):
                _flag(f"inspected the call stack ({event} {args[1] if len(args) > 1 else ''})".strip())
                raise PermissionError("student code may not inspect the call stack while graded")
    finally:
        _State.in_hook.active = False


_current_nodeid = ""


def _flag(what: str) -> None:
    _State.flags.append(what)
    _write({"event": "flag", "nodeid": _current_nodeid, "what": what})


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--grading-log")
    key = os.environ.pop(KEY_ENV, "")  # gone before any student code can read it
    _State.sign = staticmethod(signer(key.encode()))
    if path:
        _State.log_path = os.path.abspath(path)
        _State.log = open(path, "a", encoding="utf-8")  # noqa: SIM115 — stays open for the whole session
    cap = config.getoption("--per-test-timeout") or 0.0
    if cap > 0:
        _State.limits = timings.Limits(timings.load(Path(config.rootpath)), cap=cap,
                                       factor=config.getoption("--timing-factor"),
                                       floor=config.getoption("--timing-floor"))
    _State.import_timeout = config.getoption("--import-timeout") or 0.0
    known = config.getoption("--failed-imports")
    if known:
        _State.import_failures = {int(k): v for k, v in json.loads(Path(known).read_text()).items()}
    # Grading the reference itself (the kit's own check) needs no defences against it.
    if path and os.environ.get("LLMSYS_IMPL", "student") == "student":
        _State.student_root = str(Path(config.rootpath, "student")) + os.sep
        _snapshot()
        sys.addaudithook(_audit)  # cannot be removed once added


def graded_info(item: pytest.Item) -> dict | None:
    """Points, stage and visibility of a graded test, or None when the test is not graded."""
    points = item.get_closest_marker("points")
    if points is None:
        return None
    stage = _stage_of(item)
    doc = (getattr(item, "obj", None).__doc__ or "").strip().split("\n")[0] if hasattr(item, "obj") else ""
    return {
        "nodeid": item.nodeid,
        "points": float(points.args[0]),
        "stage": stage,
        "hidden": item.get_closest_marker("hidden") is not None,
        "doc": doc,
    }


def pytest_collection_finish(session: pytest.Session) -> None:
    tests = [info for item in session.items if (info := graded_info(item)) is not None]
    _write({"event": "collected", "tests": tests, "time": time.time()})
    if _State.import_timeout > 0 and _State.log is not None:
        from kit.impl import selected

        deadlines.check_imports(selected(), sorted({t["stage"] for t in tests}), _State.import_timeout,
                                _State.import_failures, _write)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write({"event": "finished", "exitstatus": int(exitstatus), "time": time.time()})


def _stage_of(item: pytest.Item) -> int:
    return next((int(m.name[5:]) for m in item.iter_markers() if m.name[:5] == "stage" and m.name[5:].isdigit()), 0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    file = item.nodeid.split("::")[0]
    first_in_file = file not in _State.files_started
    _State.files_started.add(file)
    budget = _State.limits.budget(item.nodeid, first_in_file=first_in_file) if _State.limits else None
    _write({"event": "start", "nodeid": item.nodeid, "limit": budget.total if budget else 0.0})
    why = _State.import_failures.get(_stage_of(item))
    if why is not None:
        stage = _stage_of(item)
        pytest.fail(f"Stage {stage}'s code did not import, so none of its tests can run:\n{why}", pytrace=False)
    with _State.alarm.limit(budget.run if budget else 0.0, "the test (setup and call)"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    # What setup left of the run budget (at least a moment, so a limit is always armed when one is set).
    with _State.alarm.limit(max(_State.alarm.remaining, 0.01) if _State.limits else 0.0, "the test (setup and call)"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem):
    with _State.alarm.limit(_State.limits.budget(item.nodeid).teardown if _State.limits else 0.0, "the teardown"):
        return (yield)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    global _current_nodeid
    _current_nodeid = item.nodeid
    flags_before = len(_State.flags)
    outcome = yield
    report = outcome.get_result()
    replaced = _check_and_restore() if _State.originals else []
    for name in replaced:
        _flag(f"replaced {name}")
    new_flags = _State.flags[flags_before:]
    if (replaced or new_flags) and report.when == "call":
        report.outcome = "failed"
        report.longrepr = "grading integrity: this test did something grading does not allow: " + "; ".join(new_flags)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    longrepr = ""
    if report.failed or report.skipped:
        longrepr = report.longreprtext if hasattr(report, "longreprtext") else str(report.longrepr)
    _write({
        "event": "report",
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "longrepr": longrepr[-20_000:],
        "duration": report.duration,
    })
