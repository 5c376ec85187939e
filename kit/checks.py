"""Several checks in one spawn, each re-raised in its own test: the harness of the distributed tests.

Spawning ranks costs seconds, so a test module runs its distributed checks in one spawn and each test
reads its own. One broken piece does not hide the others:

    def _rank_checks() -> dict:                      # runs on every rank; module level, so ranks import it
        impl = kit.impl.load()
        return run_checks({"forward": lambda: forward(impl), "backward": lambda: backward(impl)})

    ranks = spawned_checks(_rank_checks, world_size=2, timeout=90)   # a module-scoped pytest fixture

    def test_forward(ranks):
        for rank, value in enumerate(ranks.values("forward")):   # spawns on first use, once per module
            assert_close(value, expected, name=f"rank {rank}: output", section="handout 06 §2")

``values(name)`` returns the check's value on each rank, or re-raises the failure of the rank that failed
first, the same way in every stage: ``NotImplementedError`` (a stub) as ``NotImplementedError``,
``AssertionError`` as ``AssertionError``, anything else as :class:`RankCheckError` naming its type. The
message starts with the rank's own message, then ``rank r, check 'name'``, then its traceback without
the kit's frames. A crash or hang of the whole spawn fails the tests of the checks it cut short (those
that finished on every rank keep their values) and names the check where it stopped and why.

A spawn may take its arguments from another spawn's results: pass ``args`` a function whose parameters
name the fixtures it needs (``args=lambda two_ranks: (two_ranks.value_or_failure("checkpoint", rank=0),)``);
a :class:`Failure` passed on this way is re-raised in the rank with :meth:`Failure.reraise`.

For one check per spawn (each test its own spawn, so a hang costs one test), use :func:`run_check`.
"""

from __future__ import annotations

import inspect
import pickle
import tempfile
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kit.spawn import RankFailedError, RankTimeoutError, run_on_ranks
from kit.spawn.rank import error_report

__all__ = ["Failure", "RankCheckError", "SpawnedChecks", "run_check", "run_checks", "spawned_checks"]

__tracebackhide__ = True  # pytest: the harness is not part of a student's traceback

# In a rank under spawned_checks: the folder where each finished check is recorded, and the step store.
_HARNESS: dict[str, Any] = {}


class RankCheckError(Exception):
    """A check raised something other than an assertion or ``NotImplementedError``; the message names its type."""


@dataclass(frozen=True)
class Failure:
    """How one check failed on one rank. Picklable: it travels back from the rank and into other spawns."""

    check: str
    rank: int
    type_name: str  # e.g. "TypeError"
    kind: str  # "not_implemented", "assertion" or "error": what it becomes in the test
    message: str
    traceback: str  # without the kit's own frames

    @classmethod
    def of_spawn(cls, check: str, exc: BaseException) -> Failure:
        """The failure of a check that a crash or hang of the whole spawn cut short."""
        return cls(check, -1, type(exc).__name__, "error", str(exc), "")

    @classmethod
    def capture(cls, check: str, rank: int, exc: BaseException) -> Failure:
        report = error_report(exc)
        kind = ("not_implemented" if isinstance(exc, NotImplementedError)
                else "assertion" if isinstance(exc, AssertionError) or report["type"] == "Failed"  # pytest.fail
                else "error")
        message, frames = report["message"], traceback.extract_tb(exc.__traceback__)
        if not message and frames:  # a bare `assert x`: quote the line instead
            last = frames[-1]
            message = f"{report['type']} at {Path(last.filename).name}:{last.lineno}: {last.line}"
        return cls(check, rank, report["type"], kind, message, report["traceback"])

    @property
    def headline(self) -> str:
        """The first line of its own message, with the exception type where the kind does not say it."""
        first = (self.message.splitlines() or [""])[0]
        return first if self.kind != "error" else f"{self.type_name}: {first}"

    def describe(self, note: str = "") -> str:
        """Its own message first, then where it happened, ``note``, and the traceback."""
        own = self.message if self.kind != "error" else f"{self.type_name}: {self.message}"
        where = f"rank {self.rank}, check {self.check!r}" if self.rank >= 0 else f"check {self.check!r}"
        text = f"{own}\n({where}{'; ' + note if note else ''})"
        if self.traceback:
            text += f"\nTraceback of rank {self.rank} (most recent call last):\n{self.traceback.rstrip()}"
        return text

    def exception(self, note: str = "", prefix: str = "") -> BaseException:
        """The exception a test (or a dependent check) raises for this failure, of the same kind."""
        text = prefix + self.describe(note)
        if self.kind == "not_implemented":
            return NotImplementedError(text)
        if self.kind == "assertion":
            return AssertionError(text)
        return RankCheckError(text)

    def reraise(self, why: str) -> None:
        """In a dependent check: fail with the same kind of error, saying ``why`` and quoting this cause."""
        raise self.exception(prefix=f"{why}, because that failed:\n")


