"""The marker language of ``reference/``: finding and checking SOLUTION, PROMPT and SCAFFOLD blocks.

What the markers mean and the stubs they generate are described in :mod:`instructor.stubs`; this module parses
a reference module into its blocks and the functions around them, and rejects every misuse with the
file and line: a block never closed or closed at another indentation, nested blocks, a misspelt marker
(which would otherwise ship solution code), a PROMPT that is not directly followed by its SOLUTION, a
prompt line that is not a comment, a SOLUTION outside a function or without a hint.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

MARKER = re.compile(r"^(?P<indent>[ \t]*)# (?P<edge>BEGIN|END) (?P<kind>SOLUTION|PROMPT|SCAFFOLD)(?P<hint>(?:\s.*)?)$")
LOOKS_LIKE_MARKER = re.compile(r"#\s*(BEGIN|END)\b|(?i:#\s*(begin|end)\s*(solu|prom|scaf))")


class MarkerError(ValueError):
    """A marker is malformed or a stub would be broken; the message names the file and line."""


@dataclass
class Block:
    """One marked block; ``begin``/``end`` are 0-based indices of its marker lines."""

    kind: str
    begin: int
    end: int
    indent: str
    hint: str
    function: str = "<module>"  # qualified name of the innermost enclosing function
    prompt: Block | None = None  # a SOLUTION's PROMPT block

    @property
    def start(self) -> int:
        """First line of the block, its prompt included."""
        return self.prompt.begin if self.prompt else self.begin


@dataclass
class Def:
    """A function or class of the reference, with the lines it spans (0-based, decorators included)."""

    node: ast.AST
    qualname: str
    first: int
    last: int
    is_function: bool
    top: bool  # defined directly in a module or class body
    jit: bool

    @property
    def private(self) -> bool:
        name = self.node.name
        return name.startswith("_") and not name.endswith("__")


@dataclass
class Parsed:
    path: str
    lines: list[str]
    blocks: list[Block]
    defs: list[Def]

    def fail(self, index: int, message: str) -> MarkerError:
        return MarkerError(f"{self.path}:{index + 1}: {message}")


def _is_jit(node: ast.AST) -> bool:
    for d in getattr(node, "decorator_list", []):
        d = d.func if isinstance(d, ast.Call) else d
        if (isinstance(d, ast.Attribute) and d.attr == "jit") or (isinstance(d, ast.Name) and d.id == "jit"):
            return True
    return False


def find_defs(tree: ast.Module, lines: list[str]) -> list[Def]:
    """Every def and class, outermost first; each spans its decorators and trailing END marker lines."""
    out: list[Def] = []

    def extent(node: ast.AST) -> int:
        last = i = node.end_lineno - 1
        while i + 1 < len(lines) and (not lines[i + 1].strip() or MARKER.match(lines[i + 1].rstrip("\r\n"))):
            i += 1
            if lines[i].strip():
                m = MARKER.match(lines[i].rstrip("\r\n"))
                if m.group("edge") != "END" or len(m.group("indent")) <= node.col_offset:
                    break
                last = i
        return last

    def walk(parent: ast.AST, prefix: str) -> None:
        for node in ast.iter_child_nodes(parent):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
                d = Def(node, prefix + node.name, first, extent(node), not isinstance(node, ast.ClassDef),
                        isinstance(parent, (ast.Module, ast.ClassDef)), _is_jit(node))
                out.append(d)
                walk(node, d.qualname + ".")
            else:
                walk(node, prefix)

    walk(tree, "")
    return out


def parse(source: str, path: Path | str = "<string>") -> Parsed:
    """Find and check every block of ``source``; ``MarkerError`` with file:line on any misuse."""
    lines = source.splitlines(keepends=True)
    parsed = Parsed(str(path), lines, [], [])
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i].rstrip("\r\n"))
        if not m:
            if LOOKS_LIKE_MARKER.search(lines[i]):
                raise parsed.fail(i, f"malformed marker {lines[i].strip()!r}: write '# BEGIN SOLUTION <hint>', "
                                     "'# END SOLUTION', '# BEGIN PROMPT', '# BEGIN SCAFFOLD' … exactly")
            i += 1
            continue
        kind, indent, hint = m.group("kind"), m.group("indent"), m.group("hint").strip()
        if m.group("edge") == "END":
            raise parsed.fail(i, f"'# END {kind}' without a matching '# BEGIN {kind}'")
        j = i + 1
        while j < len(lines):
            inner = MARKER.match(lines[j].rstrip("\r\n"))
            if inner and inner.group("edge") == "END" and inner.group("kind") == kind:
                break
            if inner:
                raise parsed.fail(j, f"nested '# {inner.group('edge')} {inner.group('kind')}' inside the "
                                     f"'# BEGIN {kind}' block opened at line {i + 1}: blocks do not nest")
            j += 1
        if j == len(lines):
            raise parsed.fail(i, f"'# BEGIN {kind}' is never closed by '# END {kind}'")
        if MARKER.match(lines[j].rstrip("\r\n")).group("indent") != indent:
            raise parsed.fail(j, f"'# END {kind}' must sit at the indentation of its '# BEGIN {kind}' (line {i + 1})")
        parsed.blocks.append(Block(kind, i, j, indent, hint))
        i = j + 1
    _pair_prompts(parsed)
    try:
        parsed.defs = find_defs(ast.parse(source), lines)
    except SyntaxError as exc:
        raise MarkerError(f"{path}:{exc.lineno}: not valid Python: {exc.msg}") from None
    for block in parsed.blocks:
        _check_block(parsed, block)
        if block.prompt:
            _check_block(parsed, block.prompt)
    return parsed


def code_lines(parsed: Parsed, block: Block) -> list[int]:
    return [k for k in range(block.begin + 1, block.end)
            if parsed.lines[k].strip() and not parsed.lines[k].lstrip().startswith("#")]


def innermost_function(parsed: Parsed, line: int) -> Def | None:
    inside = [d for d in parsed.defs if d.is_function and d.node.lineno - 1 < line <= d.last]
    return max(inside, key=lambda d: d.first, default=None)


def _check_block(parsed: Parsed, block: Block) -> Block:
    code = code_lines(parsed, block)
    where = f"'# BEGIN {block.kind}'"
    if block.kind == "PROMPT":
        if block.hint:
            raise parsed.fail(block.begin, f"{where} takes no text: its lines are the prompt")
        for k in range(block.begin + 1, block.end):
            text = parsed.lines[k]
            if text.strip() and (not text.startswith(block.indent) or not text.lstrip().startswith("#")):
                raise parsed.fail(k, "prompt lines are comments in the reference, at or right of the marker: "
                                     "'# text' stays a comment in the stub, '#> code' becomes code")
        if not any(parsed.lines[k].strip() for k in range(block.begin + 1, block.end)):
            raise parsed.fail(block.begin, f"{where}: empty prompt")
        function = innermost_function(parsed, block.begin)
        block.function = function.qualname if function else "<module>"
        return block
    if not code:
        raise parsed.fail(block.begin, f"{where} holds no code")
    if any(not parsed.lines[k].startswith(block.indent) for k in code):
        raise parsed.fail(code[0], f"code in the {where} block (line {block.begin + 1}) is left of its marker")
    function = innermost_function(parsed, code[0])
    block.function = function.qualname if function else "<module>"
    if block.kind == "SOLUTION":
        if not block.hint:
            raise parsed.fail(block.begin, "'# BEGIN SOLUTION' needs a hint after it, e.g. "
                                           "'# BEGIN SOLUTION compute the online softmax (handout 03 §2)'")
        if function is None:
            raise parsed.fail(block.begin, "solution blocks must sit inside a function body")
    elif function is not None and not block.hint:
        raise parsed.fail(block.begin, "'# BEGIN SCAFFOLD' inside a function needs a hint: the open level "
                                       "replaces the rest of the function with a stub that says it")
    return block


def _pair_prompts(parsed: Parsed) -> None:
    """Attach each PROMPT to the SOLUTION right after it; drop PROMPTs from the block list."""
    kept: list[Block] = []
    pending: Block | None = None
    for block in parsed.blocks:
        if pending is not None:
            between = parsed.lines[pending.end + 1:block.begin]
            if block.kind != "SOLUTION" or block.indent != pending.indent or any(t.strip() for t in between):
                raise parsed.fail(pending.begin, "a PROMPT block must be followed directly by the "
                                                 "'# BEGIN SOLUTION' block it belongs to (same indentation, "
                                                 "only blank lines between)")
            block.prompt, pending = pending, None
        if block.kind == "PROMPT":
            pending = block
        else:
            kept.append(block)
    if pending is not None:
        raise parsed.fail(pending.begin, "a PROMPT block must be followed directly by its '# BEGIN SOLUTION' block")
    parsed.blocks = kept
