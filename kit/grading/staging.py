"""A clean grading tree for one submission: a copy of the kit and its tests, plus only ``student/**/*.py``.

Nothing else a submission holds can change how grading runs: a ``conftest.py``, a ``pytest.ini`` or a
``sitecustomize.py`` is ignored and reported, and so is anything outside the ``student`` package.

Staging runs in the grader, unconfined, so it never follows what the submission controls: zip files and git
repositories both carry symbolic links, and a link followed here would copy the instructor's ``reference/``, the
hidden tests or ``/proc/self/environ`` into the grading tree as if the student had written them. Every entry is
examined with ``lstat`` (never ``stat``): a ``student`` folder that is a link is refused (the submission is
graded as an empty one), and inside it only folders and regular files with one name are taken. Links to files
or folders, hard links (another name of a file that may lie outside the submission), devices, named pipes and
sockets are refused, and each refusal is a note in the grade's message. Files are then read with
``O_NOFOLLOW`` and checked again on the open descriptor, so nothing swapped in between the two is read.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from kit.grading import tree

ROOT = Path(__file__).resolve().parents[2]

# Files that would change how pytest or Python start up, never taken from a submission.
IGNORED_NAMES = ("conftest.py", "sitecustomize.py", "usercustomize.py", "pytest.ini", "setup.py")
ONLY_REGULAR = "only regular files and folders are graded: submit the files themselves, not links to them"


class RefusedEntry(OSError):
    """An entry of a submission the grader will not read (a link, a device, a pipe…); ``str`` is the note that
    names it in the grade's message."""

    def __init__(self, where: str, why: str):
        super().__init__(f"refused {where}: {why} ({ONLY_REGULAR})")


def refusal(info: os.stat_result) -> str | None:
    """Why an entry with this ``lstat`` is refused, or None for a folder or a regular file with one name."""
    mode = info.st_mode
    if stat.S_ISDIR(mode):
        return None
    if stat.S_ISREG(mode):
        # A second name of a file: the other may be the instructor's, outside the submission (tar keeps them).
        return None if info.st_nlink == 1 else (
            f"a hard link (one of {info.st_nlink} names of the same file, which may lie outside the submission)")
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file or folder"


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return path.lstat()
    except FileNotFoundError:
        return None


def find_student_package(submission: Path) -> Path:
    """The submission's ``student/`` folder: ``submission/student``, one level down (an unzipped repository),
    ``submission`` itself when it is named ``student``, or a folder of the stage modules uploaded loose.

    ``submission`` is the grader's choice (unless it is a link named ``student``); every path below it is examined
    without following links. Raises :class:`RefusedEntry` when the ``student`` found is a symbolic link (or a
    pipe, a device…), ``FileNotFoundError`` when there is none.
    """
    if submission.name == "student" and submission.is_symlink():
        raise RefusedEntry("student", "a symbolic link")
    if submission.name == "student" and _lstat(submission / "student") is None:
        return submission
    if (package := _package_at(submission, "student")) is not None:
        return package
    folders = [e.name for e in _entries(submission) if e.is_dir(follow_symlinks=False)]
    nested = [name for name in folders if _package_at(submission, f"{name}/student", check=False) is not None]
    if len(nested) == 1:
        return _package_at(submission, f"{nested[0]}/student")
    if any(e.name.endswith(".py") for e in _entries(submission)) or any(
            _lstat(submission / name / "__init__.py") is not None for name in folders):
        return submission  # the stage modules uploaded loose: the walk refuses the links among them
    links = [e.name for e in _entries(submission) if e.is_symlink()]
    # A link to a repository holding student/ is not followed: say so, or the student cannot tell why.
    why = f" (symbolic links are not followed: {', '.join(links)})" if links else ""
    raise FileNotFoundError(f"submission {submission} has no student/ folder{why}")


