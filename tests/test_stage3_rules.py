"""Stage 3's rules: the student builds FlashAttention-2 twice — in PyTorch and in Triton — and PyTorch's own
attention may not do that work for them (handout 03, What is graded).

``FlashAttentionTriton`` calling ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward gives the
right numbers; with a decoy ``@triton.jit`` kernel launched beside it (one that copies the log-sum-exp, or every
output) it also passes the tests that look for launched kernels. Only these rules tell it from the real thing:

* **sdpa**: ``FlashAttentionPytorch``, forward and backward, causal and not, every dtype, on the behaviour tests'
  shapes and a larger one, watched by :func:`kit.grading.library_rules.watch`: no call of
  ``F.scaled_dot_product_attention`` from the submission and no SDPA ATen kernel dispatched; the judge also reads
  ``pytorch_impl.py`` for calls of them.
* **triton-attention**: ``FlashAttentionTriton`` in the same runs, watched: no PyTorch matmul, softmax,
  log-sum-exp or attention op may be dispatched, SDPA's included (the reference dispatches none, at any of these
  sizes); and o,
  dq, dk and dv must each be **written** by a launched kernel that does the matrix work. "Written" is measured,
  not guessed from the arguments: the worker compares the bytes of every tensor a launch received before and
  after it, and follows copies, casts, sums and scaling in PyTorch from a written tensor to the graded one
  (:class:`~tests.support.lineage.Lineage`). "The matrix work": the kernel's source, or a ``@triton.jit``
  function it calls, calls ``tl.dot`` — what puts ``tt.dot`` in its IR — or it executed one (the interpreter), or
  its compiled IR holds
  ``tt.dot`` (a GPU). A decoy that copies a result computed elsewhere writes it, but multiplies nothing.
  (Attention computed by PyTorch without any matmul op — broadcast products and sums — escapes the op watch;
  the writer check still sees it.) An output no kernel visibly wrote but a multiplying kernel received is a
  bug (an empty loop, a tile never stored), which the behaviour tests report: not held against the rule.

:mod:`tests.support.rules` adds the reading of the source and, when a rule is broken, fails every test marked
``builds("sdpa")`` or ``builds("triton-attention")`` with the same message.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import pytest
import torch

import kit  # noqa: F401 — before triton: the interpreter on machines without CUDA
import kit.impl
from kit.checks import skip_if_triton_missing
from kit.grading import library_rules
from kit.triton import triton_private
from tests.support import rules
from tests.support.flash_attention import BACKWARD_DESIGNS, backward_design, flash_class, run
from tests.support.lineage import Lineage
from tests.test_stage3_flash_attention import SHAPES, make_inputs

pytestmark = [
    pytest.mark.stage3,
    # triton 3.6's interpreter converts 1-element arrays with int(); numpy warns on every loop bound.
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

CLASSES = ("FlashAttentionPytorch", "FlashAttentionTriton")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The watched workload, forward and backward of each class: every dtype, causal and not, on the behaviour tests'
# shapes (a PyTorch path kept for the graded sizes would show), and every dtype on a larger input, N = 256 queries
# over 200 keys at D = 64 (no "small input" path hides it). The Triton backward designs take turns: each meets every
# dtype. Nine passes: ~3 s of the interpreter, where every case on every shape would take ~10.
LARGE = ((1, 2, 256, 64), (1, 2, 200, 64))
WATCHED_CASES = [case for d, dtype in enumerate(DTYPES)
                 for case in ((dtype, False, SHAPES[d % 2]), (dtype, True, SHAPES[(d + 1) % 2]),
                              (dtype, d % 2 == 0, LARGE))]
# What may stand between a kernel's stores and a graded output: copies, casts, concatenation, sums of partial
# results (a design may add per-tile partials of dQ in PyTorch) and elementwise scaling (O = acc / l, dK · 1/√D
# outside the kernel: allowed work, "What is graded"). Carried from a written tensor to the output only: an output
# computed in PyTorch and handed to a copy kernel is still written by that copy kernel alone.
CARRIES = frozenset({"_to_copy", "clone", "copy_", "copy", "_copy_from", "_copy_from_and_resize", "cat", "stack",
                     "sum", "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_"})
OUTPUTS = {"o": "O", "dq": "dQ", "dk": "dK", "dv": "dV"}
SECTION = "handout 03, What is graded"


# ----------------------------------------------------------------------------------------------------
# In the worker: the workload, watched and its writes recorded; data back
# ----------------------------------------------------------------------------------------------------


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of ``t`` (NaN-proof to compare)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _calls_dot(kernel, seen: set[int] | None = None) -> bool:
    """Whether the source of the ``@triton.jit`` function ``kernel``, or of a ``@triton.jit`` function it calls
    (``_fwd_inner``…), calls ``tl.dot`` (or ``tl.dot_scaled``): what puts ``tt.dot`` in its IR. Read, not run, so
    a kernel whose loop a bug leaves empty still counts: the behaviour tests report that bug, not this rule."""
    import ast
    import inspect
    import textwrap

    fn = kernel
    while hasattr(fn, "fn"):  # JITFunction / InterpretedFunction / Autotuner / Heuristics → the Python function
        fn = fn.fn
    seen = set() if seen is None else seen
    if id(fn) in seen or not inspect.isfunction(fn):
        return False
    seen.add(id(fn))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func, callee = node.func, None
        if isinstance(func, ast.Attribute):
            if func.attr in ("dot", "dot_scaled"):
                return True
            owner = fn.__globals__.get(func.value.id) if isinstance(func.value, ast.Name) else None
            callee = getattr(owner, func.attr, None) if inspect.ismodule(owner) else None
        elif isinstance(func, ast.Name):
            if func.id in ("dot", "dot_scaled"):
                return True
            callee = fn.__globals__.get(func.id)
        if callee is not None and hasattr(callee, "fn") and _calls_dot(callee, seen):
            return True
    return False


class _Writes:
    """What each kernel launch received and wrote, and whether the kernel multiplies matrices.

    Before a launch, a copy of the bytes of every storage it receives (``received[ptr]``: kernel names,
    ``module.qualname``); after it, the storages whose bytes differ were written by it (``written[ptr]``). Each
    run's inputs are drawn afresh, so no storage already holds what a correct kernel stores. ``dots[name]``: the
    kernel's source calls ``tl.dot`` (:func:`_calls_dot`), or it executed one (the interpreter, counted per launch),
    or its compiled IR holds ``tt.dot`` (a GPU)."""

    def __init__(self, dots_executed: list[int] | None) -> None:
        self.received: dict[int, set[str]] = {}
        self.written: dict[int, set[str]] = {}
        self.dots: dict[str, bool] = {}
        self.keep: list[Any] = []
        self._counter = dots_executed
        self._pending: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = []

    def before(self, kernel, named: dict, options: dict, grid) -> bool:
        name = f"{kernel.fn.__module__}.{kernel.fn.__qualname__}"
        tensors = {v.untyped_storage().data_ptr(): v for v in named.values() if isinstance(v, torch.Tensor)}
        self.keep += tensors.values()  # alive until the end: no later tensor gets their addresses
        for ptr in tensors:
            self.received.setdefault(ptr, set()).add(name)
        dots_so_far = self._counter[0] if self._counter is not None else 0
        self._pending.append((dots_so_far, [(t, _storage_bytes(t).clone()) for t in tensors.values()]))
        return True

    def after(self, kernel, named: dict) -> None:
        name = f"{kernel.fn.__module__}.{kernel.fn.__qualname__}"
        dots_before, snapshots = self._pending.pop()
        if not self.dots.get(name):
            if self._counter is not None:
                dotted = self._counter[0] > dots_before
            else:
                dotted = any(re.search(r"\btt\.dot(_scaled)?\b", ir) for ir in triton_private.compiled_ttir(kernel))
            self.dots[name] = dotted or _calls_dot(kernel)
        for t, old in snapshots:
            if not torch.equal(_storage_bytes(t), old):
                self.written.setdefault(t.untyped_storage().data_ptr(), set()).add(name)


def _tracked_run(fn, q, k, v, do, is_causal) -> dict:
    """A forward + backward of ``fn`` and, for each graded output, the kernels that wrote (``"o"``…) or received
    (``"o_received"``…) its storage or one it was carried from (:class:`~tests.support.lineage.Lineage`), and which
    launched kernels multiply matrices (``"dots"``)."""
    with contextlib.ExitStack() as stack:
        counter = stack.enter_context(triton_private.dots_counted()) if kit.triton_interpreted() else None
        writes, lineage = _Writes(counter), Lineage(CARRIES)
        stack.enter_context(triton_private.launches_intercepted(writes.before, writes.after))
        stack.enter_context(lineage)
        got = run(fn, q, k, v, do, is_causal, backward=True)
    record: dict[str, Any] = {"dots": writes.dots}
    for key, out in zip(OUTPUTS, (got["o"], *got["grads"])):
        ancestry = lineage.ancestry([out.untyped_storage().data_ptr()]) if isinstance(out, torch.Tensor) else set()
        record[key] = sorted({n for ptr in ancestry for n in writes.written.get(ptr, ())})
        record[f"{key}_received"] = sorted({n for ptr in ancestry for n in writes.received.get(ptr, ())})
    return record


def _watched_runs(name: str, writers: list[dict]) -> None:
    """Forward and backward of ``flash_attention.<name>`` on :data:`WATCHED_CASES`; for FlashAttentionTriton each
    run's writers (:func:`_tracked_run`) go to ``writers``."""
    fn = flash_class(name)
    for turn, (dtype, is_causal, (q_shape, kv_shape)) in enumerate(WATCHED_CASES):
        q, k, v, do = make_inputs(q_shape, kv_shape, dtype, seed=turn)
        if name != "FlashAttentionTriton":
            run(fn, q, k, v, do, is_causal, backward=True)
            continue
        design = BACKWARD_DESIGNS[turn % len(BACKWARD_DESIGNS)]
        with backward_design(design):
            record = _tracked_run(fn, q, k, v, do, is_causal)
        writers.append({"dtype": str(dtype).removeprefix("torch."), "causal": is_causal, "q": list(q_shape),
                        "design": design, **record})


