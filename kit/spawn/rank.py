"""Inside a rank: its device, its process group under torchrun, the gloo interface."""

from __future__ import annotations

import os
import sys
from typing import Any

__tracebackhide__ = True  # pytest: the kit's plumbing is not part of a student's traceback


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


def default_gloo_interface() -> None:
    # gloo binds to the interface its hostname resolves to; in containers that is often unreachable.
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        if os.path.exists("/sys/class/net/lo"):
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        elif sys.platform == "darwin":
            os.environ["GLOO_SOCKET_IFNAME"] = "lo0"


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Join the process group when launched by ``torchrun`` (reads RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    Returns ``(rank, world_size)``. Sets one thread per rank on CPU and the CUDA device under NCCL.
    :mod:`kit.launch` does the work: it checks the launcher's environment first and bounds the rendezvous.

    Raises:
        kit.launch.LaunchError: no launcher started this process, or it started it wrongly (the message says how).
    """
    import torch.distributed as dist

    from kit.launch import HOW_TO_LAUNCH, LaunchError, join, launched

    if not dist.is_initialized():
        launch = launched()
        if launch is None:
            raise LaunchError(f"init_distributed: no launcher started this process (no $RANK, $WORLD_SIZE): "
                              f"{HOW_TO_LAUNCH}")
        join(launch, backend)
    return dist.get_rank(), dist.get_world_size()
