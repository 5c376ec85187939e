"""Build a module from the reference and a design's overrides: only what the design writes differently.

A design module (``tests/kit/designs/stage<N>/<name>/<module>.py``) holds the definitions a student would
write differently — whole functions, module-level names, or members of a class — and nothing copied from
the reference. :func:`apply` builds the module the tests grade:

* a top-level function or name the design defines replaces the reference's of that name, in place;
* a class the design defines takes the design's header (bases, decorators, docstring) and, member by
  member, the design's methods and class attributes in place of the reference's; the reference's other
  members stay;
* the design's imports are added after the reference's;
* a name the reference does not have is the design's own: it must be listed in ``ADDS`` (``"helper"`` or
  ``"Class.member"``), so that a definition whose reference counterpart was renamed or removed fails loudly
  (:class:`OverrideError`) instead of silently becoming an unused addition. New top-level definitions go just
  before the next definition they precede in the design, or at the end; new members at the end of their class.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass

__all__ = ["OverrideError", "apply", "minimal"]


class OverrideError(LookupError):
    """A design overrides something the reference no longer defines, or holds something that is not a definition."""


@dataclass
class _Item:
    name: str
    node: ast.stmt
    start: int  # first line (0-based), decorators included
    end: int  # one past the last line


def _name(node: ast.stmt) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


def _items(body: list[ast.stmt]) -> list[_Item]:
    out = []
    for node in body:
        name = _name(node)
        if name is not None:
            decorators = getattr(node, "decorator_list", [])
            start = min([node.lineno, *(d.lineno for d in decorators)]) - 1
            out.append(_Item(name, node, start, node.end_lineno))
    return out


def _docstring(node: ast.AST) -> ast.stmt | None:
    body = getattr(node, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0]
    return None


def _header_end(node: ast.ClassDef) -> int:
    """Where a class's members begin (0-based line): after its docstring, or at its first statement's first line
    (decorators included)."""
    first = node.body[0]
    if first is _docstring(node):
        return first.end_lineno
    return min([first.lineno, *(d.lineno for d in getattr(first, "decorator_list", []))]) - 1


def _text(lines: list[str], start: int, end: int) -> str:
    return "".join(lines[start:end])


def _adds(tree: ast.Module, where: str) -> set[str]:
    for node in tree.body:
        if _name(node) == "ADDS":
            try:
                value = ast.literal_eval(node.value)
            except ValueError as exc:
                raise OverrideError(f"{where}: ADDS must be a tuple of names") from exc
            return set(value)
    return set()


def _merge_class(ref: _Item, ref_lines: list[str], new: _Item, new_lines: list[str], adds: set[str],
                 where: str) -> str:
    """The reference class with the design's header and members."""
    ref_members = {m.name: m for m in _items(ref.node.body)}
    new_members = _items(new.node.body)
    unknown = [m.name for m in new_members if m.name not in ref_members and f"{new.name}.{m.name}" not in adds]
    if unknown:
        raise OverrideError(f"{where}: the design replaces {', '.join(f'{new.name}.{n}' for n in unknown)}, which "
                            "the reference no longer defines (list the design's own members in ADDS)")
    stray = [n for n in new.node.body if _name(n) is None and n is not _docstring(new.node)
             and not isinstance(n, ast.Pass)]
    if stray:
        raise OverrideError(f"{where}: class {new.name} in a design holds only definitions (line {stray[0].lineno})")
    # The header: the design's decorators and class line(s) up to its first statement (docstring included).
    header = _text(new_lines, new.start, _header_end(new.node))
    body_start = _header_end(ref.node)
    replaced = {m.name: m for m in new_members}
    out, cursor = [header], body_start
    for member in sorted(ref_members.values(), key=lambda m: m.start):
        if member.name in replaced:
            out.append(_text(ref_lines, cursor, member.start))
            out.append(_text(new_lines, replaced[member.name].start, replaced[member.name].end))
            cursor = member.end
    out.append(_text(ref_lines, cursor, ref.end))
    for member in new_members:
        if member.name not in ref_members:
            out.append("\n" + _text(new_lines, member.start, member.end))
    return "".join(out)


