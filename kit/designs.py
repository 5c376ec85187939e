"""Alternative designs: reasonable implementations that differ from the reference must get full marks.

``tests/kit/designs/stage<N>/<name>/`` holds complete modules named as in ``reference/`` (``ddp.py``,
``parallel/tensor_parallel.py``…) and a ``README.md`` whose first line says how the design differs. Each is
overlaid on a copy of the reference and must pass every public and hidden test of its stage — the evidence that
the tests judge behaviour through the public API, not the reference's internals. ``python -m kit mutants``
runs them with the stage's mutants (``--designs-only`` for just these).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from kit import mutants

DESIGNS = mutants.ROOT / "tests" / "kit" / "designs"


def load_designs(stage: int, designs: Path = DESIGNS) -> list[Path]:
    """The alternative-design folders of one stage (each holds replacement modules for ``reference/``)."""
    folder = designs / f"stage{stage}"
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))) \
        if folder.is_dir() else []


def overlay(design: Path, package: Path) -> list[str]:
    """Copy the design's modules over the package; the relative paths it replaced."""
    replaced = []
    for module in sorted(design.rglob("*.py")):
        rel = module.relative_to(design)
        if not (package / rel).exists():
            raise LookupError(f"design {design.name}: {rel} is not a module of reference/ (a design replaces "
                              "modules; it cannot add new ones the tests would never import)")
        shutil.copy2(module, package / rel)
        replaced.append(str(rel))
    if not replaced:
        raise LookupError(f"design {design.name}: holds no .py module")
    return replaced


def judge_design(stage: int, design: Path, tree: Path, timeout: float) -> mutants.Verdict:
    """Overlay a design on a fresh copy of the reference; every public and hidden test of the stage must pass."""
    readme = design / "README.md"
    summary = readme.read_text().strip().splitlines()[0].lstrip("# ") if readme.exists() else ""
    verdict = mutants.Verdict(stage, f"design:{design.name}", summary, "error")
    start = time.monotonic()
    package = tree / "student"
    shutil.rmtree(package, ignore_errors=True)
    shutil.copytree(tree / "student.pristine", package)
    try:
        verdict.notes.append("replaces " + ", ".join(overlay(design, package)))
    except LookupError as exc:
        verdict.message = str(exc)
        return verdict
    code, junit, output = mutants.run_tests(tree, stage, everything=True, timeout=timeout)
    failure = mutants.first_failure(junit)
    if code == 0:
        verdict.verdict = "passed"
    elif failure is None:
        verdict.verdict, verdict.message = "failed", mutants.headline(output)
    else:
        verdict.verdict = "failed"
        verdict.test, verdict.message = failure[0], mutants.headline(failure[1])
    verdict.seconds = round(time.monotonic() - start, 1)
    return verdict
