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
  :class:`RankFailedError` carries that rank's traceback. If the ranks run past ``timeout`` seconds,
  each live rank's Python stack is dumped (faulthandler), the ranks are killed and
  :class:`RankTimeoutError` shows where each was stuck. On Linux a rank also dies with its parent.

``fn`` must be importable by name (a module-level function) and its arguments and return value picklable;
return CPU tensors or plain Python values. Inside ``fn``, use ``torch.distributed`` as usual and
:func:`rank_device` for the rank's device.
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "RankFailedError",
    "RankTimeoutError",
    "init_distributed",
    "rank_device",
    "run_on_ranks",
]


class RankFailedError(RuntimeError):
    """A rank raised; the message holds its traceback."""


class RankTimeoutError(RuntimeError):
    """The ranks ran past the timeout; the message holds where each live rank was stuck."""


def default_backend(world_size: int) -> str:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def rank_device() -> Any:
    """The ``torch.device`` this rank should compute on: its own GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG = 1: the kernel sends SIGKILL to this rank when its parent exits, however it exits.
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
        except OSError:
            pass


def _default_gloo_interface() -> None:
    # gloo binds to the interface its hostname resolves to; in containers that is often unreachable.
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        if os.path.exists("/sys/class/net/lo"):
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        elif sys.platform == "darwin":
            os.environ["GLOO_SOCKET_IFNAME"] = "lo0"


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Join the process group when launched by ``torchrun`` (reads RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    Returns ``(rank, world_size)``. Sets one thread per rank on CPU and the CUDA device under NCCL.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        backend = backend or default_backend(world_size)
        if backend == "gloo":
            _default_gloo_interface()
            torch.set_num_threads(1)
        else:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    stack_path: str,
    args: tuple,
    kwargs: dict,
    results: Any,
    pg_timeout_s: float,
) -> None:
    _die_with_parent()
    stack_file = open(stack_path, "w")  # noqa: SIM115 — must stay open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:
            _default_gloo_interface()
        dist.init_process_group(
            backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        value = fn(*args, **kwargs)
        # Plain pickle copies tensors by value. The queue's own pickler would send shared-memory handles,
        # which vanish when this rank exits before the parent reads them.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as exc:  # report everything, including KeyboardInterrupt and SystemExit
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        results.put((rank, "error", tb))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _stop(procs: Sequence[mp.process.BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1)


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
        RankFailedError: a rank raised; the message has the traceback of the first rank that failed.
        RankTimeoutError: the ranks did not finish in time; the message has their stacks.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    backend = backend or default_backend(world_size)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    kwargs = kwargs or {}

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="kit-ranks-") as tmp:
        store_path = str(Path(tmp) / "store")
        stack_paths = [str(Path(tmp) / f"stack-{r}.txt") for r in range(world_size)]
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, r, world_size, backend, store_path, stack_paths[r], args, kwargs, results, timeout),
                name=f"rank{r}",
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}  # in order of arrival
        deadline = time.monotonic() + timeout
        try:
            while len(values) + len(errors) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    rank, status, payload = results.get(timeout=min(remaining, 0.2))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)]
                    dead = [r for r in dead if r not in values and r not in errors]
                    if dead:
                        # A rank killed by a signal or os._exit never reports; say so instead of waiting.
                        time.sleep(0.2)  # let a report that is still in the pipe arrive
                        while not results.empty():
                            rank, status, payload = results.get()
                            (values if status == "ok" else errors)[rank] = payload
                        for r in dead:
                            if r not in values and r not in errors:
                                errors[r] = f"rank {r} exited with code {procs[r].exitcode} without reporting"
                        break
                    continue
                (values if status == "ok" else errors)[rank] = payload
                if status == "error":
                    # Give the others a moment to report their own errors, then stop them.
                    grace = time.monotonic() + 1.0
                    while len(values) + len(errors) < world_size and time.monotonic() < grace:
                        try:
                            rank, status, payload = results.get(timeout=0.1)
                            (values if status == "ok" else errors)[rank] = payload
                        except queue.Empty:
                            pass
                    break
            # A rank that died without reporting (os._exit, a signal, the OOM killer) caused whatever its
            # peers then reported, so it leads.
            time.sleep(0.1)
            silent = [
                r for r, p in enumerate(procs)
                if r not in values and r not in errors and not p.is_alive() and p.exitcode not in (0, None)
            ]
            if silent:
                errors = {
                    **{r: f"rank {r} exited with code {procs[r].exitcode} without reporting" for r in silent},
                    **errors,
                }
            if errors:
                # The first error to arrive is the cause; later ones are usually peers losing their connection.
                first = next(iter(errors))
                others = [r for r in errors if r != first]
                raise RankFailedError(
                    f"rank {first} of {world_size} failed"
                    + (f" (then ranks {others}, most likely as a consequence)" if others else "")
                    + f":\n{errors[first]}"
                )
            if len(values) < world_size:
                missing = [r for r in range(world_size) if r not in values]
                for r in missing:
                    if procs[r].is_alive() and procs[r].pid is not None:
                        os.kill(procs[r].pid, signal.SIGUSR1)
                time.sleep(0.5)
                stacks = []
                for r in missing:
                    text = Path(stack_paths[r]).read_text() if os.path.exists(stack_paths[r]) else ""
                    stacks.append(f"--- rank {r} ---\n{text.strip() or '(no stack: the rank had not started)'}")
                raise RankTimeoutError(
                    f"ranks {missing} of {world_size} did not finish within {timeout:g} s "
                    "(a collective that not every rank joined, or too small a timeout). Stacks:\n"
                    + "\n".join(stacks)
                )
        finally:
            _stop(procs)
            results.close()
    return [pickle.loads(values[r]) for r in range(world_size)]
