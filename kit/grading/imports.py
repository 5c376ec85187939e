"""Before the tests: import each graded module once, in a worker, under a time limit.

A module that hangs or fails at import is marked unavailable in every worker from then on
(:func:`kit.spawn.parent.mark_unavailable`): a test that uses it — one of its own stage, or of a later stage that
builds on it (Stage 6 uses Stage 4's DDP) — fails at once with a message naming the module, its stage and why,
instead of hanging in it again; every test that does not use it is graded as usual. One mistake, charged once:
an FSDP test does not lose its points to a ZeRO module that hangs.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from pathlib import Path

from kit import stages as registry
from kit.setup.portable import triton_missing_error


def _modules(package: str, module: str, root: Path) -> list[str]:
    """``package.module``, and its submodules when it is a package (found on disk: nothing is imported here)."""
    folder = root / package / module
    names = [f"{package}.{module}"]
    if folder.is_dir():
        names += [f"{package}.{module}.{m.name}" for m in pkgutil.iter_modules([str(folder)])]
    return names


def unavailable_message(name: str, stage: int | None, why: str) -> str:
    where = f" (Stage {stage}, {registry.get(stage).title})" if stage else ""
    fix = f" Fix Stage {stage}'s module first" if stage else " Fix it first"
    return f"{name}{where} did not import, so this test, which uses it, cannot run.{fix}:\n{why}"


def check_imports(package: str, stages: list[int], seconds: float, failures: dict[str, str],
                  write: Callable[[dict], None], root: Path) -> None:
    """Import the package and each stage's modules (a package's modules too) once in the worker; add the ones
    that fail to ``failures`` (module → why) and mark every failed one unavailable to every later worker."""
    from kit.checks import Worker
    from kit.spawn.parent import mark_unavailable

    worker = Worker()
    known = {name: stage for stage in stages for module in registry.get(stage).modules
             for name in _modules(package, module, root)}

    def attempt(name: str, stage: int) -> None:
        if name not in failures:
            write({"event": "import", "stage": stage, "module": name, "limit": seconds * 10})
            why = worker.import_module(name, seconds)
            if why is not None and triton_missing_error("ModuleNotFoundError", why):
                why = None  # no Triton on this machine: the tests that need it are skipped, saying so (kit.checks)
            write({"event": "imported", "stage": stage, "module": name, "outcome": "failed" if why else "passed",
                   "message": why or ""})
            if why is not None:
                failures[name] = why
        if name in failures:
            mark_unavailable({name: unavailable_message(name, stage or None, failures[name])})

    attempt(package, 0)  # first: a hang in its __init__ would otherwise cost every module the limit
    if package in failures:
        return
    for name, stage in known.items():
        attempt(name, stage)
