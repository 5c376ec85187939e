"""pytest plugin the grader loads (``-p kit.grading_plugin --grading-log FILE``).

It appends one JSON line per event to the log, flushed at once, so the grader still knows what passed
if the interpreter dies halfway:

* ``{"event": "collected", "tests": [...]}`` — every graded test with its points, stage and visibility;
* ``{"event": "report", "nodeid", "when", "outcome", "longrepr", "duration"}`` — each phase's result;
* ``{"event": "finished"}`` — the session ended normally (a run that calls ``os._exit(0)`` never writes it).

A test counts as passed only when its setup, call and teardown all passed; a test with no report
(the run crashed or was killed) counts as failed. It also enforces a per-test time limit
(``--per-test-timeout``) by raising inside the test, so one endless loop costs one test, not the run.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

_log = None
_timeout = 0.0


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kit grading")
    group.addoption("--grading-log", default=None, help="append per-test grading events (JSON lines) here")
    group.addoption("--per-test-timeout", type=float, default=0.0, help="seconds before a test is failed")


def _write(event: dict) -> None:
    if _log is not None:
        _log.write(json.dumps(event) + "\n")
        _log.flush()
        os.fsync(_log.fileno())


def pytest_configure(config: pytest.Config) -> None:
    global _log, _timeout
    path = config.getoption("--grading-log")
    if path:
        _log = open(path, "a", encoding="utf-8")  # noqa: SIM115 — stays open for the whole session
    _timeout = config.getoption("--per-test-timeout") or 0.0


def graded_info(item: pytest.Item) -> dict | None:
    """Points, stage and visibility of a graded test, or None when the test is not graded."""
    points = item.get_closest_marker("points")
    if points is None:
        return None
    stage = next((int(m.name[5:]) for m in item.iter_markers() if m.name[:5] == "stage" and m.name[5:].isdigit()), 0)
    return {
        "nodeid": item.nodeid,
        "points": float(points.args[0]),
        "stage": stage,
        "hidden": item.get_closest_marker("hidden") is not None,
        "doc": (getattr(item, "obj", None).__doc__ or "").strip().split("\n")[0] if hasattr(item, "obj") else "",
    }


def pytest_collection_finish(session: pytest.Session) -> None:
    tests = [info for item in session.items if (info := graded_info(item)) is not None]
    _write({"event": "collected", "tests": tests, "time": time.time()})


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Without this event the grader knows the run was cut short, whatever exit code the process gave.
    _write({"event": "finished", "exitstatus": int(exitstatus), "time": time.time()})


class TestTimeout(Exception):
    """The test ran past the grader's per-test time limit."""


def _on_alarm(signum, frame):
    raise TestTimeout(f"test exceeded the per-test time limit of {_timeout:g} s (an endless loop or a hang?)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    if _timeout > 0 and hasattr(signal, "SIGALRM"):
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, _timeout)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    else:
        yield


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