def _package_at(submission: Path, where: str, *, check: bool = True) -> Path | None:
    """``submission/where`` if it is a folder; None if there is none (a regular file named ``student`` is no
    package); with ``check``, :class:`RefusedEntry` if it is a link or anything else but a folder."""
    path = submission / where
    info = _lstat(path)
    if info is None or stat.S_ISREG(info.st_mode):
        return None
    why = refusal(info)
    if why is not None and check:
        raise RefusedEntry(where, why)
    return path


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    """``folder``'s entries by name; a ``DirEntry`` answers ``is_dir(follow_symlinks=False)`` from ``lstat``."""
    with os.scandir(folder) as it:
        return sorted(it, key=lambda e: e.name)


def _walk(folder: Path, rel: Path = Path()) -> Iterator[tuple[Path, Path, str | None]]:
    """``(path inside student/, file, why it is refused or None)`` of everything under ``folder``, never
    descending into a link or a ``__pycache__``."""
    for entry in _entries(folder):
        if entry.name == "__pycache__":
            continue  # the grader writes no bytecode and reads none from a submission
        path, inner = Path(entry.path), rel / entry.name
        why = refusal(entry.stat(follow_symlinks=False))
        if why is None and entry.is_dir(follow_symlinks=False):
            yield from _walk(path, inner)
        else:
            yield inner, path, why


def gradable_files(submission: Path) -> tuple[dict[Path, Path], list[str]]:
    """``{path inside student/: file}`` of what is graded, and notes on everything ignored or refused."""
    submission = Path(os.path.abspath(submission))  # not resolve(): a submission named student may be a link
    try:
        student = find_student_package(submission)
    except RefusedEntry as refused:
        return {}, [f"{refused}; graded as an empty submission"]
    files: dict[Path, Path] = {}
    notes: list[str] = []
    for rel, path, why in _walk(student):
        if why is not None:
            notes.append(str(RefusedEntry(f"student/{rel.as_posix()}", why)))
        elif path.suffix != ".py" or path.name in IGNORED_NAMES or rel.parts[0] in ("tests", "reference"):
            notes.append(f"ignored student/{rel.as_posix()} (only the student package's modules are graded)")
        else:
            files[rel] = path
    for extra in _entries(submission) if student != submission else []:
        if extra.path != str(student) and extra.name != student.parent.name:
            notes.append(f"ignored {extra.name} (only student/**/*.py is graded)")
    return files, notes


@contextmanager
def open_regular(path: Path, where: str) -> Iterator[BinaryIO]:
    """``path`` opened for reading if it is still a regular file with one name: ``O_NOFOLLOW`` refuses a link
    put in its place since :func:`gradable_files` looked, ``O_NONBLOCK`` keeps a pipe from blocking the open,
    and ``fstat`` checks what was opened. :class:`RefusedEntry` naming it ``where`` otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # what O_NOFOLLOW says of a link
            raise RefusedEntry(where, "a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        why = refusal(info) or (None if stat.S_ISREG(info.st_mode) else "a folder, not a file")
        if why is not None:
            raise RefusedEntry(where, why)
        yield f


def content_hash(submission: Path) -> str:
    """A hash of exactly what would be graded: a submission whose hash changed must be graded again."""
    digest = hashlib.sha256()
    for rel, path in gradable_files(submission)[0].items():
        digest.update(rel.as_posix().encode() + b"\0")
        with open_regular(path, f"student/{rel.as_posix()}") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        digest.update(b"\0")
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
    what was ignored (anything but ``.py`` files under ``student/``) or refused (links, devices, pipes: see the
    module's docstring). A submission whose ``student`` is refused gets an empty ``student/``: it is graded,
    and scores what an empty submission scores.
    """
    files, notes = gradable_files(submission)
    tree.copy(dest, GRADING_PARTS, exclude=_grading_excludes(include_hidden))
    for rel, path in files.items():
        target = dest / "student" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            # The bytes, never shutil.copy2: it follows a link that replaced the file since it was examined.
            with open_regular(path, f"student/{rel.as_posix()}") as src, open(target, "xb") as dst:
                shutil.copyfileobj(src, dst)
        except RefusedEntry as refused:  # raised before ``target`` is created
            notes.append(str(refused))
    (dest / "student").mkdir(exist_ok=True)
    return notes
