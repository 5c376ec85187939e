"""LLM Systems Lab — the given code that ships with the assignment.

Importing ``kit`` before ``triton`` matters on machines without CUDA: Triton kernels then run
through the Triton interpreter (``TRITON_INTERPRET=1``), which must be set before triton is imported.
"""

from __future__ import annotations

import os

__all__ = ["cuda_present", "triton_interpreted"]


def cuda_present() -> bool:
    """Whether a CUDA device may be usable, without importing torch (this module must stay torch-free).

    ``CUDA_VISIBLE_DEVICES`` set to ``""`` or ``-1`` hides every device; otherwise a driver device node
    (``/dev/nvidia0``, ``/dev/nvidiactl``, or ``/dev/dxg`` under WSL) means a GPU is there.
    """
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg"))


if os.environ.get("LLMSYS_FORCE_NO_TRITON") == "1":  # the kit's own tests of a machine without Triton
    from kit.setup.portable import hide_triton

    hide_triton()

if "TRITON_INTERPRET" not in os.environ and not cuda_present():
    os.environ["TRITON_INTERPRET"] = "1"


def triton_interpreted() -> bool:
    """True when Triton kernels run through the Python interpreter instead of being compiled."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
