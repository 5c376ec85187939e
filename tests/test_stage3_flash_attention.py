"""Stage 3 — FlashAttention-2 in PyTorch and Triton (handout/03-flash-attention.md).

Every output is compared with attention computed in float64 from the same (rounded) inputs. For fp16
and bf16 the rule is the flash-attention project's: the error against float64 may be at most twice
(plus a small floor) the error of plain PyTorch attention run in that same low precision — a kernel
is as accurate as the obvious implementation. fp32 must agree to 1e-4.

The implementation runs in the worker (``worker.call``): the module-level functions in the first part
below call it — with recording stand-ins where a test observes how it works (the largest tensor created,
the matmul FLOPs, atomics, NaN-filled ``torch.empty``, the kernels launched and their compiled IR) — and
return what they saw as data. The tests in the second part compute the float64 references and the
tolerances here, in the judge, and compare.

On a machine without CUDA the Triton kernels run in the Triton interpreter, so shapes are small; the
``gpu`` checks at the bottom run the compiled kernels at larger sizes where a GPU exists.
"""

from __future__ import annotations

import contextlib
import functools
import math
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch

import kit  # noqa: F401 — before triton: the interpreter on machines without CUDA
import kit.impl
from kit import triton_compile
from kit.checks import outcome_of
from kit.model import TransformerLM, naive_attention
from kit.testing import assert_close, assert_equal, assert_raised
from kit.triton import triton_private
from tests.support.flash_attention import BACKWARD_DESIGNS, backward_design, flash_class, run_named
from tests.support.flash_attention import run as run_flash

