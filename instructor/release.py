"""Build the student package and the student release from ``reference/``.

``reference/`` is the single source of truth. Solution code sits between markers::

    def time_fn(fn, *, warmup, iters, sync=None):
        \"\"\"docstring stays\"\"\"
        non_negative_int("warmup", warmup)   # given: argument checks stay outside the markers
        # BEGIN SOLUTION time each call between two synchronisations (handout 01 §1.1)
        ...solution...
        # END SOLUTION

and the student copy gets, at the marker's indentation::

        raise NotImplementedError("time_fn: time each call between two synchronisations (handout 01 §1.1)")

Everything outside the markers — imports, signatures, docstrings, argument checks, given helpers — is
copied as is. :mod:`instructor.stubs` defines the whole marker language (SOLUTION, PROMPT, SCAFFOLD) and the
two levels: ``guided`` (the default, what ``student/`` holds) and ``open`` (public API only).
A file with at least one stub is stamped "Your work goes in this file"; the others "Given code".
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from instructor.stubs import LEVELS, MarkerError, parse, render
from kit.grading import tree

__all__ = ["LEVELS", "MarkerError", "build_release", "render_student", "solution_blocks", "stale_student_files",
           "strip_solutions", "write_student"]

REFERENCE_IMPORT = re.compile(r"^\s*(from\s+reference\b|import\s+reference\b)", re.M)

ROOT = Path(__file__).resolve().parent.parent
GENERATED_HEADER = "# Your work goes in this file. Generated from the kit's reference by `make student`.\n"
GIVEN_HEADER = "# Given code — read, don't edit. Generated from the kit's reference by `make student`.\n"

# A student release is the repository's top level but for what never ships: the instructor's tools and
# answer key (instructor/), the solutions (reference/), the hidden tests and the kit's own tests (which test
# the instructor's tools against the reference), the instructor's guide and the maintainers' guide.
RELEASE_EXCLUDE = ("instructor", "reference", "tests/hidden", "tests/kit", "INSTRUCTOR.md", "CONTRIBUTING.md")
# A line of a shipped markdown file that carries this marker is for the instructor's copy only (README.md's pointer
# to INSTRUCTOR.md and CONTRIBUTING.md): the release drops the line, so no link in it points at a file left out.
INSTRUCTOR_ONLY_LINE = "<!-- instructor-only -->"
# Hidden top-level entries a student needs (the rest, .ci/ and .git/, stay out): the dev container (README.md,
# "On macOS or Windows") is the Dockerfile with these two.
RELEASE_DOTFILES = (".gitignore", ".dockerignore", ".devcontainer")


def release_parts(root: Path = ROOT) -> list[str]:
    """The top-level files and folders a release is made of: what the repository tracks at its top (every
    non-hidden entry, outside a git checkout), minus :data:`RELEASE_EXCLUDE`; of the hidden ones, only
    :data:`RELEASE_DOTFILES`."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, timeout=60, check=True)
        names = {line.split("/")[0] for line in listed.stdout.splitlines() if line}
    except (OSError, subprocess.SubprocessError):
        names = {p.name for p in root.iterdir()}
    names = {n for n in names if not n.startswith(".") or n in RELEASE_DOTFILES}
    return sorted(n for n in names if n not in RELEASE_EXCLUDE and (root / n).exists())


@dataclass
class SolutionBlock:
    path: Path
    line: int
    function: str
    hint: str
    text: str


def strip_solutions(source: str, path: Path | str = "<string>",
                    level: str = "guided") -> tuple[str, list[SolutionBlock]]:
    """``source`` as the student gets it at ``level`` (no header), and its solution blocks."""
    return render(source, path, level).text, _blocks(source, path)


def _blocks(source: str, path: Path | str) -> list[SolutionBlock]:
    parsed = parse(source, path)
    return [SolutionBlock(Path(path), b.begin + 1, b.function, b.hint, "".join(parsed.lines[b.begin + 1:b.end]))
            for b in parsed.blocks if b.kind == "SOLUTION"]


