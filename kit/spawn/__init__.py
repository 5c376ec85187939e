"""Run a function on N local ranks — the helper behind every distributed test, notebook and benchmark.

    results = run_on_ranks(my_fn, world_size=2, args=(x,), timeout=60)

Each rank is a fresh process (``spawn``), joined into one ``torch.distributed`` process group:

* **No ports to collide.** Ranks meet through a ``FileStore`` in a private temporary folder; gloo then
  connects them over loopback on ports the operating system picks. Two test runs side by side never race.
* **gloo on CPU, NCCL on GPU.** ``backend=None`` picks NCCL when there are at least ``world_size``
  CUDA devices, else gloo on CPU.
* **One thread per rank.** ``torch.set_num_threads(1)``: N ranks on a 2-core laptop would otherwise
  oversubscribe the cores many times over.
* **Nothing hangs, nothing is orphaned.** If a rank raises, the others are stopped and
  :class:`RankFailedError` starts with that rank's own message. A rank that dies without a word (gloo
  aborts the process on a collective mismatch) is reported with the last lines it wrote to stderr, where
  gloo explains. If the ranks run past ``timeout`` seconds, each live rank's Python stack is dumped
  (faulthandler), the ranks are killed and :class:`RankTimeoutError` says where each was stuck. On Linux
  a rank also dies with its parent.

``fn`` must be importable by name (a module-level function) and its arguments and return value picklable;
return CPU tensors or plain Python values. Inside ``fn``, use ``torch.distributed`` as usual and
:func:`rank_device` for the rank's device.
"""

from __future__ import annotations

import pickle
import tempfile
from collections.abc import Callable
from typing import Any

from kit import validate

from .messages import failure_message, silent_death, timeout_message
from .parent import Ranks, collect
from .rank import default_backend, init_distributed, rank_device

__all__ = [
    "RankFailedError",
    "RankTimeoutError",
    "init_distributed",
    "rank_device",
    "run_on_ranks",
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
    """The ranks ran past the timeout; the message says where each live rank was stuck."""


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
        timeout: seconds for the whole run, start-up included (each rank imports torch: ~1 s per rank
            on a 2-core machine). Past it, hung ranks are killed and :class:`RankTimeoutError` raised.
        backend: ``"gloo"``, ``"nccl"`` or ``None`` (NCCL when there are enough GPUs, else gloo).

    Raises:
        RankFailedError: a rank raised or died; the message starts with the first failing rank's error.
        RankTimeoutError: the ranks did not finish in time; the message has their stacks.
    """
    validate.callable_arg("fn", fn)
    validate.positive_int("world_size", world_size)
    validate.positive_number("timeout", timeout)
    backend = validate.choice("backend", backend or default_backend(world_size), ("gloo", "nccl"))

    with tempfile.TemporaryDirectory(prefix="kit-ranks-") as folder:
        ranks = Ranks(fn, world_size, backend, folder, args, kwargs or {}, timeout)
        try:
            ranks.start()
            collect(ranks, timeout)
            # A rank that died without reporting caused whatever its peers then reported, so it leads.
            errors = {**{r: silent_death(ranks, r) for r in ranks.silent()}, **ranks.errors}
            if errors:
                error = RankFailedError(failure_message(world_size, errors))
                error.rank, report = next(iter(errors.items()))
                error.error_type = report["type"]
                raise error
            missing = [r for r in range(world_size) if r not in ranks.values]
            if missing:
                raise RankTimeoutError(timeout_message(world_size, timeout, ranks.dump_stacks(missing)))
        finally:
            ranks.stop()
    return [pickle.loads(ranks.values[r]) for r in range(world_size)]
