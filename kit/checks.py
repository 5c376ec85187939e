"""The one way a test runs the implementation: named checks in worker processes, data back, verdict here.

The process that runs pytest — the **judge** — never imports, unpickles or calls the code under test.
A test hands a module-level function (a *check*) to a **worker**; the worker imports the implementation
(``kit.impl.load()``), calls it, and returns **data**: tensors, numbers, strings, lists and dicts of them
(:mod:`kit.spawn.wire`, read without running any code). The judge then computes what that data must be —
float64 maths, torch's own DDP, single-process training — and compares. A check never decides a test:
anything a worker says is evidence for the judge, and a failure it raises only ever fails the test.

Single-process checks run in one warm worker kept for the session (:meth:`Worker.call`)::

    def _attention(q, k, v):                  # runs in the worker: module level, so it is found by name
        return kit.impl.load().benchmarking.annotated_scaled_dot_product_attention(q, k, v)

    def test_attention(worker):               # runs in the judge
        out = worker.call(_attention, q, k, v)
        assert_close(out, attention_float64(q, k, v), name="attention output", section="handout 01 §3")

Distributed checks run on N ranks (forked warm, see :mod:`kit.spawn`). Spawning costs a little, so a
test module may run several checks in one spawn and each test reads its own::

    def _rank_checks() -> dict:               # runs on every rank
        impl = kit.impl.load()
        return run_checks({"forward": lambda: forward(impl), "backward": lambda: backward(impl)})

    ranks = spawned_checks(_rank_checks, world_size=2, timeout=90)   # a module-scoped pytest fixture

    def test_forward(ranks):                  # spawned in the setup of the first test using it, once per module
        for rank, value in enumerate(ranks.values("forward")):
            assert_close(value, expected, name=f"rank {rank}: output", section="handout 06 §2")

``values(name)`` returns the check's value on each rank, or re-raises the failure of the rank that failed
first, the same way in every stage: ``NotImplementedError`` (a stub) as ``NotImplementedError``,
``AssertionError`` as ``AssertionError``, anything else as :class:`RankCheckError` naming its type. The
message starts with the rank's own message, then ``rank r, check 'name'``, then its traceback without
the kit's frames. A crash or hang of the whole spawn fails the tests of the checks it cut short (those
that finished on every rank keep their values) and names the check where it stopped and why.

A spawn may take its arguments from another spawn's results: pass ``args`` a function whose parameters
name the fixtures it needs (``args=lambda two_ranks: (two_ranks.value_or_failure("checkpoint", rank=0),)``);
a :class:`Failure` passed on this way is re-raised in the rank with :meth:`Failure.reraise`. For one check
per spawn (each test its own spawn, so a hang costs one test), use :func:`run_check`.

Bad input is checked the same way: the worker records what a call did (:func:`outcome_of`) and the judge
checks it (:func:`kit.testing.assert_raised`).

Writing a test: the contract (stated here once; CONTRIBUTING.md's checklist links to it)
----------------------------------------------------------------------------------------

* **The judge never touches the implementation.** A graded test takes the ``worker`` fixture, a spawned-checks
  fixture or :func:`run_check`, never ``impl`` (``tests/conftest.py`` refuses a graded test that asks for it);
  while grading, importing ``student`` or ``reference`` in the judge fails. Checks are module-level functions,
  found by name.
* **Return what the judge compares, not a verdict**, as data (:mod:`kit.spawn.wire`; anything else fails,
  naming the part that is not data): parameters after each step, a ``CommLog``'s events (``log.as_data()``,
  read back with ``kit.comm_log.events_from_data``), the bytes a storage hook saw, objects as their fields
  (``TimingStats`` → ``{"mean": …}``). To observe communication, wrap the code in ``kit.comm_log.CommLog()``:
  every c10d collective (op, bytes, group ranks, ``async_op``), every completion and your own ``log.mark("…")``,
  in order. A check may raise, which only fails the test: **a pass always rests on a comparison the judge makes.**
* **Expected values are computed in the judge**, from the same seeded inputs: float64 maths, a single process
  training the same model, torch's own implementation. Where that reference needs a process group (torch's
  DDP, ``fully_shard``, ``ZeroRedundancyOptimizer``) it runs in :func:`reference_ranks`, ranks that cannot
  load the implementation; never in the implementation's process.
* **Compare worker data by type, dtype and shape before values**: :func:`kit.testing.assert_close` (``name=``,
  ``section="handout 0N §k"``, ``rtol``/``atol`` derived from the computation's error model, said in a
  comment), never ``pytest.approx`` (it passes an empty tensor); check that a number is a float first. The
  message teaches: the quantity, the tolerance, the worst element, the handout section.
* **Files and threads.** A worker writes only under its scratch folder (``tempfile.mkdtemp()``; ``TMPDIR``
  points there), never into pytest's ``tmp_path``, and returns what the judge needs from a file as data. The
  judge, the worker and every rank use one torch thread, so "bit for bit" means bit for bit.
* **Checks come from the checkbook** (:mod:`kit.spawn.checkbook`): a worker resolves each check from a record
  made before submission code ran, so a check must not leave a kit or test function patched (patch the
  implementation's module and restore it, as Stage 1's ``_nvtx_replaced`` does). A test whose judge half only
  reads what a worker recorded draws its inputs in the judge (Stage 1's ``DRAW``) and is counted in
  INSTRUCTOR.md's *Evidence, not verdict*, with its points.
* **Hidden tests** keep their worker half in ``tests/hidden/stage<N>_hidden_worker.py`` (the only part a
  worker can read while grading) and their judge half (expected values, tolerances, messages) in
  ``tests/hidden/test_stage<N>_*.py``, marked ``hidden``.
* **Limits.** A test's workers get a CPU budget from the reference's CPU time in ``tests/timings.json``
  (``make timings``) and an idle limit (:mod:`kit.spawn.watch`); the wall clock is only the last resort, so a
  correct test never depends on a quiet machine. When a limit is met, each worker's Python stack is dumped
  into the failure.
* **Placement.** A test lives in its stage's file (``kit/stages.py``: ``pytest -m stageN`` collects only
  those), with ``pytestmark = pytest.mark.stage<N>`` and ``@pytest.mark.points(n)``; keep ``import torch`` out
  of ``tests/conftest.py``'s top level (the judge imports torch during collection, beside the zygote).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kit import spawn as workers
from kit.setup.portable import NEEDS_TRITON, triton_missing_error
from kit.spawn import (
    RankFailedError,
    RankTimeoutError,
    error_report,
    in_rank,
    in_worker,
    limit_message,
    peers_stopped,
    raise_for,
    report_check,
    silent_death,
    user_stops,
    wire,
)

__all__ = ["Failure", "RankCheckError", "SpawnedChecks", "Worker", "outcome_of", "reference_ranks", "run_check",
           "run_checks", "spawned_checks"]

__tracebackhide__ = True  # pytest: the harness is not part of a student's traceback

# In a rank: the store its checks meet at between checks (created on first use in each spawn).
_HARNESS: dict[str, Any] = {}


class RankCheckError(Exception):
    """A check raised something other than an assertion or ``NotImplementedError``; the message names its type."""


@dataclass(frozen=True)
class Failure:
    """How one check failed in one worker (``rank`` -1: the single-process worker). Built by the judge from
    the worker's report (strings only); picklable, so it can be handed to a dependent spawn."""

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
    def from_report(cls, check: str, rank: int, report: Any) -> Failure:
        """From a worker's report (untrusted: every field is checked for its type)."""
        report = report if isinstance(report, dict) else {}
        kind = wire.field(report, "kind", str, "error")
        return cls(check, rank, wire.field(report, "type", str, "Error"),
                   kind if kind in ("not_implemented", "assertion", "error") else "error",
                   wire.field(report, "message", str, ""), wire.field(report, "traceback", str, ""))

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
            who = f"rank {self.rank}" if self.rank >= 0 else "the worker"
            text += f"\nTraceback of {who} (most recent call last):\n{self.traceback.rstrip()}"
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
# Inside the workers
# ----------------------------------------------------------------------------------------------------


