"""Comparisons whose failure messages teach.

A failing check names the quantity, the tolerance, the worst element and where it is, and the
handout section to reread — so a student learns from the message instead of from a stack trace.
"""

from __future__ import annotations

import re
from types import TracebackType

import torch

__all__ = ["assert_close", "assert_equal", "assert_raised", "raises"]

# pytest hides this module's frames: a failing comparison shows the test's line and this message, not our source.
__tracebackhide__ = True


def _fmt_index(flat_index: int, shape: torch.Size) -> str:
    if len(shape) == 0:
        return "()"
    idx = []
    for dim in reversed(shape):
        idx.append(flat_index % dim)
        flat_index //= dim
    return "(" + ", ".join(str(i) for i in reversed(idx)) + ")"


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    name: str,
    section: str,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    check_dtype: bool = False,
    allowance: torch.Tensor | None = None,
    allowance_why: str = "",
) -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected| (+ allowance)`` elementwise, explaining any failure.

    Args:
        actual: the implementation's tensor.
        expected: the trusted value (usually computed in float64).
        name: the quantity, e.g. ``"dQ"`` or ``"rank 1 parameter fc1.weight after step 3"``.
        section: the handout section that explains the quantity, e.g. ``"handout/03 §3.4"``.
        allowance: an element-wise bound added to the tolerance (shape of ``expected``), where the error model gives
            each element its own (AdamW's update of an element whose gradient is near its rounding error);
            ``allowance_why`` names it in the message.
    """
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{name}: expected a torch.Tensor, got {type(actual).__name__}. See {section}.")
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} but expected {tuple(expected.shape)}. See {section}."
        )
    if check_dtype and actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype} but expected {expected.dtype}. See {section}.")
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.numel() == 0:
        return
    nonfinite = ~torch.isfinite(a) & torch.isfinite(e)
    if nonfinite.any() and a.dim() == 0:
        raise AssertionError(f"{name}: got {a.item()} where {e.item():.6g} was expected. See {section}.")
    if nonfinite.any():
        i = int(nonfinite.flatten().nonzero()[0])
        raise AssertionError(
            f"{name}: {int(nonfinite.sum())} of {a.numel()} elements are inf/nan where the expected value is "
            f"finite; first at index {_fmt_index(i, a.shape)}: got {a.flatten()[i].item()}, expected "
            f"{e.flatten()[i].item():.6g}. See {section}."
        )
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    if allowance is not None:
        bound = bound + allowance.detach().to("cpu", torch.float64)
    excess = torch.where(torch.isfinite(e), err - bound, torch.zeros_like(err))
    if (excess > 0).any() and a.dim() == 0:
        raise AssertionError(
            f"{name}: got {a.item():.6g}, expected {e.item():.6g}: |diff| {err.item():.3g} is more than the allowed "
            f"{bound.item():.3g} (rtol={rtol:g}, atol={atol:g}). See {section}."
        )
    if (excess > 0).any():
        i = int(excess.flatten().argmax())
        n_bad = int((excess > 0).sum())
        raise AssertionError(
            f"{name}: {n_bad} of {a.numel()} elements outside tolerance (rtol={rtol:g}, atol={atol:g}"
            f"{f', plus {allowance_why}' if allowance is not None else ''}). "
            f"Worst at index {_fmt_index(i, a.shape)}: got {a.flatten()[i].item():.6g}, expected "
            f"{e.flatten()[i].item():.6g} (|diff| {err.flatten()[i].item():.3g} > allowed "
            f"{bound.flatten()[i].item():.3g}); max |diff| overall {err.max().item():.3g}. See {section}."
        )


def assert_equal(actual, expected, *, name: str, section: str) -> None:
    """Assert plain equality of Python values with a message in the same style as :func:`assert_close`."""
    if actual != expected:
        raise AssertionError(f"{name}: got {actual!r}, expected {expected!r}. See {section}.")


class raises:
    """``with raises(ValueError, match="iters", what="time_fn(iters=0)", section="handout 01 §2"):`` — a teaching
    ``pytest.raises``.

    Where ``pytest.raises`` shows a bare traceback, this says what should have been rejected and how:
    "time_fn(iters=0): expected ValueError naming 'iters', got TypeError: …", or "... returned without
    raising". ``expected`` may be a tuple, e.g. ``(ValueError, TypeError)`` where the handout asks for
    "an error naming the argument" without a type. ``match`` is searched (``re.search``) in the message.
    A ``NotImplementedError`` that is not expected passes through: the stub is not written yet (so does a
    ``RankFailedError`` whose rank raised one, as a ``NotImplementedError``).
    ``hint`` is added to every failure message. After the block, ``.value`` is the exception raised.
    """

    def __init__(self, expected: type[BaseException] | tuple[type[BaseException], ...], match: str | None = None,
                 *, what: str, section: str, hint: str = "") -> None:
        self.expected = expected if isinstance(expected, tuple) else (expected,)
        self.match, self.what, self.section, self.hint = match, what, section, hint
        self.value: BaseException | None = None

    def _wanted(self) -> str:
        names = " or ".join(t.__name__ for t in self.expected)
        return names + (f" naming {self.match!r}" if self.match else "")

    def _fail(self, problem: str) -> AssertionError:
        hint = f" {self.hint}" if self.hint else ""
        return AssertionError(f"{self.what}: {problem}.{hint} See {self.section}.")

    def __enter__(self) -> raises:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if exc is None:
            raise self._fail(f"returned without raising; expected {self._wanted()}")
        expected = isinstance(exc, self.expected)
        matches = self.match is None or re.search(self.match, str(exc))
        if not expected and (isinstance(exc, NotImplementedError) or not isinstance(exc, Exception)):
            return False  # a stub, or KeyboardInterrupt: let it through as it is
        if not (expected and matches) and getattr(exc, "error_type", None) == "NotImplementedError":
            raise NotImplementedError(str(exc)) from None  # a stub, met on another rank (kit.spawn)
        if not expected:
            raise self._fail(f"expected {self._wanted()}, got {type(exc).__name__}: {exc}") from exc
        if not matches:
            raise self._fail(f"raised {type(exc).__name__} as expected, but its message does not name "
                             f"{self.match!r}: {str(exc)!r}") from exc
        self.value = exc
        return True


def assert_raised(outcome: dict, expected: type[BaseException] | tuple[type[BaseException], ...],
                  match: str | None = None, *, what: str, section: str, hint: str = "") -> None:
    """:class:`raises` for a call made in a worker: ``outcome`` is what :func:`kit.checks.outcome_of` recorded
    there (``{"raised", "mro", "message"}`` or ``{"returned"}``), checked here with the same messages."""
    expected = expected if isinstance(expected, tuple) else (expected,)
    names = " or ".join(t.__name__ for t in expected)
    wanted = names + (f" naming {match!r}" if match else "")
    extra = f" {hint}" if hint else ""
    if not isinstance(outcome, dict) or "raised" not in outcome:
        raise AssertionError(f"{what}: returned without raising; expected {wanted}.{extra} See {section}.")
    kind, message = str(outcome.get("raised")), str(outcome.get("message", ""))
    mro = outcome.get("mro") if isinstance(outcome.get("mro"), list) else [kind]
    if not any(t.__name__ in mro for t in expected):
        raise AssertionError(f"{what}: expected {wanted}, got {kind}: {message}.{extra} See {section}.")
    if match is not None and not re.search(match, message):
        raise AssertionError(f"{what}: raised {kind} as expected, but its message does not name {match!r}: "
                             f"{message!r}.{extra} See {section}.")
