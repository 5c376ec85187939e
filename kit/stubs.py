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

from kit.namecheck import read_before_bound, scope_names, undefined_names

LEVELS = ("guided", "open")
KINDS = ("SOLUTION", "PROMPT", "SCAFFOLD")
MARKER = re.compile(r"^(?P<indent>[ \t]*)# (?P<edge>BEGIN|END) (?P<kind>SOLUTION|PROMPT|SCAFFOLD)(?P<hint>(?:\s.*)?)$")
LOOKS_LIKE_MARKER = re.compile(r"#\s*(BEGIN|END)\b|(?i:#\s*(begin|end)\s*(solu|prom|scaf))")
JIT_GUARD = "if not triton.knobs.runtime.interpret:  # compiled for a GPU: fail to compile, with this message"


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


def _defs(tree: ast.Module, lines: list[str]) -> list[Def]:
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
        parsed.defs = _defs(ast.parse(source), lines)
    except SyntaxError as exc:
        raise MarkerError(f"{path}:{exc.lineno}: not valid Python: {exc.msg}") from None
    for block in parsed.blocks:
        _check_block(parsed, block)
        if block.prompt:
            _check_block(parsed, block.prompt)
    return parsed


def _code_lines(parsed: Parsed, block: Block) -> list[int]:
    return [k for k in range(block.begin + 1, block.end)
            if parsed.lines[k].strip() and not parsed.lines[k].lstrip().startswith("#")]


def _innermost_function(parsed: Parsed, line: int) -> Def | None:
    inside = [d for d in parsed.defs if d.is_function and d.node.lineno - 1 < line <= d.last]
    return max(inside, key=lambda d: d.first, default=None)


def _check_block(parsed: Parsed, block: Block) -> Block:
    code = _code_lines(parsed, block)
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
        function = _innermost_function(parsed, block.begin)
        block.function = function.qualname if function else "<module>"
        return block
    if not code:
        raise parsed.fail(block.begin, f"{where} holds no code")
    if any(not parsed.lines[k].startswith(block.indent) for k in code):
        raise parsed.fail(code[0], f"code in the {where} block (line {block.begin + 1}) is left of its marker")
    function = _innermost_function(parsed, code[0])
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
            jit = _innermost_function(parsed, _code_lines(parsed, block)[0]).jit
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
        code = _code_lines(parsed, block)
        function = _innermost_function(parsed, code[0])
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
    stub_defs = _defs(ast.parse(stub.text), [t for t, _ in stub.lines])
    problems = []
    for block, at in stub.raises:
        function = _innermost_function(parsed, _code_lines(parsed, block)[0])
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