def solution_blocks(reference: Path = ROOT / "reference") -> list[SolutionBlock]:
    """Every solution block in the reference package."""
    blocks: list[SolutionBlock] = []
    for path in sorted(reference.rglob("*.py")):
        blocks += _blocks(path.read_text(), path.relative_to(reference.parent))
    return blocks


def render_student(reference: Path = ROOT / "reference", level: str = "guided") -> dict[Path, bytes]:
    """The student package at ``level`` as ``{relative path: contents}``, generated from ``reference``."""
    if not (reference / "__init__.py").exists():
        raise FileNotFoundError(f"{reference} is not the reference package: `make student` regenerates student/ "
                                "from reference/, which only the instructor's copy of the kit holds")
    command = "make student" + (f" LEVEL={level}" if level != "guided" else "")
    files: dict[Path, bytes] = {}
    for path in sorted(reference.rglob("*")):
        if path.is_dir() or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(reference)
        if path.suffix == ".py":
            source = path.read_text()
            if REFERENCE_IMPORT.search(source):
                raise MarkerError(
                    f"reference/{rel}: import siblings relatively (from . import x), not from 'reference'"
                )
            stub = render(source, Path("reference") / rel, level, stub_path=f"student/{rel}")
            header = GENERATED_HEADER if stub.stubs else GIVEN_HEADER
            files[rel] = (header.replace("`make student`", f"`{command}`") + stub.text).encode()
        else:
            files[rel] = path.read_bytes()
    return files


def write_student(reference: Path = ROOT / "reference", student: Path = ROOT / "student",
                  level: str = "guided") -> list[Path]:
    """Regenerate ``student`` from ``reference`` at ``level``; return the files written. Stale files are removed.

    Both levels are generated (and so checked) every time: a marker that breaks the open level fails
    ``make student`` too.
    """
    files = {lv: render_student(reference, lv) for lv in LEVELS}[level]
    if student.exists():
        shutil.rmtree(student)
    for rel, data in files.items():
        target = student / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return sorted(files)


def stale_student_files(reference: Path = ROOT / "reference", student: Path = ROOT / "student",
                        level: str = "guided") -> list[str]:
    """Files where ``student`` differs from what ``reference`` generates at ``level`` (empty when up to date)."""
    expected = render_student(reference, level)
    actual = {
        p.relative_to(student): p.read_bytes()
        for p in student.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    } if student.exists() else {}
    return sorted(str(rel) for rel in set(expected) | set(actual) if expected.get(rel) != actual.get(rel))


def build_release(out: Path = ROOT / "dist" / "student-release", root: Path = ROOT, level: str = "guided") -> Path:
    """Copy what a student needs into ``out`` — :func:`release_parts`: never ``instructor/``, ``reference/``,
    hidden tests, the kit's own tests or the instructor's and maintainers' guides; markdown lines marked
    :data:`INSTRUCTOR_ONLY_LINE` are dropped.

    ``level="guided"`` ships the committed ``student/`` (which must be fresh); ``"open"`` ships stubs
    generated at the open level instead.
    """
    if level == "guided":
        stale = stale_student_files(root / "reference", root / "student")
        if stale:
            raise RuntimeError(f"student/ is stale ({', '.join(stale[:5])}…): run `make student` first")
    if out.exists():
        shutil.rmtree(out)
    parts = [p for p in release_parts(root) if not (level != "guided" and p == "student")]
    tree.copy(out, parts, root=root, exclude=RELEASE_EXCLUDE)
    if level != "guided":
        for rel, data in render_student(root / "reference", level).items():
            (out / "student" / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / "student" / rel).write_bytes(data)
    for page in out.rglob("*.md"):
        text = page.read_text()
        if INSTRUCTOR_ONLY_LINE in text:
            page.write_text("".join(line for line in text.splitlines(keepends=True)
                                    if INSTRUCTOR_ONLY_LINE not in line))
    return out
