"""The marker language (instructor/stubs.py): SOLUTION, PROMPT and SCAFFOLD blocks, the two levels, and the checks
that stop a broken stub from shipping — names left undefined, markers misused, stub kernels that would
fail on a GPU with an unrelated compiler error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from instructor import release
from instructor.stubs import MarkerError, render

ROOT = Path(__file__).resolve().parents[2]


def _src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


# ------------------------------------------------------------------------------ names left undefined


def test_name_bound_in_a_block_and_used_after_it_fails_with_file_and_line():
    source = _src('''
        def run(xs):
            """Sum and count."""
            total = 0
            # BEGIN SOLUTION add them up (handout 09 §1)
            for x in xs:
                total += x
            peak = max(xs)
            # END SOLUTION
            return total, peak
        ''')
    with pytest.raises(MarkerError) as info:
        render(source, "reference/x.py")
    message = str(info.value)
    assert "reference/x.py:9:" in message and "'peak'" in message, message  # line 9: `return total, peak`
    assert "'total'" not in message, "total is bound before the block: the stub may use it"


def test_name_rebound_after_the_block_is_still_caught():
    """``y`` is local (assigned after the block too), so only a flow check sees it read unbound."""
    source = _src('''
        def f(x):
            # BEGIN SOLUTION compute y (handout 09 §1)
            y = 2 * x
            # END SOLUTION
            if x:
                y = y + 1
            return y
        ''')
    with pytest.raises(MarkerError, match=r"reference/x.py:6: 'y' is bound only inside the solution block"):
        render(source, "reference/x.py")


def test_the_reference_generates_at_both_levels_without_undefined_names():
    for level in release.LEVELS:
        files = release.render_student(level=level)
        assert files, level


# ------------------------------------------------------------------------------ PROMPT


PROMPTED = _src('''
    def run(order, step):
        """Run every op."""
        busy = 0.0
        # BEGIN PROMPT
        # for op in order:  (a comment stays a comment)
        #> timing = ...  # real code in the stub
        #>     # deeper
        # END PROMPT
        # BEGIN SOLUTION run the ops in order (handout 09 §2)
        timing = sum(step(op) for op in order)
        # END SOLUTION
        return busy + timing
    ''')


def test_prompt_appears_only_in_the_stub_right_before_its_raise():
    stub = render(PROMPTED, "reference/x.py").text
    lines = stub.splitlines()
    at = lines.index('    raise NotImplementedError("run: run the ops in order (handout 09 §2)")')
    assert lines[at - 3:at] == ["    # for op in order:  (a comment stays a comment)",
                                "    timing = ...  # real code in the stub", "        # deeper"]
    assert "BEGIN" not in stub and "END" not in stub and "sum(step(op)" not in stub
    namespace: dict = {}
    exec(compile(PROMPTED, "<reference>", "exec"), namespace)
    assert namespace["run"]([1, 2], lambda op: op) == 3.0, "the reference never runs its prompt"


SOL = "    # BEGIN SOLUTION s\n    pass\n    # END SOLUTION\n"


@pytest.mark.parametrize("source, message", [
    ("def f():\n    # BEGIN PROMPT\n    # hi\n    # END PROMPT\n    x = 1\n", "followed directly by"),
    ("def f():\n    # BEGIN PROMPT\n    # hi\n    # END PROMPT\n", "followed directly by"),
    ("def f():\n    # BEGIN PROMPT\n    x = 1\n    # END PROMPT\n" + SOL, "prompt lines are comments"),
    ("def f():\n    if 1:\n        # BEGIN PROMPT\n        # hi\n        # END PROMPT\n        pass\n" + SOL,
     "followed directly by"),
    ("def f():\n    # BEGIN PROMPT\n    # a\n    # END PROMPT\n    # BEGIN PROMPT\n    # b\n    # END PROMPT\n" + SOL,
     "followed directly by"),
    ("def f():\n    # END PROMPT\n", "without a matching"),
    ("def f():\n    # BEGIN PROMPT text\n    # a\n    # END PROMPT\n" + SOL, "takes no text"),
    ("def f():\n    # BEGIN SOLUTION s\n    # BEGIN PROMPT\n    # END PROMPT\n    pass\n    # END SOLUTION\n",
     "nested"),
])
def test_prompt_misuse_is_reported_with_its_line(source, message):
    with pytest.raises(MarkerError, match=rf"reference/x.py:\d+: .*{message}"):
        render(source, "reference/x.py")


def test_misspelt_markers_are_errors_not_silent_leaks():
    with pytest.raises(MarkerError, match="reference/x.py:2: malformed marker"):
        render("def f():\n    # BEGIN SOLUTON typo\n    return 1\n    # END SOLUTION\n", "reference/x.py")


# ------------------------------------------------------------------------------ SCAFFOLD and the open level


SCAFFOLDED = _src('''
    def check(n):
        if n < 1:
            raise ValueError("n must be ≥ 1")


    class Counter:
        """Counts things."""

        def __init__(self, n):
            check(n)
            self.n = n
            # BEGIN SCAFFOLD keep a count per slot; hook whatever you need (handout 09 §3)
            self._slots = [0] * n
            # END SCAFFOLD
            # BEGIN SOLUTION register the hooks (handout 09 §3)
            self._hooked = True
            # END SOLUTION

        def add(self, k):
            """Count one thing in slot k."""
            # BEGIN SOLUTION bump the slot (handout 09 §3)
            self._bump(k)
            # END SOLUTION

        def _bump(self, k):
            # BEGIN SOLUTION the reference's private design
            self._slots[k] += 1
            # END SOLUTION

        # BEGIN SCAFFOLD
        # --- Given: helpers the guided level hands over
        def _total(self):
            return sum(self._slots)
        # END SCAFFOLD

        def total(self):
            """All things counted."""
            # BEGIN SCAFFOLD the sum over every slot
            return self._total()
            # END SCAFFOLD
    ''')


def test_guided_level_keeps_scaffolding_and_stubs_solutions():
    stub = render(SCAFFOLDED, "reference/x.py", "guided").text
    assert "self._slots = [0] * n" in stub and "def _total(self):" in stub and "return self._total()" in stub
    assert 'raise NotImplementedError("Counter.__init__: register the hooks (handout 09 §3)")' in stub
    assert 'raise NotImplementedError("Counter._bump: the reference\'s private design")' in stub
    assert "SCAFFOLD" not in stub


def test_open_level_keeps_the_public_api_and_argument_checks_only():
    stub = render(SCAFFOLDED, "reference/x.py", "open").text
    assert "_slots" not in stub and "_bump" not in stub and "_total" not in stub and "Given:" not in stub
    assert "        check(n)\n        self.n = n\n        raise NotImplementedError(" \
           '"Counter.__init__: keep a count per slot; hook whatever you need (handout 09 §3)")' in stub, stub
    assert 'raise NotImplementedError("Counter.total: the sum over every slot")' in stub
    assert '"""Count one thing in slot k."""' in stub and 'raise ValueError("n must be ≥ 1")' in stub
    compile(stub, "<open>", "exec")


def test_open_level_reports_a_public_function_that_needs_a_removed_private_one():
    source = _src('''
        class _Impl:
            def go(self):
                # BEGIN SOLUTION go
                return 1
                # END SOLUTION


        def go():
            """Public."""
            return _Impl().go()
        ''')
    assert "_Impl().go()" in render(source, "reference/x.py", "guided").text
    with pytest.raises(MarkerError, match=r"reference/x.py:10: '_Impl' is used .* mark the use as SCAFFOLD"):
        render(source, "reference/x.py", "open")


def test_scaffold_inside_a_function_needs_a_hint():
    with pytest.raises(MarkerError, match="reference/x.py:2: '# BEGIN SCAFFOLD' inside a function needs a hint"):
        render("def f():\n    # BEGIN SCAFFOLD\n    return 1\n    # END SCAFFOLD\n", "reference/x.py")


# ------------------------------------------------------------------------------ headers and the release builder


def test_only_files_with_stubs_say_your_work_goes_here():
    files = release.render_student()
    work = {str(p) for p, data in files.items() if data.startswith(release.GENERATED_HEADER.encode())}
    given = {str(p) for p, data in files.items() if data.startswith(release.GIVEN_HEADER.encode())}
    assert "benchmarking.py" in work and "parallel/pipeline_parallel.py" in work
    assert {"flash_attention/checks.py", "flash_attention/api.py", "__init__.py"} <= given
    for path in work | given:
        assert (b"raise NotImplementedError(" in files[Path(path)]) == (path in work), path


def test_make_student_refuses_to_run_without_the_reference(tmp_path):
    (tmp_path / "student").mkdir()
    (tmp_path / "student" / "mine.py").write_text("x = 1  # a student's work\n")
    with pytest.raises(FileNotFoundError, match="reference"):
        release.write_student(tmp_path / "reference", tmp_path / "student")
    assert (tmp_path / "student" / "mine.py").exists(), "the student's work must survive"


def test_abstract_base_methods_are_not_stubs():
    import reference.ddp as ddp

    assert getattr(ddp.DataParallelBase.finish_gradient_synchronization, "__isabstractmethod__", False)
    assert "must implement finish_gradient_synchronization" not in (ROOT / "student" / "ddp.py").read_text()


# ------------------------------------------------------------------------------ stub kernels


KERNEL = _src('''
    import triton
    import triton.language as tl


    @triton.jit
    def _inner(x, BLOCK: tl.constexpr):
        """Given helper's docstring."""
        # BEGIN SOLUTION scale the tile (handout 09 §5)
        return x * 2
        # END SOLUTION


    @triton.jit
    def scale_kernel(X, N, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < N)
        tl.store(X + offs, _inner(x, BLOCK), mask=offs < N)
    ''')

COMPILE = r"""
import importlib, os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

module = importlib.import_module(sys.argv[1])
pointers = sys.argv[2].split(",")
for name in sys.argv[3:]:
    kernel = getattr(module, name)
    # A stub's body fails before any argument is used, so these types and constexpr values do.
    signature = {p.name: "constexpr" if p.is_constexpr else "*fp32" if p.name in pointers else "i32"
                 for p in kernel.params}
    constexprs = {(i,): 16 for i, p in enumerate(kernel.params) if p.is_constexpr}
    try:
        triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        print(f"COMPILED {name}")
    except Exception as exc:
        chain = []
        while exc is not None:
            chain.append(str(exc))
            exc = exc.__cause__
        print(f"FAILED {name}: " + " <- ".join(chain).replace("\n", " "))
"""


def _compile_for_sm90(tmp_path: Path, package_root: Path, module: str, names: list[str], pointers: str = "") -> str:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"),
           "PYTHONPATH": str(package_root) + os.pathsep + str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", COMPILE, module, pointers, *names], cwd=package_root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_stub_kernel_fails_to_compile_for_a_gpu_with_the_stub_message(tmp_path):
    """On a GPU a ``raise`` in a kernel is an "unsupported AST node" error; the stub says what to do instead."""
    stub = render(KERNEL, "reference/kern.py").text
    assert "tl.static_assert(False, " in stub
    (tmp_path / "stubkern.py").write_text(stub)
    out = _compile_for_sm90(tmp_path, tmp_path, "stubkern", ["_inner", "scale_kernel"], pointers="X")
    for name in ("_inner", "scale_kernel"):
        line = next(line for line in out.splitlines() if line.startswith(("FAILED " + name, "COMPILED " + name)))
        assert line.startswith("FAILED"), line
        assert "NotImplementedError: _inner: scale the tile (handout 09 §5)" in line, line
        assert "unsupported AST node" not in line, line
    (tmp_path / "refkern.py").write_text(KERNEL)
    assert "COMPILED scale_kernel" in _compile_for_sm90(tmp_path, tmp_path, "refkern", ["scale_kernel"], "X"), \
        "the reference kernel itself must compile: the failure above is the stub's"


def test_stub_kernel_raises_not_implemented_in_the_interpreter(tmp_path):
    (tmp_path / "stubkern2.py").write_text(render(KERNEL, "reference/kern.py").text)
    script = ("import kit, torch, stubkern2\n"
              "stubkern2.scale_kernel[(1,)](torch.zeros(16), 16, BLOCK=16)\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(tmp_path) + os.pathsep + str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "NotImplementedError: _inner: scale the tile (handout 09 §5)" in proc.stderr, proc.stderr[-3000:]


def test_the_student_flash_kernels_fail_on_a_gpu_with_their_messages(tmp_path):
    """The real stubs: every stub kernel of student/flash_attention compiled for sm_90 names its own task."""
    from instructor.stubs import parse

    for module in ("triton_forward", "triton_backward"):
        parsed = parse((ROOT / "reference" / "flash_attention" / f"{module}.py").read_text())
        stubbed = sorted({b.function for b in parsed.blocks if b.kind == "SOLUTION"}
                         & {d.qualname for d in parsed.defs if d.jit})
        assert stubbed, module
        out = _compile_for_sm90(tmp_path, ROOT, f"student.flash_attention.{module}", stubbed)
        for name in stubbed:
            line = next(line for line in out.splitlines() if line.split(":")[0].split()[-1] == name)
            assert line.startswith("FAILED") and f"NotImplementedError: {name}: " in line, line
