"""What runs inside each rank: join the group, run the function, report its value or its error."""

from __future__ import annotations

import ctypes
import faulthandler
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

__tracebackhide__ = True  # pytest: the kit's plumbing is not part of a student's traceback

HERE = Path(__file__).resolve().parent
KIT_PLUMBING = ("checks.py", "testing.py", "comm_log.py")


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


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG = 1: the kernel sends SIGKILL to this rank when its parent exits, however it exits.
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
        except OSError:
            pass


def kit_internal(filename: str) -> bool:
    """True for a frame of the kit's own plumbing (this package, the checks harness, the comparisons)."""
    path = Path(filename).resolve()
    return path.parent == HERE or (path.parent == HERE.parent and path.name in KIT_PLUMBING)


def error_report(exc: BaseException) -> dict[str, str]:
    """``{"type", "message", "traceback"}`` of an exception, its traceback without the kit's own frames."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not kit_internal(f.filename)]
    try:
        message = str(exc)
    except Exception:  # an exception whose __str__ itself fails
        message = repr(exc)
    return {"type": type(exc).__name__, "message": message, "traceback": "".join(traceback.format_list(frames))}


def rank_main(fn: Callable[..., Any], rank: int, world_size: int, backend: str, folder: str, args: tuple,
               kwargs: dict, results: Any, pg_timeout_s: float) -> None:
    _die_with_parent()
    # stderr goes to a file the parent forwards as it grows: when gloo aborts the process, its explanation
    # is there to quote. The stack file must stay open for faulthandler.
    fd = os.open(f"{folder}/stderr-{rank}", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.register(signal.SIGUSR1, file=open(f"{folder}/stack-{rank}", "w"), all_threads=True)  # noqa: SIM115
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
        dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        value = fn(*args, **kwargs)
        # Plain pickle copies tensors by value. The queue's own pickler would send shared-memory handles,
        # which vanish when this rank exits before the parent reads them.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as exc:  # report everything, including KeyboardInterrupt and SystemExit
        results.put((rank, "error", error_report(exc)))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
