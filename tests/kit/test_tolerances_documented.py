"""Every tolerance in the graded suite says where it comes from (issue 38, "Derived tolerances everywhere").

A tolerance tuned on one CPU fails a correct submission on another (AVX2 vs AVX-512 vs generic BLAS, ARM: each sums
in its own order), and one picked loose lets a catalogued mistake through. So each numeric ``rtol=`` / ``atol=`` in
``tests/test_stage*.py`` and ``tests/hidden/*.py`` is derived from the computation it checks — the number and kind
of terms summed in another order, the dtype's unit roundoff, what an optimizer does to a difference — and the
derivation is written next to it: a ``#`` comment on the call's lines or within the
:data:`LINES_ABOVE` lines above it, or in the enclosing function's docstring (naming the tolerance).

This test only checks that a derivation is *there* (it cannot judge one): parsing, no implementation, no worker.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GRADED = sorted([*ROOT.glob("tests/test_stage*.py"), *ROOT.glob("tests/hidden/*.py")])
LINES_ABOVE = 8  # how far above a call its derivation may sit (a comment block over a few related calls)
TOLERANCE_WORDS = ("tol", "tolerance", "ulp", "roundoff", "rounding")  # a docstring that derives one says so


def _comment_lines(source: str) -> set[int]:
    """The 1-based line numbers that hold a ``#`` comment (tokenize's, so a ``#`` inside a string is not one)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {tok.start[0] for tok in tokens if tok.type == tokenize.COMMENT}


def _numeric_tolerance(call: ast.Call, source: str) -> str | None:
    """``"rtol=1e-05"`` for the first nonzero numeric literal passed as rtol= / atol=, else None. Names and
    expressions (``atol=ESTIMATE_ATOL_BYTES``, ``rtol=8 * t * U32``) are derived where they are defined."""
    for kw in call.keywords:
        if kw.arg not in ("rtol", "atol"):
            continue
        value = kw.value.operand if isinstance(kw.value, ast.UnaryOp) else kw.value
        if (isinstance(value, ast.Constant) and isinstance(value.value, (int, float))
                and not isinstance(value.value, bool) and value.value != 0):
            return f"{kw.arg}={ast.get_source_segment(source, kw.value)}"
    return None


def _undocumented(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: call (rtol=…)`` for each call in ``path`` with a numeric tolerance and no derivation near it."""
    source = path.read_text()
    comments = _comment_lines(source)
    found = []

    def visit(node: ast.AST, docstring: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node) or ""
        if isinstance(node, ast.Call) and (tolerance := _numeric_tolerance(node, source)):
            near = range(node.lineno - LINES_ABOVE, (node.end_lineno or node.lineno) + 1)
            documented = any(line in comments for line in near) or any(
                word in docstring.lower() for word in TOLERANCE_WORDS)
            if not documented:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node.func)}(…, {tolerance})")
        for child in ast.iter_child_nodes(node):
            visit(child, docstring)

    visit(ast.parse(source), "")
    return found


def test_graded_files_are_found():
    assert any(p.name.startswith("test_stage") for p in GRADED) and any(p.parent.name == "hidden" for p in GRADED)


def test_every_numeric_tolerance_says_how_it_is_derived():
    missing = [entry for path in GRADED for entry in _undocumented(path)]
    assert not missing, (
        f"{len(missing)} comparison(s) with a numeric rtol=/atol= and no derivation within {LINES_ABOVE} lines "
        "above (or in the function's docstring):\n  " + "\n  ".join(missing) + "\nSay how each tolerance is "
        "derived, in a comment above the call: what is computed in another order (how many terms, of what size), "
        "the dtype's unit roundoff (fp32 u = 2⁻²⁴, bf16 2⁻⁹), what an optimizer does to a difference — so a correct "
        "implementation passes on any CPU code path — and how far off the catalogued mistakes are. Examples: "
        "tests/test_stage6_parallel_alone.py; CONTRIBUTING.md, 'The judge and its workers; adding a test', step 1.")


def test_the_guard_finds_an_undocumented_tolerance(tmp_path):
    """The check itself: a bare tolerance is reported, a commented one and a docstring-derived one are not."""
    bare = tmp_path / "bare.py"
    bare.write_text("def test_a():\n    x = 1\n\n\n\n\n\n\n\n\n    assert_close(a, b, rtol=1e-5, atol=0)\n")
    commented = tmp_path / "commented.py"
    commented.write_text("def test_a():\n    # fp32, 8 terms reordered: 8·u ≈ 5e-7, rtol 1e-5 is 20× that\n"
                         "    assert_close(a, b, rtol=1e-5, atol=0)\n")
    docstring = tmp_path / "docstring.py"
    docstring.write_text('def test_a():\n    """The tolerance: 8 terms reordered."""\n'
                         "    assert_close(a, b, atol=1e-6)\n")
    exact = tmp_path / "exact.py"
    exact.write_text("def test_a():\n    assert_close(a, b, rtol=0, atol=0)\n    f(x, '# not a comment', atol=TOL)\n")
    assert _undocumented(bare, tmp_path) == ["bare.py:11: assert_close(…, rtol=1e-5)"]
    assert _undocumented(commented, tmp_path) == _undocumented(docstring, tmp_path) == []
    assert _undocumented(exact, tmp_path) == []
