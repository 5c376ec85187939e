"""The spawned-checks harness: one spawn, each check's value or failure in its own test, the same way everywhere."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from kit.checks import Failure, RankCheckError, Worker, reference_ranks, run_check, run_checks, spawned_checks
from kit.spawn import RankFailedError, RankTimeoutError, parent


def _sum_of_ranks() -> tuple[int, float]:
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _stub() -> None:
    raise NotImplementedError("Problem 9.1: implement the stub (handout 09 §1)")


def _assert_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise AssertionError("rank 1's gradient is off by 2x")


def _bare_assert() -> None:
    value = 3
    assert value == 4


def _fails_while_rank_zero_waits() -> None:
    if dist.get_rank() == 1:
        raise AssertionError("rank 1 gave up before the all-reduce")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that never comes


def _many_checks() -> dict:
    return run_checks({
        "sum": _sum_of_ranks,
        "stub": _stub,
        "assert_on_rank_one": _assert_on_rank_one,
        "type_error": lambda: 1 + "one",
        "bare_assert": _bare_assert,
        "after_the_failures": lambda: dist.get_rank() * 10,
        "hangs": _fails_while_rank_zero_waits,
        "never_ran": lambda: "unreachable",
    })


def _resumes(saved) -> dict:
    def resume():
        if isinstance(saved, Failure):
            saved.reraise("resuming needs the first run's 'stub' value")
        return saved

    return run_checks({"resume": resume, "independent": lambda: "fine"})


def _stub_before_the_checks() -> dict:
    _stub()  # e.g. a stub called while setting up, outside any check
    return run_checks({"never_ran": lambda: 1})


# The hang at the end of _many_checks costs the idle limit: 5 s here instead of the default 30. A marker, not a
# fixture: the grading plugin sets each test's allowance as its setup starts, before any fixture of it runs.
pytestmark = pytest.mark.idle_limit(5)


def _clock() -> dict:
    return run_checks({"now": time.monotonic})


many = spawned_checks(_many_checks, 2, timeout=120)
clock = spawned_checks(_clock, 2, timeout=60)
stub_first = spawned_checks(_stub_before_the_checks, 2, timeout=60)
dependent = spawned_checks(_resumes, 2, args=lambda many: (many.value_or_failure("stub", rank=0),), timeout=60)


def test_the_spawn_is_the_setup_of_the_first_test_using_it(clock) -> None:
    """Never in a test's call: the grader charges a file's largest setup to each of its tests, whichever comes
    first (kit/grading/timings.py)."""
    called = time.monotonic()
    assert all(now < called for now in clock.values("now")), "the ranks ran after the test's call began"


def test_values_by_rank_and_later_checks_still_run(many) -> None:
    assert many.values("sum") == [(0, 3.0), (1, 3.0)]
    assert many.values("after_the_failures") == [0, 10], "a failing check must not hide the ones after it"


def test_not_implemented_stays_not_implemented(many) -> None:
    with pytest.raises(NotImplementedError) as info:
        many.values("stub")
    text = str(info.value)
    assert text.startswith("Problem 9.1: implement the stub"), "the rank's own message comes first"
    assert "(rank 0, check 'stub'; ranks [1] failed this check too)" in text
    assert "in _stub" in text and "kit/checks.py" not in text, "traceback without the kit's frames"


def test_assertion_on_one_rank_stays_an_assertion(many) -> None:
    expected = r"^rank 1's gradient is off by 2x\n\(rank 1, check 'assert_on_rank_one'\)"
    with pytest.raises(AssertionError, match=expected):
        many.values("assert_on_rank_one")


def test_other_errors_name_their_type(many) -> None:
    with pytest.raises(RankCheckError, match=r"^TypeError: unsupported operand"):
        many.values("type_error")


def test_bare_assert_quotes_its_line(many) -> None:
    with pytest.raises(AssertionError, match=r"^AssertionError at test_checks.py:\d+: assert value == 4\n"):
        many.values("bare_assert")


def test_a_hang_keeps_what_finished_and_blames_the_failed_rank(many) -> None:
    with pytest.raises(AssertionError, match=r"^rank 1 gave up before the all-reduce\n.*ranks \[0\] never finished"):
        many.values("hangs")
    with pytest.raises(RankTimeoutError, match=r"check 'never_ran' did not finish on ranks \[0, 1\]: the spawn "
                       r"stopped after check 'hangs' failed on rank 1 \(rank 1 gave up"):
        many.values("never_ran")


def test_a_dependent_spawn_quotes_the_cause(dependent) -> None:
    with pytest.raises(NotImplementedError, match=r"^resuming needs the first run's 'stub' value, because that "
                       r"failed:\nProblem 9\.1: implement the stub") as info:
        dependent.values("resume")
    assert "(rank 0, check 'resume'" in str(info.value)
    assert dependent.values("independent") == ["fine", "fine"]
    with pytest.raises(KeyError, match="no check named 'typo'"):
        dependent.values("typo")


def test_a_stub_outside_the_checks_is_still_not_implemented(stub_first) -> None:
    expected = r"^check 'never_ran' did not finish on ranks \[0, 1\]\. rank [01] of 2 failed: NotImplementedError"
    with pytest.raises(NotImplementedError, match=expected):
        stub_first.values("never_ran")


def _check_alone(scale: float) -> float:
    if scale < 0:
        raise NotImplementedError("negative scales are a stub")
    return scale * (dist.get_rank() + 1)


def test_run_check_one_spawn_one_check() -> None:
    assert run_check(_check_alone, 2, args=(1.5,), timeout=60) == [1.5, 3.0]
    with pytest.raises(NotImplementedError, match=r"^negative scales are a stub\n\(rank 0, check '_check_alone'"):
        run_check(_check_alone, 2, args=(-1.0,), timeout=60)


# ----------------------------------------------------------------------------------------------------
# The single-process worker and the reference ranks
# ----------------------------------------------------------------------------------------------------


def _square(x: torch.Tensor) -> dict:
    return {"squared": x * x, "pid": os.getpid()}


def _crash() -> None:
    os._exit(7)


def _sleep() -> None:
    time.sleep(1000)


def _an_object() -> object:
    return Failure


def _loads_the_implementation() -> str:
    import kit.impl

    return kit.impl.load().benchmarking.__name__


def test_worker_returns_data_and_stays_warm() -> None:
    worker = Worker()
    first = worker.call(_square, torch.arange(3.0))
    second = worker.call(_square, torch.tensor([4.0]))
    assert torch.equal(first["squared"], torch.tensor([0.0, 1.0, 4.0])) and second["squared"].item() == 16.0
    assert first["pid"] == second["pid"] != os.getpid(), "one warm worker serves call after call, not the judge"


def test_worker_failures_keep_their_kind() -> None:
    worker = Worker()
    stub = r"^Problem 9\.1: implement the stub \(handout 09 §1\)\n\(check '_stub'\)"
    with pytest.raises(NotImplementedError, match=stub):
        worker.call(_stub)
    with pytest.raises(RankCheckError, match=r"exited with code 7 without reporting"):
        worker.call(_crash)
    assert worker.call(_square, torch.ones(1))["squared"].item() == 1.0, "a fresh worker replaces a dead one"
    with pytest.raises(RankCheckError, match=r"what _an_object returned is a builtins\.type: a check returns data"):
        worker.call(_an_object)


def test_worker_hang_is_stopped_with_its_stack() -> None:
    parent.allowance().idle = 3.0
    with pytest.raises(RankTimeoutError, match=r"check '_sleep' made no progress for 3 s.*in _sleep"):
        Worker().call(_sleep)


def test_reference_ranks_cannot_load_the_implementation() -> None:
    with pytest.raises(RankFailedError, match=r"reference ranks never load the implementation"):
        reference_ranks(_loads_the_implementation, 1, timeout=60)
    assert reference_ranks(_check_alone, 2, args=(1.0,), timeout=60) == [1.0, 2.0]