def run_checks(checks: Mapping[str, Callable[[], Any]]) -> dict[str, bool]:
    """Run each named check on this rank; send each one's value or failure to the judge as soon as it is
    known (a later hang or crash keeps it). Returns ``{name: passed}``.

    The ranks wait for each other after every check, so a rank whose check failed early cannot run ahead
    into the next check's collectives while the others are still in this one.
    """
    import torch.distributed as dist

    done: dict[str, bool] = {}
    for name, check in checks.items():
        try:
            value = wire.normalise(check(), f"check {name!r} returned a value whose part")
            report_check(name, True, value)
            done[name] = True
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 — pytest.fail raises a BaseException too
            if isinstance(exc, user_stops()):  # quitting the debugger (pytest --inline): not the check's failure
                raise
            report_check(name, False, error_report(exc))
            done[name] = False
        if in_rank() and dist.is_available() and dist.is_initialized():
            _wait_for_the_other_ranks()
    return done


def _wait_for_the_other_ranks() -> None:
    # Through a store, not a collective: a collective here could pair up with one that a peer is still
    # blocked in, and gloo would then mix up the two. A peer that never comes makes the spawn time out.
    import datetime
    import os

    import torch.distributed as dist

    folder = os.environ["KIT_RANK_FOLDER"]
    if _HARNESS.get("folder") != folder:  # this spawn's first wait (a judge running rank 0 inline sees many spawns)
        _HARNESS.clear()
        _HARNESS.update(folder=folder, store=dist.FileStore(f"{folder}/steps", dist.get_world_size()))
    store, step = _HARNESS["store"], f"step{_HARNESS.setdefault('steps', 0)}"
    _HARNESS["steps"] += 1
    if store.add(step, 1) == dist.get_world_size():
        store.set(f"{step}/all", "1")
    if in_worker():
        store.wait([f"{step}/all"], datetime.timedelta(days=1))
        return
    while True:  # rank 0 inline (pytest --inline), where no judge stops a wait for ranks that are gone
        try:
            store.wait([f"{step}/all"], datetime.timedelta(seconds=1))
            return
        except RuntimeError:
            if peers_stopped.is_set():
                raise RuntimeError("the other ranks stopped (one failed or died) while rank 0 waited for them "
                                   "between checks") from None


