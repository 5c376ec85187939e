"""Run one stage's tests on a grading tree and read what failed: what the mutants and the designs share.

A tree (:func:`build_tree`) holds the kit, the tests and an implementation staged as ``student``;
:func:`run_tests` runs a stage's tests on it in a fresh pytest process — with the grading plugin, so each test's
workers have the same CPU budget and idle limit as when grading — and :func:`failures` reads the junit report.
A :class:`Verdict` is what ``python -m instructor mutants`` reports for one mutant or design.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from kit import stages as stage_registry
from kit.grading import tree

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Verdict:
    stage: int
    name: str
    mistake: str
    verdict: str  # killed | survived | justified | unpointed | hidden-missed | stale | error | passed | failed
    test: str = ""
    message: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def accounted(self) -> bool:
        return self.verdict in ("killed", "justified", "passed", "gpu-only")



def build_tree(dest: Path, root: Path = ROOT) -> Path:
    """A grading tree in ``dest``: the kit, the tests (public and hidden) and the reference staged as ``student``."""
    parts = ["kit", "tests", "reference", "pyproject.toml"] + (["handout"] if (root / "handout").is_dir() else [])
    return tree.copy(dest, parts, root=root, exclude=("tests/kit",), rename={"reference": "student"})


def failures(junit: Path) -> list[tuple[str, str]]:
    """(test name, message) of every failed or errored test in a junit XML report, in the order they ran.

    The message is the exception's own text (what a student reads first), not the traceback.
    """
    if not junit.exists():
        return []
    return [(case.get("name", "?"), (child.get("message") or child.text or "").strip())
            for case in ET.parse(junit).getroot().iter("testcase")
            for child in case if child.tag in ("failure", "error")]


def first_failure(junit: Path) -> tuple[str, str] | None:
    """(test name, message) of the first failed or errored test in a junit XML report, else None."""
    found = failures(junit)
    return found[0] if found else None


def run_tests(tree: Path, stage: int, *, hidden_test: str = "", everything: bool = False, stop_when: str = "",
              timeout: float = 900.0) -> tuple[int, Path, str]:
    """Run the stage's public tests (or one hidden test, or public and hidden until the first failure) in ``tree``.

    The public tests run in the order a student's run takes: a mistake in a component often also breaks a composed
    test that runs earlier (stage 6's 4D training before its tensor-parallel tests), and what matters is that
    some failing test's message points at the mistake. With ``stop_when`` (a regular expression, matched
    case-insensitively against each failure's message) the run ends at the first failure that matches
    (:mod:`instructor.stop_on_match`): the rest could not change the verdict.
    """
    junit = tree / f"junit-{time.monotonic_ns()}.xml"
    marker = stage_registry.get(stage).marker
    if hidden_test:
        selection = ["tests/hidden", "-m", marker, "-k", hidden_test]
    elif everything:
        selection = ["tests", "-m", marker]
    else:
        selection = ["tests", "-m", f"{marker} and not hidden", "--ignore=tests/hidden"]
    stop_first = ["-x"] if hidden_test or everything else []
    if stop_when and not stop_first:
        shutil.copy(Path(__file__).with_name("stop_on_match.py"), tree / "_stop_on_match.py")
        stop_first = ["-p", "_stop_on_match"]
    cmd = [sys.executable, "-m", "pytest", *selection, *stop_first, "-q", "-p", "no:cacheprovider", "--impl", "student",
           "-o", "addopts=", "-p", "kit", "-p", "kit.grading.plugin", f"--junitxml={junit}", "--tb=short"]
    env = {**os.environ, "LLMSYS_IMPL": "student", "PYTHONHASHSEED": "0", "MPLBACKEND": "Agg",
           "PYTHONDONTWRITEBYTECODE": "1", "LLMSYS_STOP_WHEN": stop_when}
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout,
                              start_new_session=True)
        return proc.returncode, junit, proc.stdout[-4000:] + proc.stderr[-2000:]
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"")[-3000:] if isinstance(exc.stdout, bytes) else (exc.stdout or "")[-3000:]
        return -1, junit, f"timed out after {timeout:g} s\n{out}"


def headline(message: str) -> str:
    for line in message.splitlines():
        line = line.strip().removeprefix("E").strip()
        if line and not line.startswith(("def ", "File ", "Traceback", "_ _", "---", "self =")):
            return line[:220]
    return message.strip()[:220]
