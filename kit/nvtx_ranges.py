"""NVTX ranges that work whether or not the ``nvtx`` package is installed.

``from kit.nvtx_ranges import nvtx`` gives the ``nvtx`` package when it is installed, and otherwise a
stand-in with the same ``nvtx.annotate(name)`` (a context manager and a decorator) whose ranges go
through ``torch.cuda.nvtx`` on a CUDA machine — Nsight Systems shows them the same way — and do
nothing without CUDA. So a GPU machine that lacks the package (and cannot install it) still runs
Stage 1 and still labels its timelines. :data:`BACKEND` says which one is in use (``kit doctor`` prints it).
"""

from __future__ import annotations

from contextlib import ContextDecorator
from types import SimpleNamespace

__all__ = ["BACKEND", "annotate", "nvtx"]


class annotate(ContextDecorator):  # noqa: N801 — the nvtx package's name
    """``with annotate("forward"):`` opens an NVTX range named ``message`` on the current CUDA device
    (``torch.cuda.nvtx.range_push``/``range_pop``); without CUDA it does nothing. ``color``, ``domain``
    and the other keywords of ``nvtx.annotate`` are accepted and ignored."""

    def __init__(self, message: str | None = None, color: str | None = None, domain: str | None = None,
                 **kwargs) -> None:
        self.message = message or ""
        self._pushed: list[bool] = []

    def __enter__(self) -> annotate:
        import torch

        pushed = torch.cuda.is_available()
        if pushed:
            torch.cuda.nvtx.range_push(self.message)
        self._pushed.append(pushed)
        return self

    def __exit__(self, *exc) -> bool:
        if self._pushed.pop():
            import torch

            torch.cuda.nvtx.range_pop()
        return False


try:
    import nvtx  # the NVIDIA package: ranges in any process, CUDA or not

    BACKEND = f"nvtx package {getattr(nvtx, '__version__', '')}".strip()
except ImportError:
    nvtx = SimpleNamespace(annotate=annotate)
    BACKEND = "torch.cuda.nvtx (the nvtx package is not installed)"
