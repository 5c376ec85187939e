"""Run a function on N local ranks — the helper behind every distributed test, notebook and benchmark.

    results = run_on_ranks(my_fn, world_size=2, args=(x,), timeout=60)

Each rank is a worker process joined into one ``torch.distributed`` process group:

* **Warm, not fresh.** Ranks are forked from a zygote that imported torch once (:mod:`kit.spawn.zygote`),
  so 8 ranks start in a fraction of a second instead of importing torch 8 times. Each rank is still its
  own process: a rank's state never leaks into the next spawn. (On the portable path — macOS, or
  ``LLMSYS_PORTABLE=1`` — each rank is a fresh interpreter instead: :mod:`kit.spawn.fresh`, :mod:`kit.setup.portable`.)
* **No ports to collide.** Ranks meet through a ``FileStore`` in a private temporary folder; gloo then
  connects them over loopback on ports the operating system picks. Two test runs side by side never race.
* **gloo on CPU, NCCL on GPU.** ``backend=None`` picks NCCL when there are at least ``world_size``
  CUDA devices, else gloo on CPU.
* **One thread per rank.** ``torch.set_num_threads(1)``: N ranks on a 2-core laptop would otherwise
  oversubscribe the cores many times over.
* **Data back, never objects.** A rank's return value travels as data (:mod:`kit.spawn.wire`: tensors,
  numbers, strings, and lists, tuples and dicts of them) and is read without running any code it carries.
* **Nothing hangs, nothing is orphaned.** If a rank raises, the others are stopped and
  :class:`RankFailedError` starts with that rank's own message. A rank that dies without a word (gloo
  aborts the process on a collective mismatch) is reported with the last lines it wrote to stderr, where
  gloo explains. A spawn that stops making progress (no CPU used for a while: a collective no peer joined),
  runs past the current test's CPU budget, or past ``timeout`` seconds of wall clock has each live rank's
  Python stack dumped, its ranks killed, and :class:`RankTimeoutError` says where each was stuck
  (:mod:`kit.spawn.watch`: limits a busy machine does not trip).

``fn`` must be importable by name (a module-level function); its arguments are pickled into the ranks.
Inside ``fn``, use ``torch.distributed`` as usual and :func:`rank_device` for the rank's device.

**The harness's face.** :mod:`kit.checks` (the named checks every test hands its workers) is built on this package
through the names below alone, never its modules' insides: in the judge, :func:`spawn` and :func:`call` (a spawn's
or one worker call's :class:`~kit.spawn.parent.Outcome`, raw), :func:`raise_for`, :func:`limit_message` and
:func:`silent_death` (an outcome explained), :func:`set_allowance` with an :class:`Allowance` (a test's limits);
in a worker, :func:`in_worker`, :func:`in_rank`, :func:`report_check`, :func:`error_report`, :func:`user_stops`
and :data:`peers_stopped`; on both sides :mod:`~kit.spawn.wire` (what may cross, and how it is read).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kit import validate

from . import wire
from .messages import errors_of, failure_message, limit_message, silent_death
from .parent import Allowance, call, set_allowance, spawn
from .rank import default_backend, rank_device
from .worker import error_report, in_rank, in_worker, peers_stopped, report_check, user_stops

__all__ = [
    "RankFailedError",
    "RankTimeoutError",
    "rank_device",
    "run_on_ranks",
    # the harness's face (kit.checks): see the module's docstring
    "Allowance",
    "call",
    "error_report",
    "in_rank",
    "in_worker",
    "limit_message",
    "peers_stopped",
    "raise_for",
    "report_check",
    "set_allowance",
    "silent_death",
    "spawn",
    "user_stops",
    "wire",
]

# pytest hides this package's frames from a failing test's traceback: the message is what matters, and a
# dump of this file's source before it would push the rank's own message off the screen.
__tracebackhide__ = True


class RankFailedError(RuntimeError):
    """A rank raised or died; the message starts with its own error, then its traceback.

    ``rank`` and ``error_type`` name the first failing rank and its exception type (``"RankDied"`` for a
    rank that died without reporting), so a caller can tell a stub's ``NotImplementedError`` apart.
    """

    rank: int | None = None
    error_type: str | None = None


class RankTimeoutError(RuntimeError):
    """The ranks hung or ran away (see the module docstring); the message says where each live rank was."""


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    timeout: float = 120.0,
    backend: str | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks in one process group; return the values by rank.

    Args:
        fn: a module-level function (it is pickled by name into each rank).
        world_size: number of ranks, at least 1.
        timeout: seconds of wall clock for the whole run, the last resort: a spawn that blocks is stopped
            sooner, when it has used no CPU for a while.
        backend: ``"gloo"``, ``"nccl"`` or ``None`` (NCCL when there are enough GPUs, else gloo).

    Raises:
        RankFailedError: a rank raised or died; the message starts with the first failing rank's error.
        RankTimeoutError: the ranks hung or ran away; the message has their stacks.
    """
    validate.callable_arg("fn", fn)
    validate.positive_int("world_size", world_size)
    validate.positive_number("timeout", timeout)
    backend = validate.choice("backend", backend or default_backend(world_size), ("gloo", "nccl"))
    outcome = spawn(fn, world_size, backend, tuple(args), dict(kwargs or {}), timeout)
    raise_for(outcome, world_size, timeout)
    return [outcome.finals[r].get("value") for r in range(world_size)]


def raise_for(outcome: Any, world_size: int, timeout: float) -> None:
    """Raise :class:`RankFailedError` or :class:`RankTimeoutError` for a spawn that did not fully succeed."""
    errors = errors_of(outcome)
    if errors:
        error = RankFailedError(failure_message(world_size, errors))
        error.rank, report = next(iter(errors.items()))
        error.error_type = str(report.get("type"))
        raise error
    if outcome.limit:
        raise RankTimeoutError(limit_message(outcome, f"ranks {sorted(outcome.stacks)} of {world_size}", timeout))