def apply(reference: str, design: str, where: str = "design") -> str:
    """The reference module's source with the design's overrides applied (see the module docstring)."""
    ref_tree, new_tree = ast.parse(reference), ast.parse(design)
    ref_lines, new_lines = reference.splitlines(keepends=True), design.splitlines(keepends=True)
    ref_items = {i.name: i for i in _items(ref_tree.body)}
    adds = _adds(new_tree, where)
    imports, definitions = [], []
    for node in new_tree.body:
        if node is _docstring(new_tree) or _name(node) == "ADDS":
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                imports.append(_text(new_lines, node.lineno - 1, node.end_lineno))
        elif _name(node) is not None:
            definitions.append(_items([node])[0])
        else:
            raise OverrideError(f"{where}: a design holds imports and definitions only (line {node.lineno})")
    unknown = [d.name for d in definitions if d.name not in ref_items and d.name not in adds]
    if unknown:
        raise OverrideError(f"{where}: the design replaces {', '.join(unknown)}, which the reference no longer "
                            "defines (list the design's own definitions in ADDS)")
    replacement: dict[str, str] = {}
    pending: list[str] = []  # the design's own definitions, placed before the next replaced one
    before: dict[str, list[str]] = {}
    for item in definitions:
        text = _text(new_lines, item.start, item.end)
        if item.name not in ref_items:
            pending.append(text)
            continue
        ref = ref_items[item.name]
        if isinstance(ref.node, ast.ClassDef) and isinstance(item.node, ast.ClassDef):
            text = _merge_class(ref, ref_lines, item, new_lines, adds, where)
        replacement[item.name] = text
        before[item.name], pending = pending, []
    out, cursor = [], 0
    last_import = max((n.end_lineno for n in ref_tree.body if isinstance(n, (ast.Import, ast.ImportFrom))), default=0)
    for ref in sorted(ref_items.values(), key=lambda i: i.start):
        if ref.name in replacement:
            out.append(_text(ref_lines, cursor, ref.start))
            out.extend(f"{t}\n\n" for t in before[ref.name])
            out.append(replacement[ref.name])
            cursor = ref.end
    out.append(_text(ref_lines, cursor, len(ref_lines)))
    out.extend(f"\n\n{t}" for t in pending)
    source = "".join(out)
    if imports:  # after the reference's own imports (their line numbers are unchanged: nothing before them moved)
        lines = source.splitlines(keepends=True)
        source = "".join(lines[:last_import] + imports + lines[last_import:])
    return source


def _same_code(a: ast.stmt, b: ast.stmt) -> bool:
    """Whether two definitions are the same code: comments, docstrings and layout aside."""
    def dump(node: ast.stmt) -> str:
        node = copy.deepcopy(node)
        for inner in ast.walk(node):
            body = getattr(inner, "body", None)
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body \
                    and body[0] is _docstring(inner):
                inner.body = body[1:] or [ast.Pass()]
        return ast.dump(node)
    return dump(a) == dump(b)


def _without_same_docstring(text: str, node: ast.stmt, lines: list[str], ref: ast.stmt | None) -> str:
    """A definition's source without its docstring when the reference's counterpart has the same one."""
    doc, ref_doc = _docstring(node), _docstring(ref) if ref is not None else None
    if doc is None or ref_doc is None or ast.literal_eval(doc.value) != ast.literal_eval(ref_doc.value):
        return text
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))]) - 1
    if len(node.body) == 1:  # the docstring was the whole body
        return text
    rel_start, rel_end = doc.lineno - 1 - start, doc.end_lineno - start
    kept = text.splitlines(keepends=True)
    return "".join(kept[:rel_start] + kept[rel_end:])


def minimal(reference: str, design: str) -> str:
    """A complete design module reduced to its overrides: the definitions (or class members) whose source
    differs from the reference's, the imports the reference lacks, and ``ADDS`` for its own names. For
    converting a design written as a whole module; ``apply(reference, minimal(reference, design))`` behaves
    as ``design``."""
    ref_tree, new_tree = ast.parse(reference), ast.parse(design)
    ref_lines, new_lines = reference.splitlines(keepends=True), design.splitlines(keepends=True)
    ref_items = {i.name: i for i in _items(ref_tree.body)}
    imports, keep, adds = [], [], []
    for node in new_tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):  # all of them: the overrides read as a module of their own
            if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                imports.append(_text(new_lines, node.lineno - 1, node.end_lineno))
            continue
        name = _name(node)
        if name is None:
            continue
        item = _items([node])[0]
        text = _text(new_lines, item.start, item.end)
        ref = ref_items.get(name)
        if ref is None:
            adds.append(name)
            keep.append(text)
        elif isinstance(node, ast.ClassDef) and isinstance(ref.node, ast.ClassDef):
            members = _class_overrides(ref, ref_lines, item, new_lines, adds)
            if members is not None:
                keep.append(members)
        elif not _same_code(node, ref.node):
            keep.append(_without_same_docstring(text, node, new_lines, ref.node))
    head = "".join(imports) + ("\n" if imports else "") + (f"ADDS = {tuple(adds)!r}\n" if adds else "")
    return head + "\n\n" + "\n\n".join(t.rstrip("\n") + "\n" for t in keep)


def _class_overrides(ref: _Item, ref_lines: list[str], new: _Item, new_lines: list[str], adds: list[str]) -> str | None:
    """The design's class reduced to its header and the members that differ (None: identical to the reference)."""
    ref_members = {m.name: m for m in _items(ref.node.body)}
    header = _text(new_lines, new.start, _header_end(new.node))
    ref_header_end = _header_end(ref.node)
    first = new.node.body[0]
    members = []
    for member in _items(new.node.body):
        text = _text(new_lines, member.start, member.end)
        theirs = ref_members.get(member.name)
        if theirs is None:
            adds.append(f"{new.name}.{member.name}")
            members.append(text)
        elif not _same_code(member.node, theirs.node):
            members.append(_without_same_docstring(text, member.node, new_lines, theirs.node))
    if not members and header.strip() == _text(ref_lines, ref.start, ref_header_end).strip():
        return None
    if not members:
        indent = " " * (new.node.body[0].col_offset)
        members = [f"{indent}pass\n"] if first is not _docstring(new.node) else []
    return header + "\n".join(members)