def _attention_workload() -> dict:
    """Both classes under the sdpa watch, FlashAttentionTriton also under the triton-attention watch and with its
    writes recorded: ``{"sdpa": [violations], "triton-attention": [violations], "writers": [one per run],
    "errors": {class: what it raised}}``. A class that raises (a stub) keeps what was recorded until then."""
    found: dict[str, Any] = {"sdpa": [], "triton-attention": [], "writers": [], "errors": {}}
    for name in CLASSES:
        # Each class answers to its own rule, so SDPA in one class costs only that class's points: sdpa for the
        # PyTorch class; triton-attention (whose ops include SDPA's) for the Triton one.
        keys = ["triton-attention"] if name == "FlashAttentionTriton" else ["sdpa"]
        watches: list[library_rules.Watch] = []
        try:
            with contextlib.ExitStack() as stack:
                watches += [stack.enter_context(library_rules.watch([key])) for key in keys]
                _watched_runs(name, found["writers"])
        except Exception as exc:  # noqa: BLE001 — a stub or a bug: the behaviour tests report it
            found["errors"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        for key, seen in zip(keys, watches):
            found[key] += seen.as_data()
    return found


# ----------------------------------------------------------------------------------------------------
# The judges and the rule tests
# ----------------------------------------------------------------------------------------------------

_WATCHED: dict[str, dict] = {}


def watched(worker) -> dict:
    """:func:`_attention_workload`'s record for the implementation in force, once per session (both judges and
    the writer test read it)."""
    package = kit.impl.selected()
    if package not in _WATCHED:
        _WATCHED[package] = worker.call(_attention_workload)
    return _WATCHED[package]


def writer_violations(runs: list[dict]) -> list[dict]:
    """The triton-attention violations of the writers' record (:func:`_tracked_run`), one per graded output that in
    some run no launched kernel that multiplies matrices wrote (``dots``, :class:`_Writes`)."""
    dots: dict[str, bool] = {}
    for r in runs:
        for name, dotted in r["dots"].items():
            dots[name] = dots.get(name, False) or dotted

    def built(r: dict, key: str) -> bool:
        # A multiplying kernel wrote it; or none wrote it visibly (a bug left it unwritten, or wrote what was there)
        # and a multiplying kernel received it: the behaviour tests report that bug, not this rule.
        return any(dots.get(w) for w in r[key]) or (not r[key] and any(dots.get(w) for w in r[f"{key}_received"]))

    out = []
    for key, name in OUTPUTS.items():
        bad = [r for r in runs if not built(r, key)]
        if not bad:
            continue
        r, more = bad[0], f"; {len(bad) - 1} more of the {len(runs)} runs" if len(bad) > 1 else ""
        where = (f"{r['dtype']}, {'causal' if r['causal'] else 'not causal'}, q {tuple(r['q'])}, backward design "
                 f"{r['design']!r}{more}")
        section = "§5" if key == "o" else "§6"
        if r[key]:
            kernels = ", ".join(w.rsplit(".", 1)[-1] for w in r[key])
            they = "it has no tl.dot" if len(r[key]) == 1 else "they have no tl.dot"
            what = (f"{name} outside any kernel that multiplies matrices: only {kernels} wrote it, and {they} "
                    f"({where}). Store {name} from the kernel that computes it with tl.dot (handout 03 {section})")
        else:
            launched = ", ".join(sorted(w.rsplit(".", 1)[-1] for w in r["dots"])) or "none"
            what = (f"{name} outside any Triton kernel: no launched kernel wrote it or what it was copied, cast or "
                    f"summed from ({where}; launched: {launched}). Store it from the kernel that computes it with "
                    f"tl.dot (handout 03 {section})")
        out.append({"rule": "triton-attention", "how": "computes", "what": what, "where": ""})
    return out


def _triton_error(found: dict) -> str:
    return found["errors"].get("FlashAttentionTriton", "")


@rules.judge("sdpa")
def _judge_sdpa(request: pytest.FixtureRequest) -> list[dict]:
    found = watched(request.getfixturevalue("worker"))
    error = found["errors"].get("FlashAttentionPytorch", "")
    if error and not found["sdpa"]:
        raise RuntimeError(error)
    return found["sdpa"]


@rules.judge("triton-attention")
def _judge_triton(request: pytest.FixtureRequest) -> list[dict]:
    found = watched(request.getfixturevalue("worker"))
    violations = found["triton-attention"] + writer_violations(found["writers"])
    if _triton_error(found) and not violations:
        raise RuntimeError(_triton_error(found))
    return violations


@pytest.mark.points(1)
def test_builds_its_own_attention(request) -> None:
    """FlashAttentionPytorch neither calls F.scaled_dot_product_attention nor dispatches one of its ATen kernels (the
    Triton class answers to triton-attention, whose ops include SDPA's)."""
    rules.assert_kept("sdpa", request, (
        "FlashAttentionPytorch's forward and backward failed "
        "with {error}. Make its tests pass first (handout 03 §2–§4)."))


@pytest.mark.points(1)
def test_triton_path_dispatches_no_pytorch_attention_maths(request) -> None:
    """FlashAttentionTriton and its launchers dispatch no PyTorch matmul, softmax, log-sum-exp or attention op."""
    rules.assert_kept("triton-attention", request, (
        "FlashAttentionTriton's forward and backward failed "
        "with {error}. Make the Triton tests pass first (handout 03 §5–§6)."))


@pytest.mark.points(1)
def test_kernels_that_multiply_write_o_and_the_gradients(worker) -> None:
    """o, dq, dk and dv are each written by a launched kernel that multiplies matrices (tl.dot)."""
    found = watched(worker)
    error = _triton_error(found)
    if error:  # without Triton (macOS): skipped with the reason, as every Triton test is
        type_name, _, message = error.partition(": ")
        skip_if_triton_missing(type_name, message)
    violations = writer_violations(found["writers"])
    rule = library_rules.rule("triton-attention")
    assert not violations, (
        f"Rule ({SECTION}): O, dQ, dK and dV are written by your kernels that do the matrix work (tl.dot); one that "
        "copies what PyTorch computed does not count. What your code did:\n"
        + "\n".join(library_rules.describe_one(v, rule) for v in violations))
    assert found["writers"] and not _triton_error(found), (
        f"the rule could not be checked: FlashAttentionTriton's forward and backward failed with "
        f"{_triton_error(found) or 'nothing recorded'}. Make the Triton tests pass first (handout 03 §5–§6).")