# ----------------------------------------------------------------------------------------------------
# Inside the ranks
# ----------------------------------------------------------------------------------------------------


def run_checks(checks: Mapping[str, Callable[[], Any]]) -> dict[str, tuple[bool, Any]]:
    """Run each named check on this rank; keep ``(True, value)`` or ``(False, Failure)`` for each.

    Under :func:`spawned_checks`, each outcome is written down as soon as it is known (a later hang or
    crash keeps it), and the ranks wait for each other after every check, so a rank whose check failed
    early cannot run ahead into the next check's collectives while the others are still in this one.
    """
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    outcomes: dict[str, tuple[bool, Any]] = {}
    for name, check in checks.items():
        try:
            outcome: tuple[bool, Any] = (True, check())
            record = pickle.dumps((name, outcome)) if _HARNESS else b""  # also proves it can travel back
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # pytest.fail raises a BaseException too
            outcome = (False, Failure.capture(name, rank, exc))
            record = pickle.dumps((name, outcome)) if _HARNESS else b""
        outcomes[name] = outcome
        if _HARNESS:
            with open(Path(_HARNESS["folder"]) / f"rank{rank}", "ab") as f:
                f.write(record)
            _wait_for_the_other_ranks()
    return outcomes


def _wait_for_the_other_ranks() -> None:
    # Through a store, not a collective: a collective here could pair up with one that a peer is still
    # blocked in, and gloo would then mix up the two. A peer that never comes makes the spawn time out.
    import datetime

    import torch.distributed as dist

    if "store" not in _HARNESS:
        _HARNESS["store"] = dist.FileStore(f"{_HARNESS['folder']}/steps", dist.get_world_size())
    store, step = _HARNESS["store"], f"step{_HARNESS.setdefault('steps', 0)}"
    _HARNESS["steps"] += 1
    if store.add(step, 1) == dist.get_world_size():
        store.set(f"{step}/all", "1")
    store.wait([f"{step}/all"], datetime.timedelta(days=1))


def _harnessed(fn: Callable[..., dict], args: tuple, folder: str) -> dict:
    """The rank function :class:`SpawnedChecks` runs: ``fn(*args)``, its outcomes recorded in ``folder``."""
    _HARNESS["folder"] = folder
    return fn(*args)


def _one_check(fn: Callable[..., Any], args: tuple) -> dict:
    return run_checks({fn.__name__: lambda: fn(*args)})


def _read_progress(folder: str, rank: int) -> dict[str, tuple[bool, Any]]:
    path = Path(folder) / f"rank{rank}"
    outcomes: dict[str, tuple[bool, Any]] = {}
    if path.exists():
        with open(path, "rb") as f:
            while True:
                try:
                    name, outcome = pickle.load(f)
                except (EOFError, pickle.UnpicklingError):  # the end, or a record cut short by a kill
                    return outcomes
                outcomes[name] = outcome
    return outcomes


# ----------------------------------------------------------------------------------------------------
# In the test process
# ----------------------------------------------------------------------------------------------------


