"""Copy parts of the kit into another tree: the one way every tool does it.

A submission's grading tree, a mutant's tree, the student release, the Gradescope bundle and the kit's
own test copies all start as "these folders and files of the kit, without caches, without these
sub-folders". :func:`files` lists them; :func:`copy` writes them under another root (optionally under other
names: a mutant's tree holds the reference as ``student/``).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Never part of a copy: caches and editor or notebook leftovers.
CACHES = ("__pycache__", ".pytest_cache", ".ipynb_checkpoints", ".ruff_cache")


def _excluded(rel: str, exclude: Iterable[str]) -> bool:
    return any(rel == x or rel.startswith(x.rstrip("/") + "/") for x in exclude)


def files(parts: Iterable[str], *, root: Path = ROOT, exclude: Iterable[str] = ()) -> Iterator[str]:
    """The files under ``parts`` (top-level folders or files of ``root``), as POSIX paths relative to ``root``,
    sorted, without caches, ``*.pyc`` and anything under an ``exclude`` path (``"tests/hidden"``)."""
    exclude = tuple(exclude)
    for part in parts:
        base = root / part
        if base.is_file():
            if not _excluded(part, exclude):
                yield part
            continue
        for path in sorted(base.rglob("*")):
            rel = path.relative_to(root).as_posix()
            if (path.is_file() and path.suffix != ".pyc" and not any(c in CACHES for c in path.parts)
                    and not _excluded(rel, exclude)):
                yield rel


def copy(dest: Path, parts: Iterable[str], *, root: Path = ROOT, exclude: Iterable[str] = (),
         rename: dict[str, str] | None = None) -> Path:
    """Copy :func:`files` of ``parts`` into ``dest`` (created); ``rename`` maps a part to another top-level name
    (``{"reference": "student"}``). Returns ``dest``."""
    rename = rename or {}
    dest.mkdir(parents=True, exist_ok=True)
    for rel in files(parts, root=root, exclude=exclude):
        top, _, rest = rel.partition("/")
        target = dest / rename.get(top, top) / rest if rest else dest / rename.get(top, top)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    return dest
