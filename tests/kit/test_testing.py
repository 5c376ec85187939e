"""kit.testing: comparisons and exception checks whose failures teach."""

from __future__ import annotations

import pytest
import torch

from kit.spawn import RankFailedError
from kit.testing import assert_close, raises


def test_scalar_mismatch_is_said_plainly() -> None:
    with pytest.raises(AssertionError) as info:
        assert_close(torch.tensor(1.5), torch.tensor(1.0), name="loss", section="handout 02 §1", rtol=0, atol=0.1)
    text = str(info.value)
    assert "index" not in text, text
    assert text == ("loss: got 1.5, expected 1: |diff| 0.5 is more than the allowed 0.1 (rtol=0, atol=0.1). "
                    "See handout 02 §1.")
    with pytest.raises(AssertionError, match=r"^loss: got nan where 1 was expected"):
        assert_close(torch.tensor(float("nan")), torch.tensor(1.0), name="loss", section="handout 02 §1")


def _reject(value, kind=ValueError, message="iters must be a positive int"):
    if value is not None:
        raise kind(message)


def test_raises_passes_the_expected_error_and_keeps_it() -> None:
    with raises(ValueError, match="iters", what="time_fn(iters=0)", section="handout 01 §2") as info:
        _reject(0)
    assert isinstance(info.value, ValueError)
    with raises((ValueError, TypeError), match="iters", what="time_fn(iters='3')", section="handout 01 §2"):
        _reject("3", TypeError)


def test_raises_explains_each_way_to_miss() -> None:
    section = "handout 01 §2"
    with pytest.raises(AssertionError, match=r"^time_fn\(iters=0\): expected ValueError naming 'iters', got "
                       r"TypeError: iters must be a positive int\. See handout 01 §2\.$"):
        with raises(ValueError, match="iters", what="time_fn(iters=0)", section=section):
            _reject(0, TypeError)
    with pytest.raises(AssertionError, match=r"^time_fn\(iters=0\): returned without raising; expected ValueError "
                       r"or TypeError naming 'iters'\. Check the argument first\. See handout 01 §2\.$"):
        with raises((ValueError, TypeError), match="iters", what="time_fn(iters=0)", section=section,
                    hint="Check the argument first."):
            _reject(None)
    with pytest.raises(AssertionError, match=r"raised ValueError as expected, but its message does not name 'iters': "
                       r"'bad value'"):
        with raises(ValueError, match="iters", what="time_fn(iters=0)", section=section):
            _reject(0, ValueError, "bad value")


def test_raises_lets_a_stub_through() -> None:
    with pytest.raises(NotImplementedError, match="Problem 1.1"):
        with raises(ValueError, match="iters", what="time_fn(iters=0)", section="handout 01 §2"):
            raise NotImplementedError("Problem 1.1: implement time_fn")


def test_raises_turns_a_stub_met_on_a_rank_into_not_implemented() -> None:
    error = RankFailedError("rank 1 of 2 failed: NotImplementedError: verify_same_model: compare the replicas")
    error.rank, error.error_type = 1, "NotImplementedError"
    with pytest.raises(NotImplementedError, match="^rank 1 of 2 failed: NotImplementedError: verify_same_model"):
        with raises(RankFailedError, match="fc2", what="NaiveDDP(different models)", section="handout 04 §1"):
            raise error
