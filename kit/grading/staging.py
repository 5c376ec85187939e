"""A clean grading tree for one submission: a copy of the kit and its tests, plus only ``student/**/*.py``.

Nothing else a submission holds can change how grading runs: a ``conftest.py``, a ``pytest.ini`` or a
``sitecustomize.py`` is ignored and reported, and so is anything outside the ``student`` package.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from kit import tree

ROOT = Path(__file__).resolve().parents[2]

# Files that would change how pytest or Python start up, never taken from a submission.
IGNORED_NAMES = ("conftest.py", "sitecustomize.py", "usercustomize.py", "pytest.ini", "setup.py")


def find_student_package(submission: Path) -> Path:
    """The submission's ``student/`` folder: ``submission/student``, one level down (an unzipped repository),
    ``submission`` itself when it is named ``student``, or a folder of the stage modules uploaded loose."""
    if submission.name == "student" and not (submission / "student").is_dir():
        return submission
    if (submission / "student").is_dir():
        return submission / "student"
    nested = sorted(p for p in submission.glob("*/student") if p.is_dir())
    if len(nested) == 1:
        return nested[0]
    if any(submission.glob("*.py")) or any(submission.glob("*/__init__.py")):
        return submission
    raise FileNotFoundError(f"submission {submission} has no student/ folder")


def gradable_files(submission: Path) -> tuple[dict[Path, Path], list[str]]:
    """``{path inside student/: file}`` of what is graded, and notes on everything ignored."""
    submission = submission.resolve()
    student = find_student_package(submission)
    files, notes = {}, []
    for path in sorted(student.rglob("*")):
        rel = path.relative_to(student)
        if path.is_dir() or "__pycache__" in rel.parts:
            continue
        if path.suffix != ".py" or path.name in IGNORED_NAMES or rel.parts[0] in ("tests", "reference"):
            notes.append(f"ignored student/{rel} (only the student package's modules are graded)")
            continue
        files[rel] = path
    for extra in sorted(submission.iterdir()) if student != submission else []:
        if extra != student and extra.name != student.parent.name:
            notes.append(f"ignored {extra.name} (only student/**/*.py is graded)")
    return files, notes


def content_hash(submission: Path) -> str:
    """A hash of exactly what would be graded: a submission whose hash changed must be graded again."""
    digest = hashlib.sha256()
    for rel, path in gradable_files(submission)[0].items():
        digest.update(rel.as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


GRADING_PARTS = ("kit", "tests", "pyproject.toml")  # what a grading tree holds besides the submission


def _grading_excludes(include_hidden: bool) -> tuple[str, ...]:
    return ("tests/kit",) + (() if include_hidden else ("tests/hidden",))


def grader_hash(include_hidden: bool, root: Path = ROOT) -> str:
    """A hash of everything but the submission that a grade depends on: what a grading tree copies (the kit, the
    graded tests and ``tests/timings.json``, the hidden tests with ``include_hidden``, ``pyproject.toml``) and the
    handout (problem numbers). A result graded under another hash is stale."""
    digest = hashlib.sha256()
    for rel in tree.files([*GRADING_PARTS, "handout"], root=root, exclude=_grading_excludes(include_hidden)):
        digest.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def stage_submission(submission: Path, dest: Path, *, include_hidden: bool = False) -> list[str]:
    """Build a grading tree in ``dest``: a clean copy of the kit plus the submission's ``student/**/*.py``.

    ``submission`` is a folder holding ``student/`` or the ``student/`` folder itself. Returns notes on
    what was ignored (anything but ``.py`` files under ``student/``).
    """
    files, notes = gradable_files(submission)
    tree.copy(dest, GRADING_PARTS, exclude=_grading_excludes(include_hidden))
    for rel, path in files.items():
        target = dest / "student" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    (dest / "student").mkdir(exist_ok=True)
    return notes
