"""Time limits inside the test process: an alarm around each test, and each stage's modules imported first.

Used by :mod:`kit.grading_plugin` in the graded child (standard library and the stage registry only).
The alarm raises :class:`TestTimeout` in the main thread, where pytest reports it as the test's failure;
a hang the alarm cannot interrupt is the grader's to kill (:mod:`kit.grading.running`).
"""

from __future__ import annotations

import importlib
import pkgutil
import signal
import sys
import traceback
from collections.abc import Callable
from contextlib import contextmanager

from kit import stages as registry


class TestTimeout(Exception):
    """The test (or an import) ran past its time limit."""


class Alarm:
    """``with alarm.limit(seconds, what):`` raises :class:`TestTimeout` after ``seconds``; ``remaining`` is what
    the last limit left unused (setup hands it to the call: one budget covers both)."""

    remaining = 0.0

    @contextmanager
    def limit(self, seconds: float, what: str):
        if seconds <= 0 or not hasattr(signal, "SIGALRM"):
            yield
            return

        def on_alarm(signum, frame):
            raise TestTimeout(f"{what} ran past its time limit of {round(seconds, 1):g} s (an endless loop or a hang?)")

        previous = signal.signal(signal.SIGALRM, on_alarm)  # set each time: student code may have replaced it
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            self.remaining = signal.setitimer(signal.ITIMER_REAL, 0)[0]
            signal.signal(signal.SIGALRM, previous)


def import_within(name: str, stage: int, seconds: float, write: Callable[[dict], None]) -> str | None:
    """Import module ``name`` within ``seconds``; ``None`` if it imports, else why not (for the student)."""
    write({"event": "import", "stage": stage, "module": name, "limit": seconds})
    why = None
    try:
        with Alarm().limit(seconds, f"importing {name}"):
            importlib.import_module(name)
    except TestTimeout:
        why = (f"importing {name} took longer than {round(seconds, 1):g} s — an endless loop or a blocking call "
               "at import time? A module must import in seconds: keep the work inside functions.")
    except BaseException as exc:  # SyntaxError, SystemExit, anything raised at module level
        report = traceback.TracebackException.from_exception(exc)
        # Only the submission's own frames: the import machinery and this module say nothing to a student.
        report.stack = traceback.StackSummary.from_list(
            [f for f in report.stack if "importlib" not in f.filename and f.filename != __file__])
        why = f"{name} failed to import:\n" + "".join(report.format())[-4000:]
    write({"event": "imported", "stage": stage, "module": name, "outcome": "failed" if why else "passed",
           "message": why or ""})
    return why


def check_imports(package: str, stages: list[int], seconds: float, failures: dict[int, str],
                  write: Callable[[dict], None]) -> None:
    """Import each stage's modules (a package's modules too) once; add the stages that fail to ``failures``."""
    todo = [s for s in stages if s not in failures]
    # The package first: a hang in its __init__ would otherwise cost every stage the import limit.
    why = import_within(package, 0, seconds, write) if todo else None
    for stage in todo:
        if why is not None:
            failures[stage] = why
            continue
        for module in registry.get(stage).modules:
            name = f"{package}.{module}"
            failure = import_within(name, stage, seconds, write)
            if failure is None and hasattr(sys.modules[name], "__path__"):
                for sub in pkgutil.iter_modules(sys.modules[name].__path__):
                    if (failure := import_within(f"{name}.{sub.name}", stage, seconds, write)) is not None:
                        break
            if failure is not None:
                failures[stage] = failure
                break
