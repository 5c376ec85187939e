"""Argument checks shared by the kit and the reference: one wording, one rule for every public function.

Each check returns the value (so ``n = positive_int("n", n)`` reads well) or raises an error that names
the argument and says what was expected: ``TypeError`` when the value has the wrong type, ``ValueError``
when it has the right type and a bad value. ``bool`` is not accepted as a number (``True`` is an
``int`` to Python, never a sensible count).

    >>> positive_int("iters", 0)
    Traceback (most recent call last):
    ValueError: iters must be an int ≥ 1, got 0
    >>> positive_int("iters", True)
    Traceback (most recent call last):
    TypeError: iters must be an int, got bool True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import Any, TypeVar

T = TypeVar("T")


def _got(value: Any) -> str:
    return f"got {type(value).__name__} {value!r:.80}"


def integer(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` if it is an ``int`` (not a bool) within ``[minimum, maximum]`` (either bound optional)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, {_got(value)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if maximum is None:
            bounds = f"≥ {minimum}"
        elif minimum is None:
            bounds = f"≤ {maximum}"
        else:
            bounds = f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an int {bounds}, got {value!r}")
    return value


def positive_int(name: str, value: Any) -> int:
    """An ``int`` ≥ 1 (a count, a size, a number of ranks)."""
    return integer(name, value, minimum=1)


def non_negative_int(name: str, value: Any) -> int:
    """An ``int`` ≥ 0 (warm-up iterations, an element count that may be zero)."""
    return integer(name, value, minimum=0)


def index(name: str, value: Any, size: int) -> int:
    """An ``int`` in ``[0, size)``: a position among ``size`` things (a stage, a rank)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int index, {_got(value)}")
    if not 0 <= value < size:
        raise ValueError(f"{name} must be in [0, {size}), got {value!r}")
    return value


def number(name: str, value: Any, *, above: float | None = None, at_least: float | None = None,
           below: float | None = None, finite: bool = True) -> float:
    """A real number (``int`` or ``float``, not a bool) with optional bounds: ``> above``, ``≥ at_least``,
    ``< below``; finite unless ``finite=False``. Returns it as given (an int stays an int)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, {_got(value)}")
    bad = (finite and not math.isfinite(value)) or math.isnan(value)
    bad = bad or (above is not None and not value > above) or (at_least is not None and not value >= at_least)
    bad = bad or (below is not None and not value < below)
    if bad:
        parts = [f"> {above}" if above is not None else "", f"≥ {at_least}" if at_least is not None else "",
                 f"< {below}" if below is not None else ""]
        bounds = " and ".join(p for p in parts if p)
        what = ("a finite number" if finite else "a number") + (f" {bounds}" if bounds else "")
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


def positive_number(name: str, value: Any) -> float:
    """A finite number > 0 (seconds, bytes, a scale factor)."""
    return number(name, value, above=0)


def choice(name: str, value: T, choices: Collection[T]) -> T:
    """One of ``choices`` (``ValueError`` listing them otherwise, whatever the type of ``value``)."""
    try:
        known = value in choices
    except TypeError:  # unhashable value against a dict or set
        known = False
    if not known:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {listed}; got {value!r}")
    return value


def instance(name: str, value: Any, types: type | tuple[type, ...], expected: str) -> Any:
    """``value`` if it is an instance of ``types``; ``TypeError`` saying ``expected`` (e.g. "an nn.Module")."""
    if not isinstance(value, types):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    return value


def callable_arg(name: str, value: Any, *, optional: bool = False) -> Callable | None:
    """A callable (or ``None`` when ``optional``)."""
    if value is None and optional:
        return None
    if not callable(value):
        raise TypeError(f"{name} must be callable{' or None' if optional else ''}, got {type(value).__name__}")
    return value