pytestmark = [
    pytest.mark.stage3,
    # triton 3.6's interpreter converts 1-element arrays with int(); numpy warns on every loop bound.
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (q shape, k/v shape): (B, N, D) with Nq < Nk, and (B, H, N, D) with Nq > Nk; lengths are not
# multiples of any tile size. The smallest that still tell right from wrong under the interpreter's tiles
# (triton_config.INTERPRETER_BLOCKS, 32 and 64): in one shape or the other every kernel loops over 2+ tiles
# along both axes and ends on a partial tile, and causal keys 64–65 of the first shape sit in a 64-key tile no
# query reaches. Every catalogued Stage 3 mistake fails here with the message it failed with at 97/131
# (`make mutants STAGE=3`, 2026-11-27), in 15 % less time for the stage.
SHAPES = [((2, 49, 32), (2, 66, 32)), ((1, 2, 66, 16), (1, 2, 49, 16))]
# The floor under tolerance()'s 2 × (naive attention's error) for fp16/bf16 (the flash-attention project's rule):
# about u/4 of the dtype (fp16 u = 2⁻¹¹ ≈ 5e-4, bf16 u = 2⁻⁸ ≈ 4e-3), less than one rounding of an O element of
# size 1: the bound cannot collapse where naive attention happens to round well, yet stays below the dtype's u.
FLOOR = {torch.float16: 1e-4, torch.bfloat16: 1e-3}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
COMPILE_BH = (2, 3)  # batch·heads = 6: no tile count of these shapes is 6, so the grid axis of BH is known
MANY_HEADS = 65_600  # see test_triton_grids_fit_cuda_limits_for_many_heads
# Every test of the Triton backward asks for each design in BACKWARD_DESIGNS (tests/support/flash_attention.py).
# What each class's tests grade is the student's own work (handout 03, What is graded; tests/test_stage3_rules.py):
# a test of FlashAttentionPytorch fails when the sdpa rule is broken, one of FlashAttentionTriton also when the
# triton-attention rule is. BY_CLASS: the two class names as parameters, each with its class's rules.
BUILDS = {"FlashAttentionPytorch": pytest.mark.builds("sdpa"),
          "FlashAttentionTriton": pytest.mark.builds("triton-attention")}
BY_CLASS = [pytest.param(name, marks=mark, id=name) for name, mark in BUILDS.items()]



def make_inputs(q_shape, kv_shape, dtype, device=DEVICE, seed=0):
    """q, k, v, dO from a seeded generator: the judge and a worker that call it get the same tensors."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in (q_shape, kv_shape, kv_shape))
    do = torch.randn(q_shape, generator=g).to(device=device, dtype=dtype)
    return q, k, v, do


# ----------------------------------------------------------------------------------------------------
# What runs in the worker: the implementation, called with recording stand-ins; data back
# ----------------------------------------------------------------------------------------------------


def _flash_attention():
    return kit.impl.load().flash_attention


def _run(name, q, k, v, do, is_causal, backward, permute=None, autotune=None, design=None) -> dict:
    """O, saved tensors and gradients of ``flash_attention.<name>`` (tests/support/flash_attention.py);
    ``autotune`` (a GPU): ``triton_config.AUTOTUNE`` set to it for the duration; ``design``: the backward design
    (:func:`backward_design`)."""
    with contextlib.ExitStack() as stack:
        if autotune is not None:
            stack.enter_context(mock.patch.object(_flash_attention().triton_config, "AUTOTUNE", autotune))
        stack.enter_context(backward_design(design))
        return run_named(name, q, k, v, do, is_causal, backward, permute=permute)


def _run_repeatedly(name, q, k, v, do, is_causal, times) -> dict:
    """``times`` identical forward + backward passes: the first one's O, and the gradients of each."""
    runs = [run_named(name, q, k, v, do, is_causal, backward=True) for _ in range(times)]
    return {"o": runs[0]["o"], "grads": [r["grads"] for r in runs]}


def _apply(name, q, k, v, is_causal) -> torch.Tensor:
    """``flash_attention.<name>.apply(q, k, v, is_causal)`` on the inputs as given (no autograd leaves)."""
    return flash_class(name).apply(q, k, v, is_causal)


def largest_tensor_created(fn) -> tuple[int, str]:
    """The element count of the largest tensor any aten operation creates while ``fn()`` runs, and the op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestTensor(TorchDispatchMode):
        largest, op = 0, None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                    self.largest, self.op = t.numel(), str(func)
            return out

    mode = LargestTensor()
    with mode:
        fn()
    return mode.largest, mode.op


def _largest_tensors(n: int, d: int, backward: bool) -> dict:
    """{is_causal: (largest tensor's elements, its op)} for a FlashAttentionPytorch forward or backward."""
    fa = _flash_attention()
    q, k, v, do = make_inputs((1, n, d), (1, n, d), torch.float32)
    q.requires_grad_()
    found = {}
    for is_causal in (False, True):
        if backward:
            step = functools.partial(fa.FlashAttentionPytorch.apply(q, k, v, is_causal).backward, do)
        else:
            step = functools.partial(fa.FlashAttentionPytorch.apply, q, k, v, is_causal)
        found[is_causal] = largest_tensor_created(step)
    return found


def matmul_flops(fn) -> int:
    """Floating-point operations of the matrix multiplications (mm, bmm, addmm, …) ``fn()`` issues."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return counter.get_total_flops()


def _matmul_work(q, k, v, do) -> dict:
    """{"forward"/"backward": {is_causal: matmul FLOPs}} of FlashAttentionPytorch."""
    fa = _flash_attention().FlashAttentionPytorch
    work = {"forward": {}, "backward": {}}
    for is_causal in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = []
        work["forward"][is_causal] = matmul_flops(lambda: out.append(fa.apply(*leaves, is_causal)))  # noqa: B023
        work["backward"][is_causal] = matmul_flops(lambda: out[0].backward(do))  # noqa: B023
    return work


def _triton_backward_twice(q, k, v, do, design=None) -> dict:
    """The gradients of two identical Triton backward passes, and the atomic operations their kernels used
    (``{"op": "rmw"|"cas", "dtype": …}``)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(backward_design(design))
        # Under the interpreter programs run one after another, so an atomic reduction would still be
        # reproducible here; record atomics instead — on a GPU a floating-point one makes the summation order random.
        atomics = stack.enter_context(triton_private.atomics_recorded()) if kit.triton_interpreted() else []
        first = run_named("FlashAttentionTriton", q, k, v, do, True, backward=True)["grads"]
        second = run_named("FlashAttentionTriton", q, k, v, do, True, backward=True)["grads"]
    return {"first": first, "second": second, "atomics": list(atomics)}


@contextlib.contextmanager
def nan_filled_empty():
    """torch.empty / empty_like / new_empty return NaN-filled floats for the duration, as uninitialised GPU
    memory may."""
    with contextlib.ExitStack() as stack:
        for owner, name in ((torch, "empty"), (torch, "empty_like"), (torch.Tensor, "new_empty")):
            original = getattr(owner, name)

            def filled(*args, _original=original, **kwargs):
                out = _original(*args, **kwargs)
                return out.fill_(float("nan")) if out.is_floating_point() else out

            stack.enter_context(mock.patch.object(owner, name, filled))
        yield


def _triton_with_nan_filled_empty(q, k, v, do, design=None) -> dict:
    with nan_filled_empty(), backward_design(design):
        return run_named("FlashAttentionTriton", q, k, v, do, True, backward=True)


def _compiled_kernels() -> list[dict]:
    """Records the kernels a causal forward + backward of FlashAttentionTriton launches (fp16 and fp32; Nq = 40
    < Nk = 72, D = 64; each backward design), compiles them for sm_90 in the worker's scratch, as a GPU launch
    of the same arguments would, and returns each report as data."""
    fn = _flash_attention().FlashAttentionTriton

    def forward_and_backward():
        for dtype in (torch.float16, torch.float32):
            q, k, v, do = make_inputs((*COMPILE_BH, 40, 64), (*COMPILE_BH, 72, 64), dtype)
            for design in BACKWARD_DESIGNS:
                with backward_design(design):
                    run_flash(fn, q, k, v, do, True, backward=True)

    launches = triton_compile.record_launches(forward_and_backward)
    root = Path(__file__).resolve().parent.parent
    workdir = Path(tempfile.mkdtemp(prefix="sm90-"))
    # Triton's compile cache is kept between runs (kit.triton_compile.user_cache_dir): unchanged kernels are not
    # compiled again, and an edited one is (the cache key hashes its source). Each graded run has its own.
    reports = triton_compile.compile_launches(launches, workdir, root,
                                              cache=triton_compile.user_cache_dir()) if launches else []
    return [r.as_data() for r in reports]


def _launches_for_many_heads() -> list[dict]:
    """The launches (kernel, grid) of a forward + backward with batch·heads = MANY_HEADS, recorded, not run."""
    fn = _flash_attention().FlashAttentionTriton

    def forward_and_backward():
        q, k, v, do = make_inputs((MANY_HEADS, 1, 16), (MANY_HEADS, 1, 16), torch.float16)
        for design in BACKWARD_DESIGNS:
            with backward_design(design):
                run_flash(fn, q, k, v, do, True, backward=True)

    return [la.as_data() for la in triton_compile.record_launches(forward_and_backward, execute=False)]


def _train_with_flash_attention(state: dict, tokens: torch.Tensor) -> dict:
    """A tiny TransformerLM with flash_attention_fn, loaded with ``state``: its logits and gradients for the loss
    mean(logits²)."""
    fa = _flash_attention()
    model = TransformerLM("tiny", attention_fn=fa.flash_attention_fn).to(DEVICE)
    model.load_state_dict(state)
    logits = model(tokens.to(DEVICE))
    logits.float().square().mean().backward()
    return {"logits": logits, "grads": [[name, p.grad] for name, p in model.named_parameters()]}


def _flash_attention_by_backend(q, k, v) -> dict:
    """flash_attention(q, k, v, is_causal=True, backend=…) for each backend."""
    fa = _flash_attention()
    return {backend: fa.flash_attention(q, k, v, is_causal=True, backend=backend) for backend in ("pytorch", "triton")}


def _bad_input_outcomes(name: str, q, k, v, cases: list[str]) -> dict:
    """The output shape of ``flash_attention.<name>`` on good input, then what each bad input in ``cases`` did."""
    fn = flash_class(name)
    shape = tuple(fn.apply(q, k, v, False).shape)
    bad = {
        "integer dtype": (q.to(torch.int32), k, v),
        "mixed dtypes": (q, k.half(), v),
        "head dims differ": (q, torch.randn(2, 24, 32), v),
        "batch dims differ": (q, k[:1], v[:1]),
        "k and v lengths differ": (q, k, v[:, :5]),
        "devices differ": (q, k.to("meta"), v),
        "unsupported head dim": (q[..., :12], k[..., :12], v[..., :12]),
    }
    return {"shape": shape, "outcomes": {case: outcome_of(fn.apply, *bad[case], False) for case in cases}}


def _unknown_backend(q, k, v) -> dict:
    return outcome_of(_flash_attention().flash_attention, q, k, v, backend="cuda")


# ----------------------------------------------------------------------------------------------------
# The judge's side: float64 references, tolerances, and the tests
# ----------------------------------------------------------------------------------------------------


def attention_float64(q, k, v, is_causal):
    """softmax(q kᵀ/√D) v and the log-sum-exp L, in float64, with gradients through autograd."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1), (q, k, v)


def run(worker, name, q, k, v, do, is_causal, backward, **options):
    """Output, saved tensors and (optionally) input gradients of ``flash_attention.<name>.apply``, run in the
    worker (``options``: see :func:`_run`)."""
    got = worker.call(_run, name, q, k, v, do, is_causal, backward, **options)
    return got["o"], got["saved"], got["grads"]


def check_forward(worker, name, dtype, is_causal):
    for q_shape, kv_shape in SHAPES:
        q, k, v, do = make_inputs(q_shape, kv_shape, dtype)
        o, saved, _ = run(worker, name, q, k, v, do, is_causal, backward=False)
        o64, L64, _ = attention_float64(q, k, v, is_causal)
        where = f"{name} {dtype} causal={is_causal} q {q_shape} k/v {kv_shape}"
        assert_equal(o.dtype, dtype, name=f"output dtype ({where})", section="handout 03 §2")
        assert_close(o, o64, name=f"O ({where})", section="handout 03 §1–§2", **tolerance(q, k, v, is_causal, "o"))
        L = saved_logsumexp(saved, q_shape, where)
        # L is fp32 in every dtype: fp16/bf16 products are exact in fp32, so S carries only a D-term fp32 sum's
        # error (≲ D·u·Σ|q·k|/√D ≈ 7e-6 worst case at D = 32, ~1e-6 typical) plus a few u·|L| from the log-sum-exp
        # (|L| ≲ 6 here). rtol = atol = 1e-5 allows ≥ 4e-5: ≥ 5× the worst case (measured ≤ 6e-7 in every dtype),
        # and it fails scores computed in fp16/bf16 instead of fp32 (the handout's "all arithmetic in fp32"), which
        # put L 2–5e-4 off while O's own tolerance, set by naive fp16 attention that rounds S the same way, cannot.
        assert_close(L, L64, name=f"L = logsumexp of the scaled scores ({where})", section="handout 03 §2",
                     rtol=1e-5, atol=1e-5)


def check_backward(worker, name, dtype, is_causal):
    designs = BACKWARD_DESIGNS if name == "FlashAttentionTriton" else (None,)
    for (q_shape, kv_shape), design in ((shapes, design) for shapes in SHAPES for design in designs):
        q, k, v, do = make_inputs(q_shape, kv_shape, dtype)
        _, _, grads = run(worker, name, q, k, v, do, is_causal, backward=True, design=design)
        o64, _, leaves = attention_float64(q, k, v, is_causal)
        o64.backward(do.double())
        where = f"{name} {dtype} causal={is_causal} q {q_shape} k/v {kv_shape}" + (
            f", backward design {design!r}" if design else "")
        for gname, grad, leaf in zip(("dQ", "dK", "dV"), grads, leaves):
            assert grad is not None, f"{gname} is None ({where}): backward must return gradients for q, k, v"
            assert_equal(grad.dtype, dtype, name=f"{gname} dtype ({where})", section="handout 03 §3")
            assert_close(grad, leaf.grad, name=f"{gname} ({where})", section="handout 03 §3",
                         **tolerance(q, k, v, is_causal, gname, do))


def tolerance(q, k, v, is_causal, quantity, do=None) -> dict:
    """fp32: 1e-4. fp16/bf16: 2 × the error of naive attention in the same dtype, plus a floor.

    fp32 against float64: O sums D products for S, normalises over Nk keys and sums Nk products for P·V, a worst
    case of ~(D + 2·Nk)·u ≈ 1e-5 relative at D = 32, Nk = 66 (u = 2⁻²⁴), |O|, |dQ|, |dK|, |dV| ≲ 3; the backward's
    dP = dO·Vᵀ, D_i = rowsum(dO∘O) and dS·K sums are as long. 1e-4 is ≥ 3× that bound (measured: ≤ 1e-6).
    fp16/bf16: the error is dominated by rounding S, P and O to the dtype, which a tiled kernel does no better
    than naive attention does; twice naive's measured error allows a different but equally good rounding."""
    if q.dtype == torch.float32:
        return {"rtol": 1e-4, "atol": 1e-4}
    lq, lk, lv = (t.clone().requires_grad_() for t in (q, k, v))
    o_low = naive_attention(lq, lk, lv, is_causal)
    o64, _, leaves = attention_float64(q, k, v, is_causal)
    if quantity == "o":
        err = (o_low.double() - o64).abs().max().item()
    else:
        o_low.backward(do)
        o64.backward(do.double())
        low = {"dQ": lq.grad, "dK": lk.grad, "dV": lv.grad}[quantity]
        ref = {"dQ": leaves[0].grad, "dK": leaves[1].grad, "dV": leaves[2].grad}[quantity]
        err = (low.double() - ref).abs().max().item()
    return {"rtol": 0.0, "atol": 2 * err + FLOOR[q.dtype]}


def saved_logsumexp(saved, q_shape, where):
    lse_shape = tuple(q_shape[:-1])
    matches = [t for t in saved if tuple(t.shape) == lse_shape]
    assert len(matches) == 1, (
        f"{where}: expected exactly one saved tensor of shape {lse_shape} (the log-sum-exp L), found "
        f"{len(matches)} among saved shapes {[tuple(t.shape) for t in saved]}. See handout 03 §2.")
    return matches[0]


def check_saved_tensors(worker, name):
    q_shape, kv_shape = (2, 3, 40, 16), (2, 3, 72, 16)
    for is_causal in (False, True):
        q, k, v, do = make_inputs(q_shape, kv_shape, torch.float32)
        o, saved, _ = run(worker, name, q, k, v, do, is_causal, backward=False)
        where = f"{name} causal={is_causal}"
        shapes = sorted(tuple(t.shape) for t in saved)
        expected = sorted([q_shape, kv_shape, kv_shape, q_shape, q_shape[:-1]])
        assert_equal(shapes, expected, name=f"shapes of the saved tensors, expected q, k, v, o and L ({where})",
                     section="handout 03 §2")
        for tname, t in (("q", q), ("k", k), ("v", v), ("o", o)):
            t = t.cpu()  # what the worker sent back is on the CPU
            assert any(s.shape == t.shape and torch.equal(s, t) for s in saved), (
                f"{where}: {tname} is not among the saved tensors. See handout 03 §3.")
        _, L64, _ = attention_float64(q, k, v, is_causal)
        # fp32 L, as in check_forward: ~1e-6 of a D = 16 fp32 sum and a log-sum-exp; 1e-4 is far above it.
        assert_close(saved_logsumexp(saved, q_shape, where), L64, name=f"saved L ({where})", section="handout 03 §2",
                     rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------ PyTorch (§1–§4)


@pytest.mark.points(1)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.builds("sdpa")
def test_pytorch_forward_matches_float64(worker, dtype, is_causal):
    """FlashAttentionPytorch forward: O and L match float64 attention."""
    check_forward(worker, "FlashAttentionPytorch", dtype, is_causal)


@pytest.mark.points(2)
@pytest.mark.builds("sdpa")
def test_pytorch_saves_only_q_k_v_o_and_logsumexp(worker):
    """FlashAttentionPytorch saves exactly q, k, v, o and L (..., Nq)."""
    check_saved_tensors(worker, "FlashAttentionPytorch")


def check_no_score_matrix(worker, backward: bool) -> None:
    n, d = 256, 16  # the score matrix has n² = 65,536 elements; a 64 × 64 tile has 4,096
    found = worker.call(_largest_tensors, n, d, backward)
    for is_causal in (False, True):
        largest, op = found[is_causal]
        assert largest <= n * n // 4, (
            f"{'backward' if backward else 'forward'}, causal={is_causal}: an operation ({op}) created a tensor "
            f"of {largest} elements — the full score matrix has {n * n}. Work on tiles of Q_TILE × K_TILE "
            f"scores instead (handout 03 §2{', §3' if backward else ''}).")


@pytest.mark.points(2)
@pytest.mark.builds("sdpa")
def test_pytorch_never_materialises_the_score_matrix(worker):
    """The forward never creates a tensor the size of the Nq × Nk score matrix."""
    check_no_score_matrix(worker, backward=False)


@pytest.mark.points(1)
@pytest.mark.builds("sdpa")
def test_pytorch_backward_never_materialises_the_score_matrix(worker):
    """The backward recomputes P tile by tile: no tensor the size of the score matrix."""
    check_no_score_matrix(worker, backward=True)


@pytest.mark.points(1)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.builds("sdpa")
def test_pytorch_backward_matches_float64(worker, dtype, is_causal):
    """FlashAttentionPytorch backward: dQ, dK, dV match float64 autograd."""
    check_backward(worker, "FlashAttentionPytorch", dtype, is_causal)


@pytest.mark.points(2)
@pytest.mark.builds("sdpa")
def test_pytorch_causal_skips_masked_tiles(worker):
    """Causal FlashAttentionPytorch does about half the matmul work of non-causal, forward and backward."""
    # Error model: tiles of at most 128 rows (the score-matrix test allows no larger), so N = 512 is T ≥ 4
    # tiles a side. Skipping every tile the mask hides leaves T(T+1)/2 of T² tiles: (T+1)/2T ≤ 0.625 of
    # the work; not skipping does 1.0. Allowed: 0.625 + 0.05 for rounding of unequal tile shapes.
    n, d = 512, 16
    bound = (4 + 1) / (2 * 4) + 0.05
    q, k, v, do = make_inputs((1, n, d), (1, n, d), torch.float32)
    work = worker.call(_matmul_work, q, k, v, do)
    for step in ("forward", "backward"):
        full, causal = work[step][False], work[step][True]
        assert full > 0, f"the {step} issued no matrix multiplication (torch matmul / @) at all"
        assert causal <= bound * full, (
            f"causal {step}: {causal / 1e6:.1f} MFLOP of matmuls vs {full / 1e6:.1f} MFLOP non-causal (ratio "
            f"{causal / full:.2f}, allowed ≤ {bound:.3f} for N = {n}, tiles ≤ 128). Skip the key tiles the causal "
            f"mask hides entirely — they contribute exactly 0 (handout 03 §4).")


@pytest.mark.points(1)
@pytest.mark.builds("sdpa")
def test_pytorch_forward_accumulates_in_fp32(worker):
    """fp16 inputs, 4096 keys whose values average 24: Σ p·v ≈ 10⁵ overflows an fp16 accumulator."""
    # The running sums l = Σ exp(s − m) (≈ Nk) and acc = Σ exp(s − m) v (≈ Nk · 24 ≈ 10⁵) exceed fp16's
    # 65,504 or lose its 11-bit mantissa; accumulated in fp32 (as §2 says) O ≈ 24 is as accurate as
    # plain fp16 attention, whose matmul accumulates in fp32 — so the usual tolerance applies.
    g = torch.Generator().manual_seed(1)
    q = (0.1 * torch.randn(1, 32, 16, generator=g)).half()
    k = torch.randn(1, 4096, 16, generator=g).half()
    v = (24 + torch.randn(1, 4096, 16, generator=g)).half()
    for is_causal in (False,):
        o = worker.call(_apply, "FlashAttentionPytorch", q, k, v, is_causal)
        o64, L64, _ = attention_float64(q, k, v, is_causal)
        where = "fp16 q (1, 32, 16), k/v (1, 4096, 16), values ≈ 24"
        assert torch.isfinite(o).all(), (
            f"O has {(~torch.isfinite(o)).sum().item()} non-finite elements ({where}): an fp16 running sum "
            "overflowed (max 65,504). Keep m, l and acc in fp32 whatever the input dtype (handout 03 §2).")
        assert_close(o, o64, name=f"O ({where}) — accumulate l and acc in fp32", section="handout 03 §2",
                     **tolerance(q, k, v, is_causal, "o"))


# ------------------------------------------------------------------------------------ Triton (§5–§6)


@pytest.mark.points(1)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.builds("triton-attention")
def test_triton_forward_matches_float64(worker, dtype, is_causal):
    """FlashAttentionTriton forward kernel: O and L match float64 attention."""
    check_forward(worker, "FlashAttentionTriton", dtype, is_causal)


@pytest.mark.points(2)
@pytest.mark.builds("triton-attention")
def test_triton_saves_only_q_k_v_o_and_logsumexp(worker):
    """FlashAttentionTriton saves exactly q, k, v, o and L (..., Nq)."""
    check_saved_tensors(worker, "FlashAttentionTriton")


@pytest.mark.points(2)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.builds("triton-attention")
def test_triton_backward_matches_float64(worker, dtype, is_causal):
    """FlashAttentionTriton backward kernels: dQ, dK, dV match float64 autograd."""
    check_backward(worker, "FlashAttentionTriton", dtype, is_causal)


@pytest.mark.points(2)
@pytest.mark.builds("triton-attention")
def test_triton_backward_is_deterministic(worker):
    """Two backward passes give bitwise-equal gradients, and no floating-point atomic operation is used."""
    # Two query and two key tiles, so that programs share rows of dQ (or dK, dV): the case an atomic would order.
    q, k, v, do = make_inputs((1, 2, 70, 32), (1, 2, 70, 32), torch.float16)
    for design in BACKWARD_DESIGNS:
        got = worker.call(_triton_backward_twice, q, k, v, do, design)
        first, second, atomics = got["first"], got["second"], got["atomics"]
        for name, a, b in zip(("dQ", "dK", "dV"), first, second):
            assert torch.equal(a, b), (f"{name} differs between two identical backward passes (backward design "
                                       f"{design!r}; max |diff| {(a.float() - b.float()).abs().max().item():.3g}). "
                                       "See handout 03 §6.")
        # An atomic on integers (a counter that orders the additions) is deterministic; one on floats adds in
        # whatever order the GPU schedules the programs, and float addition is not associative.
        floats = sorted({f"atomic {a['op']} on {a['dtype']}" for a in atomics if a["dtype"].startswith(("fp", "bf"))})
        assert not floats, (
            f"the backward (design {design!r}) used floating-point atomic operations ({', '.join(floats)}): their "
            "summation order varies from run to run on a GPU. Give each program its own rows of dQ, dK, dV, or add "
            "in a fixed order (handout 03 §6).")


@pytest.mark.points(1)
@pytest.mark.builds("triton-attention")
def test_triton_causal_keys_no_query_reaches_get_zero_gradients(worker):
    """Causal, Nq = 40 < Nk = 200: key rows j ≥ 40 are seen by no query, so their dK and dV are exactly 0 —
    even when freshly allocated memory holds garbage (here: NaN)."""
    q, k, v, do = make_inputs((1, 2, 40, 16), (1, 2, 200, 16), torch.float32)
    for design in BACKWARD_DESIGNS:
        check_unreached_keys(worker.call(_triton_with_nan_filled_empty, q, k, v, do, design), design)


def check_unreached_keys(got: dict, design: str) -> None:
    o, grads = got["o"], got["grads"]
    assert torch.isfinite(o).all(), "O has non-finite values: a buffer from torch.empty was read before written"
    where = f"causal, q (1, 2, 40, 16), k/v (1, 2, 200, 16), torch.empty returning NaN, backward design {design!r}"
    assert torch.isfinite(grads[0]).all(), (
        f"dQ has non-finite values ({where}): some rows of dQ were never written (handout 03 §6).")
    for name, grad in zip(("dK", "dV"), grads[1:]):
        unreached = grad[..., 40:, :]
        bad = ~torch.isfinite(unreached) | (unreached != 0)
        if bad.any():
            at = tuple(bad.nonzero()[0].tolist())
            raise AssertionError(
                f"{name}[..., 40:, :] at index {at} is {unreached[at].item()} ({where}): keys j ≥ Nq = 40 are "
                "seen by no query under the causal mask, so their dK and dV must be exactly 0. Memory from "
                "torch.empty holds garbage on a GPU: launch a program for every key tile and let it store "
                "zeros when no query tile reaches it (handout 03 §4, §6).")
    for name, grad in zip(("dK", "dV"), grads[1:]):
        assert torch.isfinite(grad).all(), f"{name} has non-finite values ({where}): rows never written (§6)"


@pytest.mark.points(1)
@pytest.mark.parametrize("name", BY_CLASS)
def test_strided_view_inputs(worker, name):
    """q, k, v, dO as (B, H, T, D) views of (T, B, H, D) tensors (not contiguous): same results."""
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(n, 2, 3, 16, generator=g) for n in (40, 56, 56, 40)]
    q, k, v, do = (t.permute(1, 2, 0, 3) for t in base)
    o64, _, leaves = attention_float64(q, k, v, True)
    o64.backward(do.double())
    for design in BACKWARD_DESIGNS if name == "FlashAttentionTriton" else (None,):
        # The worker makes the same views of the same (T, B, H, D) tensors, so it sees exactly these strides.
        o, _, grads = run(worker, name, *base, True, backward=True, permute=(1, 2, 0, 3), design=design)
        where = f"{name}, causal, (B, H, T, D) = permute(1, 2, 0, 3) of (T, B, H, D), strides {q.stride()}" + (
            f", backward design {design!r}" if design else "")
        # fp32 inputs: tolerance()'s fp32 bound (~(D + 2·Nk)·u ≈ 7e-6 relative here, D = 16, Nk = 56), 1e-4.
        assert_close(o, o64, name=f"O ({where})", section="handout 03 §5", rtol=1e-4, atol=1e-4)
        for gname, grad, leaf in zip(("dQ", "dK", "dV"), grads, leaves):
            assert_close(grad, leaf.grad, name=f"{gname} ({where})", section="handout 03 §6", rtol=1e-4, atol=1e-4)


# The interpreter runs kernel bodies as Python, so it accepts code the Triton compiler rejects (Python
# lists, raise, data-dependent Python control flow…) and cannot show what exists only in a compiled kernel.
# kit.triton_compile records the kernels FlashAttentionTriton really launches (whatever they are called,
# whatever their parameters), then compiles exactly those for a Hopper GPU (sm_90) with the interpreter
# off — no GPU needed. Both happen in the worker (the kernels are the implementation's code); the compiler's
# verdict and its IR come back as data, and the tests below read them here.
_COMPILED: dict[str, tuple] = {}


def compiled_kernels(worker) -> tuple[int, list]:
    """(batch·heads, [CompileReport]) for the fp16 and fp32 launches of a causal forward + backward
    (Nq = 40 < Nk = 72, D = 64): fp16 takes the GPU path (tensor cores, no upcast) even in the
    interpreter, fp32 the exact-precision one. Compiled once per session, in the worker."""
    package = kit.impl.selected()
    if package not in _COMPILED:
        reports = [triton_compile.CompileReport.from_data(r) for r in worker.call(_compiled_kernels)]
        _COMPILED[package] = (math.prod(COMPILE_BH), reports)
    return _COMPILED[package]


@pytest.mark.points(2)
@pytest.mark.builds("triton-attention")
def test_triton_kernels_compile_for_a_gpu(worker):
    """Every kernel the forward and backward launch compiles for a Hopper GPU (sm_90) with the
    interpreter off, and fits its shared memory — no GPU needed."""
    _, reports = compiled_kernels(worker)
    assert reports, ("FlashAttentionTriton launched no @triton.jit kernel: the forward and backward must run "
                     "Triton kernels (kernel[grid](...)), not PyTorch code (handout 03 §5).")
    for r in reports:
        where = triton_compile.describe(r.launch)
        assert not r.error, (f"{where} runs in the interpreter but does not compile for a GPU (sm_90). The "
                             f"compiler says:\n{r.error}\n(handout 03 §5: the interpreter accepts Python the "
                             "compiler rejects.)")
        assert r.shared <= triton_compile.SM90_SHARED_BYTES, (
            f"{where} needs {r.shared} bytes of shared memory; an H100 block has at most "
            f"{triton_compile.SM90_SHARED_BYTES}. Use smaller tiles (handout 03 §5).")
        print(where, f"shared {r.shared} B", r.ptxas.replace("\n", " | "))
        if r.spills:
            print(f"note: {where} spills {r.spills} bytes of registers at these tile sizes (not graded here)")


@pytest.mark.points(1)
@pytest.mark.builds("triton-attention")
def test_triton_fp32_matmuls_run_at_ieee_precision(worker):
    """Compiled for a GPU, every fp32 tl.dot is exact fp32 (input_precision="ieee"), not TF32."""
    _, reports = compiled_kernels(worker)
    assert reports and not any(r.error for r in reports), "the kernels must compile first (see the compile test)"
    for r in reports:
        bad = triton_compile.tf32_dots(r.ttir)
        assert not bad, (
            f"{triton_compile.describe(r.launch)}: compiled for a GPU, {len(bad)} tl.dot on fp32 tiles run in TF32 "
            f"(10-bit mantissa, ~1e-3 relative error — fp32 must agree to 1e-4), e.g.\n  {bad[0]}\n"
            "tl.dot defaults to TF32 on a GPU; pass input_precision=DOT_PRECISION (\"ieee\" for fp32) to every "
            "tl.dot (handout 03 §5). The interpreter always multiplies exactly, so only the compiled IR shows it.")


@pytest.mark.points(1)
@pytest.mark.builds("triton-attention")
def test_triton_batch_head_offsets_are_64_bit(worker):
    """Compiled for a GPU, the batch·head program id times a stride is computed in 64 bits."""
    bh, reports = compiled_kernels(worker)
    assert reports and not any(r.error for r in reports), "the kernels must compile first (see the compile test)"
    for r in reports:
        axis = triton_compile.batch_head_axis(r.launch, bh)
        if axis is None:
            continue  # no grid axis indexes batch·heads alone: nothing to check
        bad = triton_compile.narrow_offsets(r.ttir, axis)
        assert not bad, (
            f"{triton_compile.describe(r.launch)}: tl.program_id({axis}) (the batch·head index) is multiplied by "
            f"a runtime argument in 32 bits, e.g.\n  {bad[0]}\nbh · stride passes 2³¹ for long sequences "
            "(B·H·N·D > 2·10⁹ elements) and wraps to a negative offset; cast first: "
            f"tl.program_id({axis}).to(tl.int64) (handout 03 §5).")


# CUDA launches at most 65,535 programs along grid axes 1 and 2 (y, z) and 2³¹ − 1 along axis 0 (x). B·H =
# 65,600 (e.g. 512 sequences × 128 heads, then some) must therefore not sit on axis 1 or 2. The interpreter
# would take minutes to run 65,600 programs and never enforces the limit, so the kernels are recorded
# (kernel, grid) without being run: the check reads only the grids the launchers ask for.
CUDA_GRID_LIMITS = (2**31 - 1, 65_535, 65_535)


@pytest.mark.points(1)
@pytest.mark.builds("triton-attention")
def test_triton_grids_fit_cuda_limits_for_many_heads(worker):
    """With batch·heads = 65,600 every forward and backward launch grid fits CUDA's per-axis limits."""
    launches = [triton_compile.Launch.from_data(d) for d in worker.call(_launches_for_many_heads)]
    assert launches, ("FlashAttentionTriton launched no @triton.jit kernel: the forward and backward must run "
                      "Triton kernels (kernel[grid](...)), not PyTorch code (handout 03 §5).")
    for la in launches:
        grid = tuple(la.grid) + (1,) * (3 - len(la.grid))
        for axis, (n, limit) in enumerate(zip(grid, CUDA_GRID_LIMITS)):
            assert 1 <= n <= limit, (
                f"{triton_compile.describe(la)} with batch·heads = {MANY_HEADS}: grid axis {axis} has {n} "
                f"programs, CUDA allows at most {limit} on axis {axis} — the launch fails on a GPU. Put the "
                "batch·head index on axis 0 (2³¹ − 1 programs) and the tiles on axis 1: "
                "grid = (B·H, ⌈N / BLOCK⌉) (handout 03 §5).")


# ------------------------------------------------------------------------------------ using it (§8)


@pytest.mark.points(3)
@pytest.mark.builds("sdpa", "triton-attention")
def test_flash_attention_trains_the_transformer(worker):
    """flash_attention_fn is a drop-in for TransformerLM: same logits and gradients as naive attention."""
    torch.manual_seed(0)
    naive_model = TransformerLM("tiny").to(DEVICE)
    # Built where the flash model used to be, drawing the same random numbers: the tokens are the same as ever.
    TransformerLM("tiny")
    tokens = torch.randint(0, naive_model.config.vocab_size, (1, 40), device=DEVICE)
    # The worker builds the same model with flash_attention_fn, loads these weights and runs the same step.
    state = {name: t.cpu() for name, t in naive_model.state_dict().items()}
    flash = worker.call(_train_with_flash_attention, state, tokens.cpu())
    naive_logits = naive_model(tokens)
    naive_logits.float().square().mean().backward()
    # fp32 against fp32 (naive attention): each side is within K·u·Σ|terms| of exact per matmul (K ≤ 256: 1.5e-5
    # relative), typically √K·u ≈ 1e-6; measured 6e-7 apart at |logits| ≲ 2. Logits: rtol 1e-4, atol 1e-4.
    # The gradients (|g| ≲ 1e-2) pass through ~10 matmuls each side: worst case ~10·1.5e-5 relative, under rtol 1e-3;
    # near zero, where terms cancel, ≲ K·u·Σ|terms| ≲ 1.5e-7 absolute, under atol 1e-6 (typical √K·u·|g| ≲ 1e-9,
    # measured ≤ 2e-9 apart). An atol of 1e-5 would have been 1–3 % of most elements (|g| ≲ 1e-3).
    assert_close(flash["logits"], naive_logits, name="logits with flash_attention_fn", section="handout 03 §8",
                 rtol=1e-4, atol=1e-4)
    for (name, p_flash_grad), p_naive in zip(flash["grads"], naive_model.parameters()):
        assert_close(p_flash_grad, p_naive.grad, name=f"gradient of {name} with flash_attention_fn",
                     section="handout 03 §8", rtol=1e-3, atol=1e-6)
    # The convenience function routes to either implementation.
    q, k, v, _ = make_inputs((1, 33, 16), (1, 45, 16), torch.float32)
    o64, _, _ = attention_float64(q, k, v, True)
    by_backend = worker.call(_flash_attention_by_backend, q, k, v)
    for backend in ("pytorch", "triton"):  # fp32 against float64: tolerance()'s fp32 1e-4
        assert_close(by_backend[backend], o64, name=f"flash_attention(backend={backend!r})",
                     section="handout 03 §8", rtol=1e-4, atol=1e-4)


@pytest.mark.points(2)
@pytest.mark.builds("sdpa", "triton-attention")
def test_bad_inputs_raise_clear_errors(worker):
    """Bad input gives a TypeError/ValueError that names what is wrong (after good input works)."""
    q, k, v, _ = make_inputs((2, 20, 16), (2, 24, 16), torch.float32)
    for name in ("FlashAttentionPytorch", "FlashAttentionTriton"):
        # What each bad call must raise, naming what; the worker builds the arguments (a "meta" k, q[..., :12]…).
        bad = {
            "integer dtype": (TypeError, "q must be float32"),
            "mixed dtypes": (TypeError, "dtype"),
            "head dims differ": (ValueError, "head dimension"),
            "batch dims differ": (ValueError, "leading"),
            "k and v lengths differ": (ValueError, "keys"),
            "devices differ": (ValueError, "device"),
        }
        if name == "FlashAttentionTriton":
            bad["unsupported head dim"] = (ValueError, "head dimension")
        got = worker.call(_bad_input_outcomes, name, q, k, v, list(bad))
        shape = tuple(got["shape"])
        assert shape == q.shape, f"{name} output shape {shape}, expected {tuple(q.shape)}"
        for case, (error, phrase) in bad.items():
            assert_raised(got["outcomes"][case], error, phrase, what=f"{name}.apply with {case}",
                          section="handout 03, problem 3.5")
            print(f"{name}: {case} → {error.__name__}")
    assert_raised(worker.call(_unknown_backend, q, k, v), ValueError, "backend",
                  what="flash_attention(backend='cuda')", section="handout 03, problem 3.5")


# ------------------------------------------------------------------------------------ GPU checks (no points)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.builds("triton-attention")
def test_gpu_compiled_kernels_match_float64(worker, dtype, head_dim):
    """Compiled Triton kernels at larger, odd sizes, every dtype and head dim, causal and not."""
    for is_causal in (False, True):
        for q_shape, kv_shape in [((2, 4, 1000, head_dim), (2, 4, 1000, head_dim)),
                                  ((3, 517, head_dim), (3, 1531, head_dim))]:
            q, k, v, do = make_inputs(q_shape, kv_shape, dtype, device="cuda")
            # The fixed launch configs: autotuning every variant here would compile hundreds of kernels.
            o, saved, grads = run(worker, "FlashAttentionTriton", q, k, v, do, is_causal, backward=True,
                                  autotune=False)
            o64, L64, leaves = attention_float64(q, k, v, is_causal)
            o64.backward(do.double())
            where = f"GPU {dtype} D={head_dim} causal={is_causal} q {q_shape} k/v {kv_shape}"
            assert_close(o, o64, name=f"O ({where})", section="handout 03 §5", **tolerance(q, k, v, is_causal, "o"))
            # L is fp32 whatever the dtype (check_forward): a D ≤ 128 fp32 sum, ≲ 6e-5 worst case, ~1e-6 typical; 1e-3.
            assert_close(saved_logsumexp(saved, q_shape, where), L64, name=f"L ({where})", section="handout 03 §5",
                         rtol=1e-4, atol=1e-3)
            for name, grad, leaf in zip(("dQ", "dK", "dV"), grads, leaves):
                assert_close(grad, leaf.grad, name=f"{name} ({where})", section="handout 03 §6",
                             **tolerance(q, k, v, is_causal, name, do))


@pytest.mark.gpu
@pytest.mark.builds("triton-attention")
def test_gpu_autotuned_kernels_are_right_and_deterministic(worker):
    """Autotuned kernels (bf16): correct, and the backward bitwise reproducible with programs really
    running concurrently."""
    q, k, v, do = make_inputs((2, 8, 2048, 64), (2, 8, 2048, 64), torch.bfloat16, device="cuda")
    runs = worker.call(_run_repeatedly, "FlashAttentionTriton", q, k, v, do, True, 4)
    o, (first, *others) = runs["o"], runs["grads"]
    o64, _, leaves = attention_float64(q, k, v, True)
    o64.backward(do.double())
    assert_close(o, o64, name="O (autotuned)", section="handout 03 §5", **tolerance(q, k, v, True, "o"))
    for name, grad, leaf in zip(("dQ", "dK", "dV"), first, leaves):
        assert_close(grad, leaf.grad, name=f"{name} (autotuned)", section="handout 03 §6",
                     **tolerance(q, k, v, True, name, do))
    for again in others:
        for name, a, b in zip(("dQ", "dK", "dV"), first, again):
            assert torch.equal(a, b), f"{name} differs between identical backward passes. See handout 03 §6."
