"""LLM Systems Lab — the given code that ships with the assignment.

Importing ``kit`` before ``triton`` matters on machines without CUDA: Triton kernels then run
through the Triton interpreter (``TRITON_INTERPRET=1``), which must be set before triton is imported.
"""

from __future__ import annotations

import os


def _cuda_present() -> bool:
    # Cheap check that does not import torch: CUDA_VISIBLE_DEVICES="" or no driver means no GPU.
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg"))


if "TRITON_INTERPRET" not in os.environ and not _cuda_present():
    os.environ["TRITON_INTERPRET"] = "1"

__all__ = ["triton_interpreted"]


def triton_interpreted() -> bool:
    """True when Triton kernels run through the Python interpreter instead of being compiled."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
