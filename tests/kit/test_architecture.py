"""The kit's shape (a self-test of the kit, no points): rooms with one idea each, and doors between them.

* kit/'s top level holds at most :data:`MAX_TOP_LEVEL` modules: what students, tests and notebooks import
  (``kit.model``, ``kit.checks``, …); the rest lives in sub-packages by audience (``kit.grading``, ``kit.spawn``,
  ``kit.setup``, ``kit.triton``, ``kit.leaderboard``);
* no module in kit/ is longer than :data:`MAX_LINES` lines;
* the import graph between kit's modules has no cycle. Only imports that run when a module is imported count: its
  top-level statements, including those inside a top-level ``if``/``try``/``with`` and class bodies. Imports inside
  a function (lazy, run at call time) and under ``if TYPE_CHECKING:`` are left out: they cannot deadlock or
  half-initialise an import, and several are lazy on purpose (torch-free start-up, the judge importing only what
  it uses);
* nothing reaches into another room's private names: no ``from kit.x import _name`` and no ``module._name`` of a
  kit module from outside its room (a room: a sub-package of kit, or a top-level module of kit). Checked over kit/
  and the code that uses it (tests, instructor, benchmarks, notebooks, reference), not the attack submissions of
  tests/kit/attacks, whose point is to reach in;
* every kit module the zygote preloads by name (``kit.spawn.zygote.KIT_PRELOAD``) exists: a preload that fails to
  import is skipped silently, so a moved module would otherwise only make the workers slower.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "kit"
MAX_TOP_LEVEL = 20
MAX_LINES = 600
USERS = ("tests", "instructor", "benchmarks", "notebooks", "reference", "student")
HOSTILE = ROOT / "tests" / "kit" / "attacks"


def _kit_files() -> list[Path]:
    return sorted(p for p in KIT.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in _kit_files()}


def _room(module: str) -> str:
    """The room of a kit module: its sub-package (``kit.spawn``), or the module itself at kit's top level."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _resolve(importer: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module name an ``from … import`` names (relative imports resolved against ``importer``)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(importer: str, node: ast.Import | ast.ImportFrom, is_package: bool) -> list[tuple[str, str | None]]:
    """``(module, imported name or None)`` for each name of an import statement; a name that is itself a kit module
    (``from kit import checks``) is reported as that module."""
    if isinstance(node, ast.Import):
        return [(alias.name, None) for alias in node.names]
    module = _resolve(importer, node, is_package)
    out = []
    for alias in node.names:
        sub = f"{module}.{alias.name}"
        out.append((sub, None) if sub in MODULES else (module, alias.name))
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_time_imports(body: list[ast.stmt]):
    """The import statements that run when a module is imported (see the module docstring)."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _import_time_imports(node.body)
            yield from _import_time_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _import_time_imports(part)
        elif isinstance(node, ast.With | ast.ClassDef):
            yield from _import_time_imports(node.body)


def _kit_module_of(name: str) -> str | None:
    """The kit module ``name`` is, or is inside (``kit.spawn.parent.Outcome`` → ``kit.spawn.parent``); else None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


def _import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        edges = graph.setdefault(module, set())
        for node in _import_time_imports(tree.body):
            for target, _ in _targets(module, node, path.name == "__init__.py"):
                found = _kit_module_of(target)
                if found is not None and found != module:
                    edges.add(found)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _reaches_in(path: Path) -> list[str]:
    """``from kit.x import _name`` / ``kit_module._name`` in ``path`` where the name's room is not ``path``'s."""
    module = _module_name(path) if path.is_relative_to(KIT) else ""
    room = _room(module) if module else None
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}  # a local name bound to a kit module → that module
    found = []
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            for target, name in _targets(module or "__main__", node, path.name == "__init__.py"):
                kit_module = _kit_module_of(target)
                if kit_module is None:
                    continue
                if _room(kit_module) != room and (
                        (name is not None and _private(name)) or any(_private(p) for p in target.split("."))):
                    found.append(f"{where}:{node.lineno}: imports {name or target} from {target}")
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    target = f"{_resolve(module or '__main__', node, path.name == '__init__.py')}.{alias.name}"
                    if target in MODULES:
                        aliases[alias.asname or alias.name] = target
            else:
                for alias in node.names:
                    if alias.asname and alias.name in MODULES:
                        aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            dotted = _dotted(node.value)
            target = aliases.get(dotted, dotted) if dotted else None
            if target in MODULES and _room(target) != room:
                found.append(f"{where}:{node.lineno}: {dotted}.{node.attr}")
    return found


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


# ----------------------------------------------------------------------------------------------------
# The tests
# ----------------------------------------------------------------------------------------------------


def test_the_top_level_of_kit_holds_few_modules():
    top = sorted(p.name for p in KIT.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, (
        f"kit/ holds {len(top)} modules at its top level, more than {MAX_TOP_LEVEL}: {top}. The top level is what "
        "students, tests and notebooks import; put a module for the grader, set-up or a tool's internals in its "
        "sub-package (kit/grading, kit/setup, kit/triton, kit/spawn, …)")


def test_no_module_of_kit_is_too_long():
    long = {str(p.relative_to(ROOT)): n for p in _kit_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, (f"modules over {MAX_LINES} lines: {long}; split each into a package of modules with one idea "
                      "each, as kit/leaderboard/ is")


def test_the_import_graph_of_kit_has_no_cycle():
    graph = _import_graph()
    assert "kit.checks" in graph and "kit.spawn" in graph["kit.checks"], "the graph reader found no imports"
    cycle = _cycle(graph)
    assert cycle is None, (
        "kit's modules import each other in a cycle at import time: " + " → ".join(cycle or [])
        + ". Move what both need into a third module, or import inside the function that needs it")


def test_nothing_reaches_into_another_rooms_private_names():
    files = _kit_files() + sorted(p for user in USERS for p in (ROOT / user).rglob("*.py")
                                  if not p.is_relative_to(HOSTILE) and "__pycache__" not in p.parts)
    found = [line for path in files for line in _reaches_in(path)]
    assert not found, ("private names of a kit module used from outside its room (a sub-package of kit, or a "
                       "top-level module): give the room a public name for it instead:\n  " + "\n  ".join(found))


def test_the_private_name_rule_sees_a_breach(tmp_path):
    """The rule above, on code that breaks it four ways and keeps it once (so its passing means something)."""
    probe = tmp_path / "probe.py"
    probe.write_text("from kit.spawn.zygote import _unnamed_file\nfrom kit.spawn import parent\n"
                     "import kit.spawn.worker as w\nparent._workers\nw._channel\nkit.spawn.parent._inline\n"
                     "parent.spawn\n")
    found = _reaches_in(probe)
    assert len(found) == 4, found


def test_every_module_the_zygote_preloads_exists():
    from kit.spawn.zygote import KIT_PRELOAD, PRELOAD

    assert set(KIT_PRELOAD) <= set(PRELOAD)
    missing = [name for name in KIT_PRELOAD if importlib.util.find_spec(name) is None]
    assert not missing, (f"kit.spawn.zygote.KIT_PRELOAD names modules that do not exist: {missing} (moved or "
                         "renamed?): the zygote would skip them silently and every worker import them again")
