"""A student's own machine: the portable path of the harness, and a kit without Triton.

The grader needs Linux: its workers are forked from a warm zygote, confined with Landlock and seccomp, contained in
cgroups and network namespaces, and accounted for through ``/proc`` (:mod:`kit.spawn`). A student's local
``pytest -m stage4`` needs none of that: it is not a sandbox against themselves. So where those are missing — on
macOS, or on Linux with ``LLMSYS_PORTABLE=1``, which CI sets to prove the fallbacks — the harness takes the
**portable path**: each worker is a fresh interpreter (the ``spawn`` start method: no fork of a process that has
imported torch, which macOS does not support), processes are accounted for with psutil, and nothing calls
``prctl``, Landlock, seccomp or reads ``/proc`` by hand. The grader refuses to run there (:func:`grader_refusal`).

Triton publishes Linux wheels only. Without it, the tests that need it (Stage 3's, Stage 7's fused loss) are
skipped with :data:`NEEDS_TRITON` as the reason, never an import error (:func:`triton_missing_error`), and the rest
run. ``LLMSYS_FORCE_NO_TRITON=1`` makes a machine that has Triton behave as one without it (:func:`hide_triton`),
for the kit's own tests.

This module imports nothing but the standard library: ``kit/__init__.py`` imports it before anything else.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys

__all__ = ["NEEDS_TRITON", "PORTABLE_ENV", "FORCE_NO_TRITON_ENV", "grader_refusal", "hide_triton", "portable",
           "triton_available", "triton_missing_error"]

PORTABLE_ENV = "LLMSYS_PORTABLE"
FORCE_NO_TRITON_ENV = "LLMSYS_FORCE_NO_TRITON"
NEEDS_TRITON = "needs Triton (Linux): use the dev container (README, On macOS or Windows)"
# What importing a missing triton says: Python's own message, or a module hidden by hide_triton().
_TRITON_MISSING = re.compile(r"No module named '?triton(?:'|\.)|import of triton(?:\.\w+)* halted")


def portable() -> bool:
    """Whether the harness takes the portable path: not on Linux, or ``LLMSYS_PORTABLE=1``."""
    return not sys.platform.startswith("linux") or os.environ.get(PORTABLE_ENV) == "1"


def hide_triton() -> None:
    """Make ``import triton`` fail as if it were not installed, in this process and (through the environment
    variable, read by ``kit/__init__.py``) in every process it starts that imports the kit. ``None`` in
    ``sys.modules`` is Python's own way: ``import triton`` raises ``ModuleNotFoundError`` and
    ``importlib.util.find_spec("triton")`` returns ``None``, as torch checks for it."""
    if sys.modules.get("triton") is not None:
        return  # already imported: too late to hide it (never the case when kit is imported first)
    sys.modules["triton"] = None  # type: ignore[assignment]


def triton_available() -> bool:
    """Whether ``import triton`` can succeed here (without importing it)."""
    if os.environ.get(FORCE_NO_TRITON_ENV) == "1":
        return False
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def triton_missing_error(type_name: str, message: str) -> bool:
    """Whether a failure (an exception's type name and message, as a worker reports it) is Triton being missing
    on a machine without it: then the test that met it is skipped with :data:`NEEDS_TRITON`, not failed."""
    return (type_name in ("ModuleNotFoundError", "ImportError") and bool(_TRITON_MISSING.search(message))
            and not triton_available())


def grader_refusal() -> str | None:
    """Why this machine cannot grade (``python -m kit grade``, ``autograde``, the grading plugin), or ``None``."""
    if not sys.platform.startswith("linux"):
        return (f"the grader runs on Linux only (this is {sys.platform}): it confines each submission with Linux's "
                "Landlock, seccomp, cgroups and /proc. On macOS, check your work with `.venv/bin/pytest -m stageN` "
                "(the stages without Triton run natively), or run `make grade` in the dev container (README, On "
                "macOS or Windows).")
    if os.environ.get(PORTABLE_ENV) == "1":
        return (f"{PORTABLE_ENV}=1 is set: the portable path is for a student's local pytest run, and the grader "
                "never takes it (its sandbox needs Linux's fork, /proc, prctl, Landlock). Unset it to grade.")
    return None
