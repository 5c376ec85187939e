"""A pytest plugin for the mutant runs: end the session at the first failing test whose message matches a pattern.

``python -m instructor mutants`` asks of each mutant one question: does *some* public test fail with a message that
points at the mistake (the catalogue's ``expect``)? Once one has, the tests after it cannot change the verdict, so
:func:`instructor.trials.run_tests` copies this module into the grading tree and loads it (``-p``) with the pattern
in ``LLMSYS_STOP_WHEN``: the session stops there instead of running the rest of the stage. A failure that does not
match changes nothing, and a mutant no test catches still runs every test, so every verdict is the one the whole
run would give.

The text matched is what the junit report records as the failure's message (what
:func:`instructor.trials.failures` reads and the verdict is judged on): the exception's message for a failure — as
pytest shortens it for the report's ``message`` attribute, whole lines while they fit — and the same text inside
``failed on setup with "…"`` for an error. Matching more than that (the full message) would stop a run at a
failure the verdict then does not count.
"""

from __future__ import annotations

import os
import re

import pytest

PATTERN = os.environ.get("LLMSYS_STOP_WHEN", "")


try:  # pytest ≥ 8.4 shortens the junit ``message`` attribute; earlier versions write it whole
    from _pytest.junitxml import shorten_message
except ImportError:  # pragma: no cover — depends on the installed pytest
    def shorten_message(msg: str) -> str:
        return msg


def junit_message(report: pytest.TestReport) -> str:
    """The message junit-xml writes for a failed ``report`` (``_pytest.junitxml``): an error in setup or teardown
    has its ``failed on setup with "…"`` prefix before the shortening, which therefore keeps fewer of its lines."""
    crash = getattr(report.longrepr, "reprcrash", None)
    reason = getattr(crash, "message", None) or str(report.longrepr)
    if getattr(report, "when", "call") in ("setup", "teardown"):
        reason = f'failed on {report.when} with "{reason}"'
    return shorten_message(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if PATTERN and report.failed and re.search(PATTERN, junit_message(report), re.I | re.S):
        item.session.shouldstop = f"{item.name} failed with a message matching the mutant's pattern"
