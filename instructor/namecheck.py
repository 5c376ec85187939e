"""Names a generated stub uses but no longer defines — found with the standard library alone.

A name bound inside a solution block and read after it is defined in the reference and undefined in the
stub. The release builder runs these checks on every generated module, so ``make student`` fails with
the line instead of shipping a stub that dies with ``NameError`` (ruff's F821 finds part of this, but
ruff is a development tool and the builder must not need it).

* :func:`undefined_names` — names no scope of the module defines (``symtable``: what the compiler sees).
* :func:`read_before_bound` — names of a function read after a given line without being bound before
  it: the local variables a removed block used to bind (a name may be local and still unbound there).
"""

from __future__ import annotations

import ast
import builtins
import symtable

MODULE_NAMES = {"__name__", "__file__", "__doc__", "__package__", "__spec__", "__loader__", "__builtins__",
                "__path__", "__annotations__", "__dict__"}
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
          ast.GeneratorExp)


def _bound_at_module(table: symtable.SymbolTable) -> set[str]:
    names = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    stack = list(table.get_children())
    while stack:  # `global x` followed by an assignment inside a function also binds x
        child = stack.pop()
        names |= {s.get_name() for s in child.get_symbols() if s.is_declared_global() and s.is_assigned()}
        stack += child.get_children()
    return names


def undefined_names(source: str, filename: str = "<stub>") -> list[tuple[int, str]]:
    """``(line of first use, name)`` for each name read in ``source`` that no scope defines.

    Names in annotations are not checked (``from __future__ import annotations`` leaves them unevaluated).
    """
    table = symtable.symtable(source, filename, "exec")
    known = _bound_at_module(table) | set(dir(builtins)) | MODULE_NAMES
    missing: set[str] = set()
    stack = [table]
    while stack:
        scope = stack.pop()
        missing |= {s.get_name() for s in scope.get_symbols()
                    if s.is_referenced() and s.is_global() and s.get_name() not in known}
        stack += scope.get_children()
    uses = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in missing:
            uses[node.id] = min(uses.get(node.id, node.lineno), node.lineno)
    return sorted((uses.get(name, 0), name) for name in missing)


def scope_names(func: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``(bindings, reads)`` of ``func``'s own scope as ``(line, name)``: parameters, assignments, imports,
    loop and ``with`` targets, nested def/class names; reads include those inside nested lambdas and
    comprehensions (closures over this scope), not those inside nested functions' bodies."""
    a = func.args
    binds = [(func.lineno, arg.arg) for arg in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if arg]
    reads: list[tuple[int, str]] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not nested:
                binds.append((child.lineno, child.name))
                for expr in child.decorator_list + getattr(getattr(child, "args", None), "defaults", []):
                    visit(ast.Expression(expr), nested)
                continue
            if isinstance(child, ast.Name):
                if isinstance(child.ctx, ast.Load):
                    reads.append((child.lineno, child.id))
                elif not nested:
                    binds.append((child.lineno, child.id))
            elif isinstance(child, ast.alias) and not nested:
                binds.append((child.lineno, (child.asname or child.name).split(".")[0]))
            elif isinstance(child, ast.ExceptHandler) and child.name and not nested:
                binds.append((child.lineno, child.name))
            visit(child, nested or isinstance(child, SCOPES))

    for stmt in func.body:
        visit(ast.Module([stmt], []), False)
    return binds, reads


def read_before_bound(func: ast.FunctionDef | ast.AsyncFunctionDef, line: int, names: set[str]
                      ) -> list[tuple[int, str]]:
    """Those of ``names`` that ``func`` reads after ``line`` but binds nowhere before it: ``(line, name)``."""
    binds, reads = scope_names(func)
    bound = {name for at, name in binds if at < line}
    first: dict[str, int] = {}
    for at, name in sorted(reads):
        if at > line and name in names and name not in bound:
            first.setdefault(name, at)
    return sorted((at, name) for name, at in first.items())