class SpawnedChecks:
    """One spawn of ``fn`` (which returns :func:`run_checks`' result), run on first use and cached."""

    def __init__(self, fn: Callable[..., dict], world_size: int, *, args: tuple | Callable[[], tuple] = (),
                 timeout: float = 120.0, backend: str | None = "gloo") -> None:
        self.fn, self.world_size, self.args, self.timeout, self.backend = fn, world_size, args, timeout, backend
        self._outcomes: list[dict[str, tuple[bool, Any]]] | None = None
        self._error: BaseException | None = None  # what ended the spawn early, if anything did

    def _run(self) -> list[dict[str, tuple[bool, Any]]]:
        if self._outcomes is None:
            with tempfile.TemporaryDirectory(prefix="kit-checks-") as folder:
                try:
                    args = self.args() if callable(self.args) else tuple(self.args)
                    per_rank = run_on_ranks(_harnessed, self.world_size, args=(self.fn, args, folder),
                                            timeout=self.timeout, backend=self.backend)
                    if not all(isinstance(r, dict) for r in per_rank):
                        raise TypeError(f"{self.fn.__name__} must return run_checks({{...}})'s result, got "
                                        f"{type(per_rank[0]).__name__}")
                    self._outcomes = per_rank
                except Exception as exc:  # a crash or a hang: keep what finished, explain the rest
                    self._error = exc
                    self._outcomes = [_read_progress(folder, r) for r in range(self.world_size)]
        return self._outcomes

    def failure(self, name: str) -> Failure | None:
        """The first failure of check ``name`` on any rank, or of the spawn that cut it short; ``None`` if it passed."""
        try:
            self.values(name)
        except Exception as exc:
            failed = [o[name][1] for o in self._run() if name in o and not o[name][0]]
            return failed[0] if failed else Failure.of_spawn(name, exc)
        return None

    def value_or_failure(self, name: str, rank: int) -> Any:
        """Rank ``rank``'s value of check ``name``, or the :class:`Failure` that prevented it."""
        return self.failure(name) or self.values(name)[rank]

    def values(self, name: str) -> list[Any]:
        """The value of check ``name`` on each rank, or the first failing rank's failure re-raised."""
        outcomes = self._run()
        mine = [o.get(name) for o in outcomes]
        failed = [(r, o[1]) for r, o in enumerate(mine) if o is not None and not o[0]]
        unfinished = [r for r, o in enumerate(mine) if o is None]
        if failed:
            # The lowest failing rank speaks for all: the ranks meet after every check, so no rank's failure
            # here is the consequence of another's in an earlier check.
            first = failed[0][1]
            others = [r for r, _ in failed[1:]]
            note = f"ranks {others} failed this check too" if others else ""
            if unfinished:
                note += (f"{'; ' if note else ''}ranks {unfinished} never finished it (most likely waiting in a "
                         f"collective that rank {first.rank} left when it failed)")
            raise first.exception(note) from None
        if not unfinished:
            return [o[1] for o in mine]
        if self._error is None:
            raise KeyError(f"no check named {name!r}; {self.fn.__name__} runs {list(outcomes[0])}")
        raise self._spawn_error(name, unfinished) from None

    def _spawn_error(self, name: str, unfinished: list[int]) -> BaseException:
        """The spawn's own error, saying where it stopped (the check a rank failed while others waited)."""
        error = self._error
        if not isinstance(error, (RankFailedError, RankTimeoutError)):
            return error.with_traceback(None)
        lead = f"check {name!r} did not finish on ranks {unfinished}"
        order = {check: i for o in self._run() for i, check in enumerate(o)}
        failures = [o[check][1] for o in self._run() for check in o if not o[check][0]]
        if failures:
            last = max(failures, key=lambda f: (order[f.check], -f.rank))
            lead += f": the spawn stopped after check {last.check!r} failed on rank {last.rank} ({last.headline})"
        if getattr(error, "error_type", None) == "NotImplementedError":  # a stub, met outside the checks
            return NotImplementedError(f"{lead}. {error}")
        again = type(error)(f"{lead}. {error}")
        again.__dict__.update(error.__dict__)  # RankFailedError's rank and error_type
        return again


def spawned_checks(fn: Callable[..., dict], world_size: int, *, args: tuple | Callable[..., tuple] = (),
                   timeout: float = 120.0, backend: str | None = "gloo") -> Any:
    """A module-scoped pytest fixture giving a :class:`SpawnedChecks` of ``fn`` on ``world_size`` ranks.

    Assign it to the fixture's name: ``ranks8 = spawned_checks(_rank_fn, 8, timeout=110)``. ``args`` is a
    tuple, or a function of other fixtures (named by its parameters) returning one, evaluated at spawn time.
    """
    import pytest

    needs = list(inspect.signature(args).parameters) if callable(args) else []

    @pytest.fixture(scope="module")
    def fixture(request: Any) -> SpawnedChecks:
        deps = {n: request.getfixturevalue(n) for n in needs}
        bound = (lambda: args(**deps)) if callable(args) else args
        return SpawnedChecks(fn, world_size, args=bound, timeout=timeout, backend=backend)

    return fixture


def run_check(fn: Callable[..., Any], world_size: int, *, args: tuple = (), timeout: float = 120.0,
              backend: str | None = "gloo") -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks as one check, now; its values, or its failure re-raised.

    The same failure semantics as :meth:`SpawnedChecks.values`, for a test that spawns on its own.
    """
    return SpawnedChecks(_one_check, world_size, args=(fn, tuple(args)), timeout=timeout,
                         backend=backend).values(fn.__name__)

