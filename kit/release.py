"""Build the student package and the student release from ``reference/``.

``reference/`` is the single source of truth. Solution code sits between markers::

    def time_fn(fn, *, warmup, iters, sync=None):
        \"\"\"docstring stays\"\"\"
        # BEGIN SOLUTION time each call between two synchronisations (handout 01 §1.1)
        ...solution...
        # END SOLUTION

and the student copy gets, at the marker's indentation::

        raise NotImplementedError("time_fn: time each call between two synchronisations (handout 01 §1.1)")

Everything outside the markers — imports, signatures, docstrings, given helpers — is copied as is.
The text after ``BEGIN SOLUTION`` is required: it is the first thing a student reads.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION(?P<hint>.*)$")
END = re.compile(r"^[ \t]*# END SOLUTION\s*$")
DEF = re.compile(r"^(?P<indent>[ \t]*)(?:async\s+)?def\s+(?P<name>\w+)|^(?P<cindent>[ \t]*)class\s+(?P<cname>\w+)")
REFERENCE_IMPORT = re.compile(r"^\s*(from\s+reference\b|import\s+reference\b)", re.M)

ROOT = Path(__file__).resolve().parent.parent
GENERATED_HEADER = "# Your work goes in this file. Generated from the kit's reference by `make student`.\n"

# What a student release contains (relative to the repository root) and what it never contains.
RELEASE_INCLUDE = (
    "README.md", "Makefile", "pyproject.toml", "constraints-cpu.txt", ".gitignore",
    "student", "kit", "tests", "handout", "notebooks", "benchmarks",
)
RELEASE_EXCLUDE_DIRS = ("tests/hidden", "tests/kit", "__pycache__", ".ipynb_checkpoints", ".pytest_cache")


class MarkerError(ValueError):
    """A solution marker is malformed; the message names the file and line."""


@dataclass
class SolutionBlock:
    path: Path
    line: int
    function: str
    hint: str
    text: str


def _qualified_name(lines: list[str], index: int, indent: int) -> str:
    """Name of the function (and class) enclosing line ``index`` whose body is indented by ``indent``."""
    names: list[str] = []
    level = indent
    for line in reversed(lines[:index]):
        m = DEF.match(line)
        if not m:
            continue
        ind = len(m.group("indent") if m.group("name") else m.group("cindent"))
        if ind < level:
            names.append(m.group("name") or m.group("cname"))
            level = ind
            if ind == 0:
                break
    return ".".join(reversed(names)) or "<module>"


def strip_solutions(source: str, path: Path | str = "<string>") -> tuple[str, list[SolutionBlock]]:
    """Return ``source`` with every solution block replaced by a ``NotImplementedError`` stub."""
    lines = source.splitlines(keepends=True)
    out: list[str] = []
    blocks: list[SolutionBlock] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        m = BEGIN.match(line.rstrip("\n"))
        if END.match(line):
            raise MarkerError(f"{path}:{i + 1}: '# END SOLUTION' without a matching '# BEGIN SOLUTION'")
        if not m:
            out.append(line)
            i += 1
            continue
        indent = m.group("indent")
        hint = m.group("hint").strip()
        if not hint:
            raise MarkerError(
                f"{path}:{i + 1}: '# BEGIN SOLUTION' needs a hint after it, e.g. "
                "'# BEGIN SOLUTION compute the online softmax (handout 03 §2)'"
            )
        j = i + 1
        while j < len(lines) and not END.match(lines[j]):
            if BEGIN.match(lines[j].rstrip("\n")):
                raise MarkerError(f"{path}:{j + 1}: nested '# BEGIN SOLUTION' (block opened at line {i + 1})")
            j += 1
        if j == len(lines):
            raise MarkerError(f"{path}:{i + 1}: '# BEGIN SOLUTION' is never closed by '# END SOLUTION'")
        function = _qualified_name(lines, i, len(indent.expandtabs()))
        if function == "<module>":
            raise MarkerError(f"{path}:{i + 1}: solution blocks must sit inside a function body")
        message = f"{function}: {hint}".replace("\\", "\\\\").replace('"', '\\"')
        out.append(f'{indent}raise NotImplementedError("{message}")\n')
        blocks.append(SolutionBlock(Path(path), i + 1, function, hint, "".join(lines[i + 1 : j])))
        i = j + 1
    return "".join(out), blocks


def solution_blocks(reference: Path = ROOT / "reference") -> list[SolutionBlock]:
    """Every solution block in the reference package."""
    blocks: list[SolutionBlock] = []
    for path in sorted(reference.rglob("*.py")):
        blocks += strip_solutions(path.read_text(), path.relative_to(reference.parent))[1]
    return blocks


def render_student(reference: Path = ROOT / "reference") -> dict[Path, bytes]:
    """The student package as ``{relative path: contents}``, generated from ``reference``."""
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
            stripped, _ = strip_solutions(source, Path("reference") / rel)
            files[rel] = (GENERATED_HEADER + stripped).encode()
        else:
            files[rel] = path.read_bytes()
    return files


def write_student(reference: Path = ROOT / "reference", student: Path = ROOT / "student") -> list[Path]:
    """Regenerate ``student`` from ``reference``; return the files written. Stale files are removed."""
    files = render_student(reference)
    if student.exists():
        shutil.rmtree(student)
    for rel, data in files.items():
        target = student / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return sorted(files)


def stale_student_files(reference: Path = ROOT / "reference", student: Path = ROOT / "student") -> list[str]:
    """Files where ``student`` differs from what ``reference`` generates (empty when up to date)."""
    expected = render_student(reference)
    actual = {
        p.relative_to(student): p.read_bytes()
        for p in student.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    } if student.exists() else {}
    return sorted(str(rel) for rel in set(expected) | set(actual) if expected.get(rel) != actual.get(rel))


def build_release(out: Path = ROOT / "dist" / "student-release", root: Path = ROOT) -> Path:
    """Copy what a student needs into ``out`` — never ``reference/``, hidden tests or the kit's own tests."""
    stale = stale_student_files(root / "reference", root / "student")
    if stale:
        raise RuntimeError(f"student/ is stale ({', '.join(stale[:5])}…): run `make student` first")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    excluded = [root / d for d in RELEASE_EXCLUDE_DIRS if "/" in d]

    def ignore(directory: str, names: list[str]) -> list[str]:
        d = Path(directory)
        return [
            n for n in names
            if n in RELEASE_EXCLUDE_DIRS or (d / n) in excluded or n.endswith(".pyc")
        ]

    for name in RELEASE_INCLUDE:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, out / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, out / name)
    return out
