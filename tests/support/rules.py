"""The library rules' verdicts, once per session, and the gate that takes a thing's points from a library wrapper.

Each chapter says what the student builds and which library implementation of it they may not call
(:mod:`kit.grading.library_rules`). ``tests/test_stage<N>_rules.py`` registers, for each rule, a *judge*: it runs a
representative workload of the graded code under :func:`kit.grading.library_rules.watch` in the worker (or on spawned
ranks) and returns the violations it recorded, as data. :func:`verdict` runs it once per session and adds the
judge's own reading of the submission's source (:func:`kit.grading.library_rules.static_findings`).

Two things read the verdict:

* the rule's own test (``test_builds_its_own_…``), which fails with the rule's message — and also when the
  workload could not run, since an unchecked rule is not a kept one;
* the gate (``tests/conftest.py``): every test marked ``pytest.mark.builds("<rule>")`` fails with the same
  message when the rule was broken, so a wrapper of PyTorch's implementation loses the points of what it
  skipped — not one point. A workload that merely crashes (a stub, a bug) gates nothing: the behaviour tests
  report that themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kit import impl
from kit.grading import library_rules
from kit.setup.portable import NEEDS_TRITON, triton_missing_error

Judge = Callable[[pytest.FixtureRequest], list[dict]]
_JUDGES: dict[str, Judge] = {}


@dataclass
class Verdict:
    """``broken``: the rule's message when it was broken, else ``""``; ``unchecked``: why the workload could not
    run (``""`` when it ran)."""

    broken: str = ""
    unchecked: str = ""


_VERDICTS: dict[tuple[str, str], Verdict] = {}


def judge(key: str) -> Callable[[Judge], Judge]:
    """Register ``fn(request) -> violations as data`` as rule ``key``'s judge (a decorator)."""
    library_rules.rule(key)  # KeyError for a rule that does not exist

    def register(fn: Judge) -> Judge:
        _JUDGES[key] = fn
        return fn

    return register


def message(rule: library_rules.Rule, violations: list[dict], static: list[str]) -> str:
    """The teaching message for a broken rule."""
    lines = [f"Rule ({rule.section}): you build {rule.builds} yourself. PyTorch's own implementation ({rule.library}) "
             "passes every behaviour test, so code that calls it, wraps it or subclasses it earns none of those "
             "points. What your code did:"]
    lines += [library_rules.describe_one(v, rule) for v in violations]
    lines += [f"  - {finding} (read from your source)" for finding in static]
    lines.append(f"Still allowed: {rule.allowed}.")
    return "\n".join(lines)


def verdict(key: str, request: pytest.FixtureRequest) -> Verdict:
    """Rule ``key``'s verdict for the implementation in force, judged once per session."""
    cache_key = (impl.selected(), key)
    if cache_key in _VERDICTS:
        return _VERDICTS[cache_key]
    rule = library_rules.rule(key)
    result = Verdict()
    fn = _JUDGES.get(key)
    static = library_rules.static_findings(rule)
    if fn is None:
        result.unchecked = f"no judge is registered for rule {key!r} (its tests/test_stage{rule.stage}_rules.py)"
        violations: list[dict] = []
    else:
        try:
            violations = fn(request)
        except Exception as exc:  # noqa: BLE001 — a stub or a crash: the behaviour tests report it
            if triton_missing_error("ModuleNotFoundError", str(exc)):  # macOS: its tests are skipped, this one too
                pytest.skip(NEEDS_TRITON)
            violations = []
            result.unchecked = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if violations or static:
        result.broken = message(rule, violations, static)
    _VERDICTS[cache_key] = result
    return result


def assert_kept(key: str, request: pytest.FixtureRequest, unchecked: str) -> None:
    """The body of rule ``key``'s own test: fail with the rule's message when it was broken, and when its workload
    could not run, with ``"the rule could not be checked: "`` + ``unchecked`` (``{error}``: what the workload
    raised) — an unchecked rule is not a kept one."""
    found = verdict(key, request)
    assert not found.broken, found.broken
    assert not found.unchecked, "the rule could not be checked: " + unchecked.format(error=found.unchecked)


def gate(request: pytest.FixtureRequest) -> None:
    """Fail the running test when it grades something built by a library (its ``builds`` markers)."""
    for marker in request.node.iter_markers("builds"):
        for key in marker.args:
            if key in _JUDGES:  # only rules whose module was collected: grading collects every stage file
                found = verdict(key, request)
                if found.broken:
                    pytest.fail(found.broken, pytrace=False)
