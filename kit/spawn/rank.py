"""Inside a rank: its backend, its device, the gloo interface. (A torchrun rank joins through :mod:`kit.launch`.)"""

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
