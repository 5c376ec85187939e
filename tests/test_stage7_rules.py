"""Stage 7's rules: the student builds the fused loss in Triton kernels, and the fused AdamW update; PyTorch's own
versions of either may not do that work for them (handout 07 and 07b, What is graded).

A fused loss that is ``F.cross_entropy`` on the full logits, or the same maths in chunked PyTorch under a custom
``torch.autograd.Function`` with a decoy ``@triton.jit`` kernel launched beside it, gives the right numbers; so
does a ``FusedAdamW`` that hands its update to ``torch.optim.AdamW(foreach=True)``. Only these rules tell them from
what the chapter asks for:

* **triton-loss**: the fused loss's forward and backward (fp32 and bf16, several tiles in every dimension), watched
  by :func:`kit.grading.library_rules.watch`: no PyTorch matmul, softmax, log-sum-exp or cross-entropy op may be
  dispatched (the reference dispatches none); and the graded gradients dH and dW must each be written by a launched
  kernel that does the matrix work — one that received a pointer into the gradient's storage (or into what it was
  copied, cast, concatenated or summed from, by PyTorch or by a kernel without a dot) and that runs ``tl.dot``
  (under the interpreter: executed it; on a GPU: its IR compiled for sm_90 holds ``tt.dot``). A decoy that only
  copies a gradient computed elsewhere does neither.
* **torch-adamw**: ``FusedAdamW`` built and stepped in fp32 and in bf16 with master weights, watched: it may not
  construct, subclass or step ``torch.optim.Adam``/``AdamW`` nor run their functional kernels
  (``_single_tensor_adam``, ``_multi_tensor_adam``, ``_fused_adam``). ``build_train_step``'s
  ``optimizer="adamw"`` choice legitimately uses ``torch.optim.AdamW``: the rule applies only while
  ``FusedAdamW`` runs (and the judge's source reading covers ``whole_step/fused_adamw.py`` only).

:mod:`tests.support.rules` adds the reading of the source and, when a rule is broken, fails every test marked
``builds("triton-loss")`` or ``builds("torch-adamw")`` with the same message.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

import kit  # noqa: F401 — before triton: the interpreter on machines without CUDA
import kit.impl
from kit import triton_compile
from kit.grading import library_rules
from kit.triton import triton_private
from tests.support import rules
from tests.support.lineage import Lineage
from tests.test_stage7_fused_loss import UPSTREAM, make_inputs

pytestmark = [
    pytest.mark.stage7,
    # triton 3.6's interpreter converts 1-element arrays with int(); numpy warns on every loop bound.
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

# The watched loss workload: fp32 flat rows and bf16 (B, T, d), several tiles of any design in every dimension and none
# a multiple of a tile size, as large as the interpreter allows in about a second (the gate runs it inside the first
# graded test's CPU budget).
LOSS_CASES = [((100, 48), 150, torch.float32), ((2, 24, 40), 90, torch.bfloat16)]
# What may stand between a kernel's output and a graded gradient: copies, casts, concatenation, and sums of
# partial results (a split-K design adds its partials in PyTorch). Elementwise maths is not on the list: a gradient
# computed in PyTorch and handed to a copy kernel is still computed in PyTorch.
CARRIES = frozenset({"_to_copy", "clone", "copy_", "copy", "_copy_from", "_copy_from_and_resize", "cat", "stack",
                     "sum", "add", "add_"})


# ----------------------------------------------------------------------------------------------------
# In the worker: the workloads, watched; data back
# ----------------------------------------------------------------------------------------------------


def _loss_module():
    return importlib.import_module(f"{kit.impl.selected()}.whole_step.fused_cross_entropy")


def _writers(grad: torch.Tensor, launches: list[dict], lineage: Lineage, hop) -> tuple[list[dict], list[dict]]:
    """The launches that wrote ``grad``: those that received a pointer into its storage or into one it was carried
    from (``first``), and — through each launch ``hop(launch)`` accepts as a copy (say a Triton cast of an fp32
    accumulator), into the storages *it* received — every launch upstream (``reached``, ``first`` included)."""
    storages = lineage.ancestry([grad.untyped_storage().data_ptr()])
    first: list[dict] | None = None
    reached: list[dict] = []
    while True:
        new = [la for la in launches if la["storages"] & storages and all(la is not r for r in reached)]
        first = new if first is None else first
        if not new:
            return first, reached
        reached += new
        storages |= lineage.ancestry(set().union(*(la["storages"] for la in new if hop(la))))


def _loss_workload() -> dict:
    """Forward and backward of the fused loss on :data:`LOSS_CASES`, watched twice over.

    ``violations``: what the triton-loss watch recorded (PyTorch matmuls, softmax… dispatched). ``cases``: for
    each case and each graded gradient, ``writers`` (the kernels that received a pointer into its storage or into
    one it was carried from, :func:`_writers`), ``dot`` (whether a kernel that multiplied matrices wrote it, itself
    or through kernels that only copy) and ``error`` (a compile error, on a GPU). Under the interpreter a kernel
    multiplies matrices when it executes ``tl.dot`` (the interpreter's ``create_dot``, seen as it runs); on a GPU
    the launches are compiled for sm_90, as test_fused_loss_kernels_compile_for_a_gpu does, and the IR must hold
    ``tt.dot``."""
    fn = _loss_module().fused_linear_cross_entropy
    interpreted = kit.triton_interpreted()
    launches: list[dict] = []  # {"launch", "storages", "dots", "case"}
    kept: list[Any] = []  # every launch's tensors, alive until the end: no later tensor gets their addresses
    case_index = [0]

    def on_launch(kernel, named: dict, options: dict, grid) -> bool:
        if triton_private.in_autotuner_benchmark():
            return True
        g = grid(named) if callable(grid) else grid
        g = tuple(int(x) for x in (g if isinstance(g, (tuple, list)) else (g,)))
        launch = triton_compile.Launch(
            kernel.fn.__module__, kernel.fn.__qualname__,
            {k: triton_compile.describe_argument(v) for k, v in named.items()},
            g, {k: v if isinstance(v, (bool, int, float, str)) else repr(v) for k, v in options.items()})
        tensors = [v for v in named.values() if isinstance(v, torch.Tensor)]
        kept.extend(tensors)
        storages = {v.untyped_storage().data_ptr() for v in tensors} - {0}  # 0: empty, shared by all
        launches.append({"launch": launch, "storages": storages, "dots": 0, "case": case_index[0]})
        return True

    lineage = Lineage(CARRIES)
    grads: list[dict[str, torch.Tensor]] = []
    with contextlib.ExitStack() as stack:
        if interpreted:  # the kernel runs right after on_launch: its dots are the last launch's
            from triton.runtime.interpreter import InterpreterBuilder

            original = InterpreterBuilder.create_dot

            def counting_dot(self, *args, **kwargs):
                if launches:
                    launches[-1]["dots"] += 1
                return original(self, *args, **kwargs)

            stack.enter_context(mock.patch.object(InterpreterBuilder, "create_dot", counting_dot))
        seen = stack.enter_context(library_rules.watch(["triton-loss"]))
        stack.enter_context(triton_private.launches_intercepted(on_launch))
        stack.enter_context(lineage)
        for i, (shape, vocab, dtype) in enumerate(LOSS_CASES):
            case_index[0] = i
            h, w, t = make_inputs(shape, vocab, dtype)
            h.requires_grad_()
            w.requires_grad_()
            loss = fn(h, w, t)
            dh, dw = torch.autograd.grad(loss * UPSTREAM, (h, w))
            grads.append({"dh": dh, "dw": dw})
    by_case = [[la for la in launches if la["case"] == i] for i in range(len(LOSS_CASES))]
    if not interpreted:  # compile every launch upstream of a gradient; tt.dot in the IR counts as a dot
        upstream = {la["launch"].key(): la["launch"] for i, g in enumerate(grads) for grad in g.values()
                    for la in _writers(grad, by_case[i], lineage, lambda la: True)[1]}
        root = Path(__file__).resolve().parent.parent
        reports = triton_compile.compile_launches(list(upstream.values()), Path(tempfile.mkdtemp(prefix="sm90-")),
                                                  root, cache=triton_compile.user_cache_dir())
        ir = {r.launch.key(): r for r in reports}
        for la in launches:
            if la["launch"].key() in ir:
                report = ir[la["launch"].key()]
                la["dots"] = int(bool(re.search(r"\btt\.dot(_scaled)?\b", report.ttir)))
                la["error"] = report.error
    cases = []
    for i, (_, _, dtype) in enumerate(LOSS_CASES):
        case: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch.")}
        for key, grad in grads[i].items():
            # A launch without a dot that wrote the gradient is taken for a copy: what it read may hold the work.
            first, reached = _writers(grad, by_case[i], lineage, lambda la: not la["dots"])
            case[key] = {"writers": sorted({la["launch"].name for la in first}),
                         "dot": any(la["dots"] for la in reached),
                         "error": next((la["error"] for la in reached if la.get("error")), "")}
        cases.append(case)
    return {"violations": seen.as_data(), "cases": cases}


def _adamw_workload() -> list[dict]:
    """FusedAdamW built (two groups) and stepped 3 times in fp32, and in bf16 with master weights; its state dict
    saved and loaded into a second one, which steps once more — all under the torch-adamw watch."""
    fused = importlib.import_module(f"{kit.impl.selected()}.whole_step.fused_adamw").FusedAdamW
    g = torch.Generator().manual_seed(7)
    with library_rules.watch(["torch-adamw"]) as seen:
        for dtype, master in ((torch.float32, False), (torch.bfloat16, True)):
            params = [torch.randn(shape, generator=g).to(dtype).requires_grad_() for shape in ((6, 5), (5,), (4, 3))]
            groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-2, "weight_decay": 0.0}]
            optimizer = fused(groups, lr=1e-2, weight_decay=0.1, master_weights=master)
            seen.check_object(optimizer)
            for _ in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=g).to(dtype)
                optimizer.step()
            again = fused([{"params": params[:2]}, {"params": params[2:]}], master_weights=master)
            seen.check_object(again)
            again.load_state_dict(optimizer.state_dict())
            again.step()
    return seen.as_data()


# ----------------------------------------------------------------------------------------------------
# The judges and the rule tests
# ----------------------------------------------------------------------------------------------------


GRADIENTS = {"dh": "dH = ∂loss/∂hidden", "dw": "dW = ∂loss/∂weight"}


def writer_violations(cases: list[dict]) -> list[dict]:
    """The triton-loss violations of :func:`_loss_workload`'s ``cases``: a graded gradient that no launched kernel
    running ``tl.dot`` wrote — directly, or through copies (PyTorch's, or kernels without a dot). On a GPU, a
    kernel that did not compile for sm_90 is not held against the rule (the compile test reports it; its IR is
    unknown)."""
    out = []
    for case in cases:
        for key, name in GRADIENTS.items():
            if case[key]["dot"] or case[key]["error"]:
                continue
            if case[key]["writers"]:
                names = ", ".join(case[key]["writers"])
                # Short: a mutant run matches the first lines of the message only (junit keeps 500 characters).
                what = (f"{name} ({case['dtype']}) in no kernel with tl.dot: only {names} got a pointer to it "
                        "(handout 07 §3)")
            else:
                what = (f"{name} ({case['dtype']}) in no Triton kernel: no launched kernel got a pointer into it or "
                        "into what it was copied from (handout 07 §3)")
            out.append({"rule": "triton-loss", "how": "computes", "what": what, "where": ""})
    return out


@rules.judge("triton-loss")
def _judge_loss(request: pytest.FixtureRequest) -> list[dict]:
    record = request.getfixturevalue("worker").call(_loss_workload)
    return record["violations"] + writer_violations(record["cases"])


@rules.judge("torch-adamw")
def _judge_adamw(request: pytest.FixtureRequest) -> list[dict]:
    return request.getfixturevalue("worker").call(_adamw_workload)


@pytest.mark.points(1)
def test_builds_its_own_fused_loss_in_triton(request) -> None:
    """The fused loss dispatches no PyTorch matmul, softmax, log-sum-exp or cross-entropy, and dH and dW are
    stored by kernels that multiply with tl.dot."""
    rules.assert_kept("triton-loss", request, (
        "the fused loss's forward and backward failed with "
        "{error}. Make the fused-loss tests pass first (handout 07 §2–§3)."))


@pytest.mark.points(1)
def test_builds_its_own_adamw(request) -> None:
    """FusedAdamW neither wraps nor subclasses torch.optim.AdamW/Adam, nor runs their update functions."""
    rules.assert_kept("torch-adamw", request, (
        "FusedAdamW's workload (two groups, three steps in "
        "fp32 and in bf16 with master weights, a state dict loaded) failed with "
        "{error}. Make the AdamW tests pass first (handout 07b §4)."))
