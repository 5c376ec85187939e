"""The marker language of ``reference/`` and the stubs it generates, at two levels.

Markers are comment lines, each on its own line; blocks never nest and END sits at its BEGIN's indentation.

``# BEGIN SOLUTION <hint>`` … ``# END SOLUTION``
    Solution code, inside a function body. The stub gets, at the marker's indentation,
    ``raise NotImplementedError("<qualified function name>: <hint>")``. The hint is required: it is the
    first thing a student reads. Inside a ``@triton.jit`` body the stub also carries
    ``tl.static_assert(False, …)`` behind ``if not triton.knobs.runtime.interpret:``, so compiling a stub
    kernel for a GPU fails with the stub's message (the interpreter runs the plain ``raise``).

``# BEGIN PROMPT`` … ``# END PROMPT``
    Starter code that appears only in the stub, in place of the solution: a PROMPT block belongs to
    the SOLUTION block that follows it directly (same indentation, nothing but blank lines between)
    and is emitted just before that block's ``raise``. In the reference every prompt line is a
    comment, so the reference never runs it: ``# text`` stays a comment in the stub, ``#> code``
    becomes ``code`` (the ``#>`` and one space removed). Prompt code runs before the ``raise``: keep
    it free of side effects (loops over ``...``, names bound to given values).

``# BEGIN SCAFFOLD [hint]`` … ``# END SCAFFOLD``
    Given internal structure (buffers, bookkeeping, private helpers) that the guided level hands over
    and the open level leaves to the student. Guided: the markers vanish, the code stays.

Levels. **guided** (the default, what ``student/`` holds): the above. **open**: only the public API —
classes, public functions and methods, signatures, docstrings and the given argument checks.
Module- and class-level SCAFFOLD blocks are removed; a private (``_name``) function, method or class
that contains a SOLUTION block is removed (it is the reference's internal design); and every other
function holding a block keeps what comes before its first block (docstring, argument checks) and
ends in one ``raise`` carrying that first block's hint — so a SCAFFOLD block inside a function needs
a hint, and is where the open-level stub starts.

Every stub is then checked for names that are used but no longer defined (a name bound inside a
removed block and used after it); errors name the reference file and line.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from instructor.markers import Block, MarkerError, Parsed, code_lines, find_defs, innermost_function, parse
from instructor.namecheck import read_before_bound, scope_names, undefined_names

__all__ = ["LEVELS", "MarkerError", "Stub", "parse", "render"]

LEVELS = ("guided", "open")
JIT_GUARD = "if not triton.knobs.runtime.interpret:  # compiled for a GPU: fail to compile, with this message"


def _message(function: str, hint: str) -> str:
    return f"{function}: {hint}".replace("\\", "\\\\").replace('"', '\\"')


def _stub(indent: str, message: str, jit: bool) -> list[str]:
    lines = [f'{indent}raise NotImplementedError("{message}")\n']
    if jit:
        lines[:0] = [f"{indent}{JIT_GUARD}\n",
                     f'{indent}    tl.static_assert(False, "NotImplementedError: {message}")\n']
    return lines


def _prompt_lines(parsed: Parsed, prompt: Block) -> list[tuple[str, int]]:
    out = []
    for k in range(prompt.begin + 1, prompt.end):
        text = parsed.lines[k]
        stripped = text.lstrip()
        if stripped.startswith("#>"):
            code = stripped[2:]
            text = text[: len(text) - len(stripped)] + (code[1:] if code.startswith(" ") else code.lstrip(" "))
        out.append((text, k))
    return out


@dataclass
class Stub:
    """A generated file: ``lines`` as ``(text, reference line index or None)``; ``stubs``: raises emitted;
    ``raises``: each SOLUTION block and the index in ``lines`` of its ``raise`` (guided level)."""

    lines: list[tuple[str, int | None]]
    stubs: int
    raises: list[tuple[Block, int]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.lines)


def _guided(parsed: Parsed) -> Stub:
    by_begin = {b.start: b for b in parsed.blocks}
    out: list[tuple[str, int | None]] = []
    raises: list[tuple[Block, int]] = []
    i = 0
    while i < len(parsed.lines):
        block = by_begin.get(i)
        if block is None:
            out.append((parsed.lines[i], i))
            i += 1
        elif block.kind == "SCAFFOLD":
            out += [(parsed.lines[k], k) for k in range(block.begin + 1, block.end)]
            i = block.end + 1
        else:
            if block.prompt:
                out += _prompt_lines(parsed, block.prompt)
            jit = innermost_function(parsed, code_lines(parsed, block)[0]).jit
            out += [(t, block.begin) for t in _stub(block.indent, _message(block.function, block.hint), jit)]
            raises.append((block, len(out) - 1))
            i = block.end + 1
    return Stub(out, len(raises), raises)


def _open(parsed: Parsed) -> Stub:
    """Remove scaffolding and private designs; cut each function at its first block (see the module doc)."""
    removed: list[tuple[int, int]] = []  # inclusive line spans
    cuts: dict[int, tuple[int, list[str]]] = {}  # first line -> (last line, stub lines)

    def covered(line: int) -> bool:
        return any(a <= line <= b for a, b in removed) or any(a <= line <= b for a, (b, _) in cuts.items())

    for d in parsed.defs:  # outermost first
        if d.top and d.private and not covered(d.first) and any(
                b.kind == "SOLUTION" and d.first <= b.begin <= d.last for b in parsed.blocks):
            removed.append((d.first, d.last))
    for block in sorted(parsed.blocks, key=lambda b: b.start):
        if covered(block.start):
            continue
        code = code_lines(parsed, block)
        function = innermost_function(parsed, code[0])
        if function is None:
            removed.append((block.begin, block.end))
            continue
        start = block.start
        for stmt in function.node.body:  # cut at the body-level statement that holds the block
            if stmt.lineno - 1 <= block.start <= stmt.end_lineno - 1:
                start = stmt.lineno - 1
        indent = re.match(r"[ \t]*", parsed.lines[function.node.body[0].lineno - 1]).group()
        cuts[start] = (function.last, _stub(indent, _message(function.qualname, block.hint), function.jit))
    out: list[tuple[str, int | None]] = []
    i = 0
    while i < len(parsed.lines):
        if i in cuts:
            last, stub = cuts[i]
            out += [(t, i) for t in stub]
            i = last + 1
        elif any(a <= i <= b for a, b in removed):
            i = next(b for a, b in removed if a <= i <= b) + 1
        else:
            out.append((parsed.lines[i], i))
            i += 1
    return Stub(_squeeze_blank_lines(out), len(cuts))


def _squeeze_blank_lines(lines: list[tuple[str, int | None]]) -> list[tuple[str, int | None]]:
    """Where code was removed: at most two blank lines before top-level code, one before indented code."""
    out: list[tuple[str, int | None]] = []
    blank: list[tuple[str, int | None]] = []
    for item in lines:
        if not item[0].strip():
            blank.append(item)
            continue
        out += blank[: 1 if item[0][:1] in " \t" else 2]
        blank = []
        out.append(item)
    return out + blank[:1]


def render(source: str, path: Path | str = "<string>", level: str = "guided", *, header: str = "",
           stub_path: str | None = None) -> Stub:
    """The stub of one reference module at ``level``, checked: it compiles and uses no undefined name."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    parsed = parse(source, path)
    stub = _guided(parsed) if level == "guided" else _open(parsed)
    stub.lines[:0] = [(line, None) for line in header.splitlines(keepends=True)]
    stub.raises = [(block, at + len(header.splitlines())) for block, at in stub.raises]
    text = stub.text
    shown = stub_path or f"the {level} stub of {path}"
    try:
        ast.parse(text)
    except SyntaxError as exc:
        ref = stub.lines[exc.lineno - 1][1] if exc.lineno and exc.lineno <= len(stub.lines) else None
        where = f"{path}:{ref + 1}" if ref is not None else str(path)
        raise MarkerError(f"{where}: {shown} is not valid Python at its line {exc.lineno}: {exc.msg}") from None
    problems = []
    undefined = undefined_names(text, shown)
    for line, name in undefined:
        ref = stub.lines[line - 1][1]
        problems.append(f"{path}:{(ref or 0) + 1}: {name!r} is used in {shown} (line {line}) but nothing in it "
                        f"defines it: only code that the {level} level removes binds it. Bind it in given code "
                        "before the block, move its use into the block, or mark the use as SCAFFOLD.")
    problems += _unbound_after_blocks(parsed, stub, shown, {name for _, name in undefined})
    if problems:
        raise MarkerError("\n".join(problems))
    return stub


def _unbound_after_blocks(parsed: Parsed, stub: Stub, shown: str, reported: set[str]) -> list[str]:
    """Names a SOLUTION block binds that its function reads after the block without binding them before."""
    if not stub.raises:
        return []
    stub_defs = find_defs(ast.parse(stub.text), [t for t, _ in stub.lines])
    problems = []
    for block, at in stub.raises:
        function = innermost_function(parsed, code_lines(parsed, block)[0])
        binds, _ = scope_names(function.node)
        inside = {name for line, name in binds if block.begin + 1 < line < block.end + 1} - reported
        in_stub = max((d for d in stub_defs if d.is_function and d.node.lineno - 1 < at <= d.last),
                      key=lambda d: d.first)
        for line, name in read_before_bound(in_stub.node, at + 1, inside):
            ref = stub.lines[line - 1][1]
            problems.append(f"{parsed.path}:{ref + 1}: {name!r} is bound only inside the solution block of "
                            f"{block.function} (line {block.begin + 1}) and read after it, so {shown} (line "
                            f"{line}) reads it unbound. Bind it in given code before the block (a PROMPT "
                            "'#> name = ...' works), or move its use into the block.")
    return problems
