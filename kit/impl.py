"""Which implementation the tests, notebooks and benchmarks exercise: ``student`` or ``reference``.

Everything that runs solution code reaches it through :func:`load`, never by importing ``reference``
directly, so one test suite grades either package. The choice comes from, in order: the argument,
the ``LLMSYS_IMPL`` environment variable, then ``student``.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

ENV_VAR = "LLMSYS_IMPL"
CHOICES = ("student", "reference")


def selected(name: str | None = None) -> str:
    """The implementation package name in force (``student`` or ``reference``)."""
    choice = name or os.environ.get(ENV_VAR) or "student"
    if choice not in CHOICES:
        raise ValueError(
            f"implementation must be one of {CHOICES} (argument or ${ENV_VAR}), got {choice!r}. "
            "To grade another folder use `python -m kit grade --impl PATH`, which stages it as `student`."
        )
    return choice


class Implementation:
    """Attribute access to the modules of one implementation package.

    ``impl.benchmarking.time_fn`` imports ``<package>.benchmarking`` on first use, so a syntax error
    in one stage's file fails that stage's tests only.
    """

    def __init__(self, package: str):
        self.package = package

    def __getattr__(self, module: str) -> ModuleType:
        if module.startswith("_"):
            raise AttributeError(module)
        return importlib.import_module(f"{self.package}.{module}")

    def __repr__(self) -> str:
        return f"Implementation({self.package!r})"


def load(name: str | None = None) -> Implementation:
    """The implementation selected by ``name`` or ``$LLMSYS_IMPL`` (default ``student``)."""
    return Implementation(selected(name))
