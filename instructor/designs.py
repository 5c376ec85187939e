"""Alternative designs: reasonable implementations that differ from the reference must get full marks.

``tests/kit/designs/stage<N>/<name>/`` holds, for each module it changes (named as in ``reference/``: ``ddp.py``,
``parallel/tensor_parallel.py``…), only the definitions the design writes differently, and a ``README.md`` whose
first line says how the design differs. :func:`build` applies them to a copy of the reference
(:mod:`instructor.overrides`: a definition whose reference counterpart no longer exists fails loudly), and the
result must pass every public and hidden test of its stage — the evidence that the tests judge behaviour through
the public API, not the reference's internals. ``python -m instructor mutants`` runs them with the stage's
mutants (``--designs-only`` for just these); ``make test`` checks that every design still builds.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from instructor import trials
from instructor.overrides import OverrideError, apply

DESIGNS = trials.ROOT / "tests" / "kit" / "designs"


def load_designs(stage: int, designs: Path = DESIGNS) -> list[Path]:
    """The alternative-design folders of one stage (each holds replacement modules for ``reference/``)."""
    folder = designs / f"stage{stage}"
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))) \
        if folder.is_dir() else []


def build(design: Path, package: Path) -> list[str]:
    """Apply the design's overrides to the reference modules in ``package``; the relative paths it changed.
    :class:`~instructor.overrides.OverrideError` (a ``LookupError``) when the design no longer fits the reference."""
    changed = []
    for module in sorted(design.rglob("*.py")):
        rel = module.relative_to(design)
        target = package / rel
        if not target.exists():
            raise OverrideError(f"design {design.name}: {rel} is not a module of reference/ (a design changes "
                                "modules; it cannot add new ones the tests would never import)")
        target.write_text(apply(target.read_text(), module.read_text(), f"design {design.name}, {rel}"))
        changed.append(str(rel))
    if not changed:
        raise OverrideError(f"design {design.name}: holds no .py module")
    return changed


def judge_design(stage: int, design: Path, tree: Path, timeout: float) -> trials.Verdict:
    """Overlay a design on a fresh copy of the reference; every public and hidden test of the stage must pass."""
    readme = design / "README.md"
    summary = readme.read_text().strip().splitlines()[0].lstrip("# ") if readme.exists() else ""
    verdict = trials.Verdict(stage, f"design:{design.name}", summary, "error")
    start = time.monotonic()
    package = tree / "student"
    shutil.rmtree(package, ignore_errors=True)
    shutil.copytree(tree / "student.pristine", package)
    try:
        verdict.notes.append("changes " + ", ".join(build(design, package)))
    except LookupError as exc:
        verdict.message = str(exc)
        return verdict
    code, junit, output = trials.run_tests(tree, stage, everything=True, timeout=timeout)
    failure = trials.first_failure(junit)
    if code == 0:
        verdict.verdict = "passed"
    elif failure is None:
        verdict.verdict, verdict.message = "failed", trials.headline(output)
    else:
        verdict.verdict = "failed"
        verdict.test, verdict.message = failure[0], trials.headline(failure[1])
    verdict.seconds = round(time.monotonic() - start, 1)
    return verdict


# ------------------------------------------------------------------------------------------------ shortcuts
# The other side of "reasonable designs pass": a submission that wraps PyTorch's own implementation of what a
# chapter has the student build (torch DDP, ZeroRedundancyOptimizer, fully_shard, GradScaler, SDPA behind a
# decoy kernel, torch's AdamW) behaves correctly, so only the rule checks (kit.grading.library_rules) can fail it.
# ``tests/kit/shortcuts/stage<N>/<name>/`` holds such a submission as overrides, like a design; its README's
# first line says what it skips and a line ``expect: <regex>`` what a failing public test's message must say.
# Each must fail a public test of its stage with that message (verdict ``killed``), as a mutant must.
SHORTCUTS = trials.ROOT / "tests" / "kit" / "shortcuts"


def load_shortcuts(stage: int, shortcuts: Path = SHORTCUTS) -> list[Path]:
    """The shortcut folders of one stage."""
    return load_designs(stage, shortcuts)


def shortcut_expectation(shortcut: Path) -> tuple[str, str]:
    """(summary, expect regex) from the shortcut's README.md."""
    lines = (shortcut / "README.md").read_text().strip().splitlines()
    expect = next((line.split(":", 1)[1].strip() for line in lines if line.lower().startswith("expect:")), "")
    if not expect:
        raise OverrideError(f"shortcut {shortcut.name}: README.md must have a line 'expect: <regex>'")
    return lines[0].lstrip("# "), expect


def judge_shortcut(stage: int, shortcut: Path, tree: Path, timeout: float) -> trials.Verdict:
    """Overlay a shortcut on a fresh copy of the reference; a public test must fail with a message matching its
    ``expect`` (``killed``); ``survived`` when every public test passes, ``unpointed`` when the failures say
    something else."""
    import re

    verdict = trials.Verdict(stage, f"shortcut:{shortcut.name}", "", "error")
    start = time.monotonic()
    package = tree / "student"
    shutil.rmtree(package, ignore_errors=True)
    shutil.copytree(tree / "student.pristine", package)
    try:
        verdict.mistake, expect = shortcut_expectation(shortcut)
        verdict.notes.append("changes " + ", ".join(build(shortcut, package)))
    except LookupError as exc:
        verdict.verdict, verdict.message = "stale", str(exc)
        return verdict
    code, junit, output = trials.run_tests(tree, stage, stop_when=expect, timeout=timeout)
    found = trials.failures(junit)
    pointing = [f for f in found if re.search(expect, f[1], re.I | re.S)]
    failure = (pointing or found or [None])[0]
    if code == 0:
        verdict.verdict = "survived"
    elif failure is None:
        verdict.message = trials.headline(output)
    else:
        verdict.test, verdict.message = failure[0], trials.headline(failure[1])
        verdict.verdict = "killed" if pointing else "unpointed"
        if not pointing:
            verdict.notes.append(f"no failing test's message matches /{expect}/")
    verdict.seconds = round(time.monotonic() - start, 1)
    return verdict
