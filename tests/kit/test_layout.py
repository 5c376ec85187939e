"""Two homes, one direction: ``kit/`` is what a student's copy needs and imports nothing of the instructor's.

``kit/`` ships in the student release; ``instructor/``, ``reference/`` and ``benchmarks/`` are not its to import
(the instructor's tools and the solutions never ship; benchmarks import the kit, not the other way). And no
module of the two packages imports, through a chain of imports (at module level or inside a function), itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN_FOR_KIT = ("reference", "benchmarks", "instructor", "student", "tests")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path, *, top_level_only: bool, modules: set[str] = frozenset()) -> set[str]:
    """The absolute module names a file imports (relative imports resolved). ``from package import name``
    counts as importing ``package.name`` when that is one of ``modules``, else ``package``."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # `if TYPE_CHECKING:` imports run no code
        nodes = [n for n in nodes if not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return found


def test_kit_imports_nothing_of_the_instructor_the_reference_or_the_benchmarks():
    offenders = []
    for path in sorted((ROOT / "kit").rglob("*.py")):
        for name in sorted(_imports(path, top_level_only=False)):
            if name.split(".")[0] in FORBIDDEN_FOR_KIT:
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "kit/ must stand alone (it is what ships):\n" + "\n".join(offenders)


def test_no_import_cycle_in_the_kit_or_the_instructor_tools():
    modules = {_module_name(p): p for folder in ("kit", "instructor") for p in (ROOT / folder).rglob("*.py")}
    graph = {name: {m for m in _imports(path, top_level_only=False, modules=set(modules)) if m in modules and m != name}
             for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                cycles.append(" → ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "module-level import cycles:\n" + "\n".join(cycles)