def _one_check(fn: Callable[..., Any], args: tuple) -> dict:
    return run_checks({fn.__name__: lambda: fn(*args)})


def outcome_of(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict:
    """In a worker: what calling ``fn`` did, as data for :func:`kit.testing.assert_raised` in the judge.

    ``{"raised": type name, "mro": [its classes' names], "message": str}`` if it raised, else
    ``{"returned": type name}``. A stub's ``NotImplementedError`` is not an outcome: it propagates, so the
    test reports the stub.
    """
    try:
        value = fn(*args, **kwargs)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 — what it raised is the outcome
        try:
            message = str(exc)
        except Exception:  # noqa: BLE001
            message = repr(exc)
        return {"raised": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "message": message}
    return {"returned": type(value).__name__}


# ----------------------------------------------------------------------------------------------------
# In the judge
# ----------------------------------------------------------------------------------------------------


def skip_if_triton_missing(type_name: str, message: str) -> None:
    """On a machine without Triton (macOS, Windows), a check that failed because it needed Triton skips its test,
    saying so (:data:`kit.setup.portable.NEEDS_TRITON`), instead of failing it with an import error."""
    if triton_missing_error(type_name, message):
        import pytest

        pytest.skip(NEEDS_TRITON)


class Worker:
    """The session's single-process worker, as a test sees it (the ``worker`` fixture)."""

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` in the worker and return its value (data), or raise its failure as
        :class:`SpawnedChecks.values` does (a stub as ``NotImplementedError``, …). ``fn`` is a module-level
        function; the arguments are pickled into the worker."""
        return self.call_within(None, fn, *args, **kwargs)

    def call_within(self, timeout: float | None, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """:meth:`call` with ``timeout`` seconds of wall clock as the last resort (default 600)."""
        name = getattr(fn, "__name__", repr(fn))
        limit = 600.0 if timeout is None else timeout
        outcome = workers.call(fn, args, kwargs, timeout=limit)
        if outcome.limit:
            raise RankTimeoutError(limit_message(outcome, f"check {name!r}", limit))
        if outcome.died:
            report = silent_death(outcome, 0)
            raise RankCheckError(f"the worker running check {name!r} {report['message']}. A crash in native code "
                                 "(a segmentation fault), os._exit, or the memory limit.")
        final = outcome.finals[0]
        if final.get("ok") is True:
            return final.get("value")
        failure = Failure.from_report(name, -1, final.get("failure"))
        skip_if_triton_missing(failure.type_name, failure.message)
        raise failure.exception() from None

    def import_module(self, name: str, timeout: float) -> str | None:
        """Import module ``name`` in the worker within ``timeout`` s; ``None`` if it imports, else why not."""
        # Its own limits, not a test's: an import spins (CPU) or blocks (idle) for at most ``timeout`` seconds.
        previous = workers.set_allowance(workers.Allowance(cpu=timeout, idle=timeout))
        try:
            outcome = workers.call(name, timeout=10 * timeout, op="import")
        finally:
            workers.set_allowance(previous)
        if outcome.limit:
            return (f"importing {name} did not finish: it " + limit_message(outcome, "", timeout).strip()
                    + "\nA module must import in seconds: keep the work inside functions.")
        if outcome.died:
            return f"the worker died while importing {name} (exit code {outcome.died[0]})"
        final = outcome.finals[0]
        if final.get("ok") is True:
            return None
        failure = Failure.from_report(name, -1, final.get("failure"))
        return f"{name} failed to import:\n{failure.traceback}{failure.type_name}: {failure.message}"[-4000:]


class SpawnedChecks:
    """One spawn of ``fn`` (which returns :func:`run_checks`' result), run once and cached: by :meth:`start` (the
    fixture of :func:`spawned_checks` calls it) or else at the first :meth:`values`."""

    def __init__(self, fn: Callable[..., dict], world_size: int, *, args: tuple | Callable[[], tuple] = (),
                 timeout: float = 120.0, backend: str | None = "gloo") -> None:
        self.fn, self.world_size, self.args, self.timeout, self.backend = fn, world_size, args, timeout, backend
        self._outcomes: list[dict[str, tuple[bool, Any]]] | None = None
        self._error: BaseException | None = None  # what ended the spawn early, if anything did

    def _run(self) -> list[dict[str, tuple[bool, Any]]]:
        if self._outcomes is None:
            args = self.args() if callable(self.args) else tuple(self.args)
            outcome = workers.spawn(self.fn, self.world_size, self.backend or "gloo", args, {}, self.timeout)
            self._outcomes = [
                {name: (ok, payload if ok else Failure.from_report(name, r, payload))
                 for name, (ok, payload) in outcome.checks[r].items()}
                for r in range(self.world_size)]
            try:
                raise_for(outcome, self.world_size, self.timeout)
                if not all(isinstance(outcome.finals[r].get("value"), dict) for r in range(self.world_size)):
                    raise TypeError(f"{self.fn.__name__} must return run_checks({{...}})'s result")
            except (RankFailedError, RankTimeoutError, TypeError) as exc:  # keep what finished, explain the rest
                self._error = exc
        return self._outcomes

    def start(self) -> None:
        """Spawn now (once). What fails here fails again, the same way, in :meth:`values`."""
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 — values() raises it where a test can report it
            if isinstance(exc, user_stops()):  # quitting the debugger (pytest --inline) ends the session
                raise

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
            skip_if_triton_missing(first.type_name, first.message)
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
        skip_if_triton_missing(str(getattr(self._error, "error_type", None) or ""), str(self._error))
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

    The ranks are spawned when the fixture is set up, i.e. in the setup of the first test that uses it, never
    in a test's call: the grader charges a file's largest setup to every test of the file
    (``kit/grading/timings.py``), so whichever test comes first — the reference's first, or a later one when
    an earlier test failed before reaching the fixture — has the spawn's CPU in its budget.
    """
    import pytest

    needs = list(inspect.signature(args).parameters) if callable(args) else []

    @pytest.fixture(scope="module")
    def fixture(request: Any) -> SpawnedChecks:
        deps = {n: request.getfixturevalue(n) for n in needs}
        bound = (lambda: args(**deps)) if callable(args) else args
        checks = SpawnedChecks(fn, world_size, args=bound, timeout=timeout, backend=backend)
        checks.start()
        return checks

    return fixture


def reference_ranks(fn: Callable[..., Any], world_size: int, *, args: tuple = (), timeout: float = 300.0,
                    backend: str | None = "gloo") -> list[Any]:
    """The judge's own distributed computation: ``fn(*args)`` on ``world_size`` ranks that cannot load the
    implementation (torch's DDP, ``fully_shard``, ``ZeroRedundancyOptimizer`` as the expected values). They are
    forked from a zygote of their own, out of the submission's reach. Returns the values by rank; any
    failure is the kit's, raised as :class:`RankFailedError`/:class:`RankTimeoutError`."""
    outcome = workers.spawn(fn, world_size, backend or "gloo", tuple(args), {}, timeout, trusted=True)
    try:
        raise_for(outcome, world_size, timeout)
    except RankFailedError as exc:
        skip_if_triton_missing(str(exc.error_type or ""), str(exc))
        raise
    return [outcome.finals[r].get("value") for r in range(world_size)]


def run_check(fn: Callable[..., Any], world_size: int, *, args: tuple = (), timeout: float = 120.0,
              backend: str | None = "gloo") -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks as one check, now; its values, or its failure re-raised.

    The same failure semantics as :meth:`SpawnedChecks.values`, for a test that spawns on its own.
    """
    return SpawnedChecks(_one_check, world_size, args=(fn, tuple(args)), timeout=timeout,
                         backend=backend).values(fn.__name__)
