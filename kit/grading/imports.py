"""Before a stage's tests: import each of its modules once, in a worker, under a time limit.

A module that hangs or fails at import fails its stage at once, with the reason; the other stages are
graded as usual. The module is then marked unavailable in every worker (:func:`kit.spawn.parent.mark_unavailable`):
a later stage whose code imports it — Stage 6 uses Stage 4's DDP — fails at once with a message naming
the earlier stage's module, instead of hanging in it again.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from pathlib import Path

from kit import stages as registry


def _modules(package: str, module: str, root: Path) -> list[str]:
    """``package.module``, and its submodules when it is a package (found on disk: nothing is imported here)."""
    folder = root / package / module
    names = [f"{package}.{module}"]
    if folder.is_dir():
        names += [f"{package}.{module}.{m.name}" for m in pkgutil.iter_modules([str(folder)])]
    return names


def check_imports(package: str, stages: list[int], seconds: float, failures: dict[int, str],
                  write: Callable[[dict], None], root: Path) -> None:
    """Import each stage's modules (a package's modules too) once in the worker; add the stages that fail
    to ``failures`` and mark their modules unavailable to every later worker."""
    from kit.checks import Worker
    from kit.spawn.parent import mark_unavailable

    worker = Worker()
    todo = [s for s in stages if s not in failures]

    def attempt(name: str, stage: int) -> str | None:
        write({"event": "import", "stage": stage, "module": name, "limit": seconds * 10})
        why = worker.import_module(name, seconds)
        write({"event": "imported", "stage": stage, "module": name, "outcome": "failed" if why else "passed",
               "message": why or ""})
        return why

    # The package first: a hang in its __init__ would otherwise cost every stage the import limit.
    why = attempt(package, 0) if todo else None
    if why is not None:
        mark_unavailable({package: f"the package {package} did not import:\n{why}"})
    for stage in todo:
        if why is not None:
            failures[stage] = why
            continue
        for module in registry.get(stage).modules:
            for name in _modules(package, module, root):
                failure = attempt(name, stage)
                if failure is not None:
                    failures[stage] = failure
                    title = registry.get(stage).title
                    mark_unavailable({name: f"{name} (Stage {stage}, {title}) did not import, so this test, which "
                                            f"uses it, cannot run. Fix Stage {stage} first:\n{failure}"})
                    break
            if stage in failures:
                break
