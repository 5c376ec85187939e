"""Stage 7, part one — the LM head and the cross-entropy, fused (handout/07-fused-loss.md).

Every loss and gradient is compared with the same loss computed in float64 from the same (rounded) inputs:
``F.cross_entropy(h W ᵀ, targets, ignore_index=…)`` with autograd, in this process (the judge). Tolerances follow
Stage 3's rule, with an explicit floor (see :func:`tolerance`): the error against float64 may be at most twice
the error of the plain PyTorch loss run in that dtype — full logits in the input dtype, upcast to fp32,
``F.cross_entropy`` — plus what rounding the output alone costs. A fused loss is as accurate as the obvious one.

The implementation runs in the worker (``worker.call``): the module-level functions of the first part call it —
with recording stand-ins where a test observes how it works (every tensor created, what autograd saves, atomics,
the kernels launched and their compiled IR) — and return what they saw as data. The tests in the second part
compute the float64 references and the tolerances here and compare.

Without CUDA the Triton kernels run in the interpreter, so the sizes are small: tens of tokens, about a hundred
vocabulary entries, d of 16–64, none a multiple of any tile size.
"""

from __future__ import annotations

import contextlib
import importlib
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import kit  # noqa: F401 — before triton: the interpreter on machines without CUDA
import kit.impl
from kit import triton_compile
from kit.allocations import Allocations
from kit.checks import outcome_of
from kit.testing import assert_close, assert_equal, assert_raised

pytestmark = [
    pytest.mark.stage7,
    # Every test here grades the fused loss: a PyTorch loss behind it loses them all (tests/test_stage7_rules.py).
    pytest.mark.builds("triton-loss"),
    # triton 3.6's interpreter converts 1-element arrays with int(); numpy warns on every loop bound.
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (hidden shape, V): flat rows and (B, T, d); token counts, V and d are multiples of no tile size (16, 32, 64…).
SHAPES = [((37, 40), 101), ((2, 19, 24), 77)]
UPSTREAM = 0.7  # dloss: the gradients must be scaled by what flows into the loss, not assume 1
IGNORE = -100
# Unit roundoff of each dtype: the error of rounding one value to it is at most |x|·u.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
SECTION_FORWARD, SECTION_BACKWARD, SECTION_MEMORY = "handout 07 §2", "handout 07 §3", "handout 07 §1–§2"


def make_inputs(hidden_shape: tuple[int, ...], vocab: int, dtype: torch.dtype, *, seed: int = 0,
                ignore_every: int = 5, ignore_index: int = IGNORE, scale: float = 1.0, device: str = DEVICE):
    """hidden, weight, targets from a seeded generator (the judge and a worker that call it get the same tensors).

    Logits come out about N(0, scale²): weight rows have norm ≈ 1. Every ``ignore_every``-th target is
    ``ignore_index`` (0: none)."""
    g = torch.Generator().manual_seed(seed)
    d = hidden_shape[-1]
    h = (scale * torch.randn(hidden_shape, generator=g)).to(device=device, dtype=dtype)
    w = (torch.randn(vocab, d, generator=g) / d**0.5).to(device=device, dtype=dtype)
    t = torch.randint(0, vocab, hidden_shape[:-1], generator=g)
    if ignore_every:
        t.view(-1)[::ignore_every] = ignore_index
    return h, w, t.to(device)


# ----------------------------------------------------------------------------------------------------
# What runs in the worker: the implementation, called with recording stand-ins; data back
# ----------------------------------------------------------------------------------------------------


def _module():
    """The implementation's ``whole_step.fused_cross_entropy`` module."""
    return importlib.import_module(f"{kit.impl.selected()}.whole_step.fused_cross_entropy")


# The padded case: rows of NaN after the last row of hidden and of W (any tile of up to 256 rows ends inside them)
# and NaN columns after each row's d features.
PAD_ROWS, PAD_COLUMNS = 256, 8


def _in_nan_buffer(x: torch.Tensor) -> torch.Tensor:
    """``x`` (2-D) copied into the top-left corner of a NaN-filled buffer with PAD_ROWS more rows and PAD_COLUMNS
    more columns, returned as the view of that corner: row stride d + PAD_COLUMNS, NaN after each row and after the
    last row. Autograd flows back to ``x``."""
    buffer = torch.full((x.shape[0] + PAD_ROWS, x.shape[1] + PAD_COLUMNS), float("nan"), dtype=x.dtype,
                        device=x.device)
    buffer[: x.shape[0], : x.shape[1]] = x
    return buffer[: x.shape[0], : x.shape[1]]


def _run(h, w, t, *, ignore_index: int = IGNORE, upstream: float | None = UPSTREAM, transposed: bool = False,
         padded: bool = False, grad_hidden: bool = True, grad_weight: bool = True) -> dict:
    """In the worker: the loss of ``fused_linear_cross_entropy`` and, when ``upstream`` is not None, the gradients
    of ``upstream · loss`` for hidden and weight, as data. ``transposed``: ``h`` is ``(T, B, d)`` and the loss gets
    the ``(B, T, d)`` view ``h.transpose(0, 1)`` (not contiguous), made here; dH comes back as ``(B, T, d)``.
    ``padded``: hidden ``(N, d)`` and weight are given as views of NaN-filled buffers (:func:`_in_nan_buffer`).
    ``grad_hidden`` / ``grad_weight`` False: that input does not require grad (its gradient comes back None)."""
    leaf_h, leaf_w = h.clone().requires_grad_(grad_hidden), w.clone().requires_grad_(grad_weight)
    hidden = leaf_h.transpose(0, 1) if transposed else leaf_h
    weight = leaf_w
    if padded:
        hidden, weight = _in_nan_buffer(hidden), _in_nan_buffer(weight)
    loss = _module().fused_linear_cross_entropy(hidden, weight, t, ignore_index=ignore_index)
    out = {"loss": loss.detach(), "dh": None, "dw": None}
    if upstream is not None:
        (loss * upstream).backward()
        dh = leaf_h.grad
        out["dh"] = dh.transpose(0, 1).contiguous() if transposed and dh is not None else dh
        out["dw"] = leaf_w.grad
    return out


def _run_twice(h, w, t) -> dict:
    """Two identical forward + backward passes, and the atomic operations their kernels issued."""
    atomics: list[str] = []
    with contextlib.ExitStack() as stack:
        if kit.triton_interpreted():
            # Programs run one after another in the interpreter, so an atomic reduction would still be
            # reproducible here; record atomics instead — on a GPU they make the summation order random.
            from triton.runtime.interpreter import InterpreterBuilder

            for name in ("create_atomic_rmw", "create_atomic_cas"):
                original = getattr(InterpreterBuilder, name)

                def recording(self, *args, _original=original, _name=name, **kwargs):
                    atomics.append(_name)
                    return _original(self, *args, **kwargs)

                stack.enter_context(mock.patch.object(InterpreterBuilder, name, recording))
        first, second = _run(h, w, t), _run(h, w, t)
    return {"first": first, "second": second, "atomics": atomics}


def _memory_record(h, w, t) -> dict:
    """The largest new memory any aten operation allocates during forward + backward (bytes, the tensor's shape
    and dtype, the op), and every tensor autograd saves for the backward (shapes and bytes), as data.

    "New" is :class:`kit.allocations.Allocations`'s: a storage none of the op's arguments already had, so views,
    in-place ops and the Triton interpreter's own views of the kernels' arguments allocate nothing."""
    saved: list[list] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append([list(x.shape), x.numel() * x.element_size()])
        return x

    leaf_h, leaf_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    allocations = Allocations()
    with allocations, torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = _module().fused_linear_cross_entropy(leaf_h, leaf_w, t)
        loss.backward()
    return {"largest": allocations.largest, "what": allocations.what, "saved": saved,
            "grads": [leaf_h.grad is not None, leaf_w.grad is not None]}


def _launch_data(launch: triton_compile.Launch) -> dict:
    return {"module": launch.module, "name": launch.name, "args": launch.args, "grid": launch.grid,
            "options": launch.options}


# What the compile check launches: every dtype, at a ragged size and at the smallest input the contract accepts.
COMPILE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
COMPILE_SHAPES = (((40, 64), 72), ((1, 1), 1))  # (hidden shape, V): 40 tokens, V = 72, d = 64; 1 token, V = 1, d = 1


@contextlib.contextmanager
def launched_as_on_a_gpu():
    """For the duration, the implementation picks its launches as it would on a GPU: ``TRITON_INTERPRET`` reads 0
    (so ``kit.triton_interpreted()`` is False: GPU tiles, no bf16 upcast) and the given ``check_triton_device``
    accepts CPU tensors. Use with ``record_launches(..., execute=False)``: the kernels are recorded, not run."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict("os.environ", {"TRITON_INTERPRET": "0"}))
        module = _module()
        if hasattr(module, "check_triton_device"):
            stack.enter_context(mock.patch.object(module, "check_triton_device", lambda *args, **kwargs: None))
        yield


def _compiled_kernels() -> list[dict]:
    """Records the kernels a forward + backward launches on a GPU — the tiles and flags the implementation picks
    with the interpreter off (:func:`launched_as_on_a_gpu`) — for each of fp32, fp16 and bf16 at each of
    COMPILE_SHAPES, compiles them for sm_90 in the worker's scratch folder, and returns each report as data."""
    def forward_and_backward():
        for dtype in COMPILE_DTYPES:
            for hidden_shape, vocab in COMPILE_SHAPES:
                h, w, t = make_inputs(hidden_shape, vocab, dtype, ignore_every=5 if vocab > 1 else 0)
                _run(h, w, t)

    with launched_as_on_a_gpu():
        launches = triton_compile.record_launches(forward_and_backward, execute=False)
    root = Path(__file__).resolve().parent.parent
    reports = triton_compile.compile_launches(launches, Path(tempfile.mkdtemp(prefix="sm90-")), root,
                                              cache=triton_compile.user_cache_dir()) if launches else []
    return [{"launch": _launch_data(r.launch), "error": r.error, "shared": r.shared, "ptxas": r.ptxas,
             "ttir": r.ttir} for r in reports]


def _bad_input_outcomes(h, w, t, cases: list[str]) -> dict:
    """The loss on good input, then what each bad input in ``cases`` did (the worker builds the arguments)."""
    fn = _module().fused_linear_cross_entropy
    loss = fn(h, w, t)
    vocab = w.shape[0]
    out_of_range, negative = t.clone(), t.clone()
    out_of_range[0, 3] = vocab
    negative[1, 2] = -1
    bad = {
        "hidden and weight dtypes differ": ((h, w.bfloat16(), t), {}),
        "integer hidden": ((h.to(torch.int32), w, t), {}),
        "targets not int64": ((h, w, t.to(torch.int32)), {}),
        "weight d differs from hidden d": ((h, torch.randn(vocab, h.shape[-1] + 1), t), {}),
        "weight not 2-D": ((h, w[None], t), {}),
        "targets of the wrong shape": ((h, w, t[:, :-1]), {}),
        "a target equal to V": ((h, w, out_of_range), {}),
        "a negative target other than ignore_index": ((h, w, negative), {}),
        "weight on another device": ((h, w.to("meta"), t), {}),
        "hidden not a tensor": ((h.tolist(), w, t), {}),
        "ignore_index not an int": ((h, w, t), {"ignore_index": 1.5}),
    }
    return {"loss": loss.detach(),
            "outcomes": {case: outcome_of(fn, *bad[case][0], **bad[case][1]) for case in cases}}


# ----------------------------------------------------------------------------------------------------
# The judge's side: float64 references, tolerances, and the tests
# ----------------------------------------------------------------------------------------------------


def loss_float64(h, w, t, *, ignore_index: int = IGNORE, upstream: float = UPSTREAM) -> dict:
    """The loss and the gradients of ``upstream · loss`` in float64 (from the inputs as given, already rounded to
    their dtype). With no counted token the loss is NaN and the gradients are 0.

    Also what the error model of :func:`tolerance` needs: the largest |logit|, and for each gradient the sums of
    the absolute values of its terms, ``|c|·(P + Y)|W|`` and ``|c|·(P + Y)ᵀ|H|`` (P the softmax, Y the one-hot
    targets, both on counted rows; c = upstream / n)."""
    h64, w64 = h.detach().cpu().double().requires_grad_(), w.detach().cpu().double().requires_grad_()
    targets = t.cpu().reshape(-1)
    logits = h64.reshape(-1, w64.shape[1]) @ w64.T
    loss = F.cross_entropy(logits, targets, ignore_index=ignore_index)
    (loss * upstream).backward()
    with torch.no_grad():
        counted = targets != ignore_index
        terms = torch.softmax(logits, dim=-1) * counted[:, None]
        terms[counted, targets[counted]] += 1.0
        c = abs(upstream) / max(int(counted.sum()), 1)
        terms_dh = c * terms @ w64.abs()
        terms_dw = c * terms.T @ h64.reshape(-1, w64.shape[1]).abs()
    return {"loss": loss.detach(), "dh": h64.grad, "dw": w64.grad, "max_logit": logits.detach().abs().max().item(),
            "terms_dh": terms_dh, "terms_dw": terms_dw}


def loss_plain(h, w, t, *, ignore_index: int = IGNORE, upstream: float = UPSTREAM) -> dict:
    """The plain loss in the inputs' dtype: ``(h Wᵀ)`` in that dtype, upcast to fp32, ``F.cross_entropy`` — what
    ``kit.model.cross_entropy(model(tokens), targets)`` computes — and its gradients (torch's own code)."""
    hl, wl = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    logits = hl.reshape(-1, wl.shape[1]) @ wl.T
    loss = F.cross_entropy(logits.float(), t.reshape(-1), ignore_index=ignore_index)
    (loss * upstream).backward()
    return {"loss": loss.detach(), "dh": hl.grad, "dw": wl.grad}


def tolerance(h, w, t, quantity: str, *, ignore_index: int = IGNORE, upstream: float = UPSTREAM) -> dict:
    """``atol`` for ``quantity`` ("loss", "dh", "dw"): 2 × the plain loss's error in the inputs' dtype + a floor.

    The floor is what rounding costs even a perfect kernel (handout 07 §3, "How close is close"):

    * the final rounding of the output, u_out · max|expected| (u_out of fp32 for the loss, of the input dtype for
      the gradients);
    * the fp32 logits. Each logit z, and the saved lse, carries a few ulps of its own size, |δ| ≲ 16 · u_fp32 ·
      (max|z| + 1): the loss lse − z_target moves by that much, and every p = exp(z − lse) by that much
      relatively — so a gradient, a sum of terms p·W (or p·h) that may cancel, moves by that times the sum of its
      terms' absolute values, not times its own size. This matters only when the logits are large."""
    exact = loss_float64(h, w, t, ignore_index=ignore_index, upstream=upstream)
    plain = loss_plain(h, w, t, ignore_index=ignore_index, upstream=upstream)
    err = (plain[quantity].double().cpu() - exact[quantity]).abs().max().item()
    u_out = UNIT_ROUNDOFF[torch.float32 if quantity == "loss" else h.dtype]
    shift = 16 * UNIT_ROUNDOFF[torch.float32] * (exact["max_logit"] + 1)
    terms = 1.0 if quantity == "loss" else exact[f"terms_{quantity}"].max().item()
    biggest = exact[quantity].abs().max().item() if exact[quantity].isfinite().all() else 0.0
    return {"rtol": 0.0, "atol": 2 * err + u_out * biggest + shift * terms}


def check_against_float64(got: dict, h, w, t, where: str, *, ignore_index: int = IGNORE, backward: bool = True,
                          upstream: float = UPSTREAM) -> None:
    exact = loss_float64(h, w, t, ignore_index=ignore_index, upstream=upstream)
    assert_equal(got["loss"].dtype, torch.float32, name=f"loss dtype ({where})", section=SECTION_FORWARD)
    assert_equal(tuple(got["loss"].shape), (), name=f"loss shape ({where}): one number, the mean",
                 section=SECTION_FORWARD)
    assert_close(got["loss"], exact["loss"], name=f"loss ({where})", section=SECTION_FORWARD,
                 **tolerance(h, w, t, "loss", ignore_index=ignore_index, upstream=upstream))
    if not backward:
        return
    for key, grad, like in (("dh", "dH = ∂(dloss·loss)/∂hidden", h), ("dw", "dW = ∂(dloss·loss)/∂weight", w)):
        assert got[key] is not None, f"{grad} is None ({where}): backward must return gradients for hidden and weight"
        assert_equal(got[key].dtype, like.dtype, name=f"{grad} dtype ({where})", section=SECTION_BACKWARD)
        assert_close(got[key], exact[key], name=f"{grad} ({where}, dloss = {upstream})", section=SECTION_BACKWARD,
                     **tolerance(h, w, t, key, ignore_index=ignore_index, upstream=upstream))


def describe(hidden_shape, vocab, dtype, extra: str = "") -> str:
    return f"{str(dtype).removeprefix('torch.')}, hidden {hidden_shape}, V = {vocab}, every 5th token ignored{extra}"


# ------------------------------------------------------------------------------------ the forward (§2)


@pytest.mark.points(2)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_fused_loss_forward_matches_float64(worker, dtype):
    """The loss (fp32, 0-dim) equals the float64 cross-entropy of h Wᵀ: flat rows and (B, T, d), ragged sizes."""
    for hidden_shape, vocab in SHAPES:
        h, w, t = make_inputs(hidden_shape, vocab, dtype)
        got = worker.call(_run, h, w, t, upstream=None)
        check_against_float64(got, h, w, t, describe(hidden_shape, vocab, dtype), backward=False)


@pytest.mark.points(2)
def test_fused_loss_large_logits_do_not_overflow(worker):
    """Logits of ±300 and logits all near −1000: the online log-sum-exp subtracts its running maximum."""
    # exp(z) overflows fp32 past z ≈ 88.7 and underflows to 0 below z ≈ −103: log Σ exp(z) is only computable as
    # m + log Σ exp(z − m) with m the row maximum — a running maximum that starts at −inf, not at 0.
    h, w, t = make_inputs((37, 40), 101, torch.float32, scale=60.0, seed=1)
    got = worker.call(_run, h, w, t)
    where = "fp32, hidden (37, 40), V = 101, logits up to ±300"
    assert torch.isfinite(got["loss"]).all(), (
        f"the loss is {got['loss'].item()} ({where}): exp(z) overflowed. Subtract the running maximum before "
        "exponentiating: s = s·exp(m − m_new) + Σ exp(z − m_new), lse = m + log s (handout 07 §2).")
    for key in ("dh", "dw"):
        assert torch.isfinite(got[key]).all(), (
            f"{key} has non-finite values ({where}) while the loss is finite: the backward overflowed — recompute "
            "p = exp(z − lse) from the saved lse (≤ 1, never exp(z) alone) — or a kernel read past the end of W or "
            "hidden (mask every load: 0·garbage can be NaN) (handout 07 §3).")
    check_against_float64(got, h, w, t, where)
    # A constant feature with weight −1000 shifts every logit by −1000: exp underflows to 0 unless m starts at −inf.
    h, w, t = make_inputs((37, 40), 101, torch.float32, seed=2)
    h[:, 0], w[:, 0] = 1.0, -1000.0
    got = worker.call(_run, h, w, t)
    where = "fp32, hidden (37, 40), V = 101, every logit near −1000"
    assert torch.isfinite(got["loss"]), (
        f"the loss is {got['loss'].item()} ({where}): Σ exp(z) underflowed to 0. The running maximum must start at "
        "−inf (not 0), so that exp(z − m) is taken relative to the true row maximum (handout 07 §2).")
    check_against_float64(got, h, w, t, where)


# ------------------------------------------------------------------------------------ the backward (§3)


def check_reads_inside(got: dict, where: str) -> None:
    """Teaching messages for the padded case: a non-finite result there means a kernel read the NaN around the
    views — which kernel, from which output is the first to be poisoned."""
    finite = {key: got[key] is None or bool(torch.isfinite(got[key]).all()) for key in ("loss", "dh", "dw")}
    if not finite["loss"]:
        raise AssertionError(
            f"the loss is {got['loss'].item()} ({where}): the forward read outside hidden or weight. A valid view's "
            "rows need not be d elements apart: take each row stride from the tensor (hidden.stride(0), "
            "weight.stride(0) of the (N, d) rows), not d, and mask every load (tokens < N, vocabulary < V, "
            f"features < d) ({SECTION_FORWARD}).")
    if not finite["dh"]:
        raise AssertionError(
            f"dH has non-finite values ({where}) while the loss is finite: the dH kernel reads past the end of W "
            "(its rows ≥ V are NaN here; elsewhere they are whatever memory follows W, and 0·NaN = NaN even where dZ "
            "is 0): mask the vocabulary tile (cols < V) in every load of W, and use W's row stride, not d "
            f"({SECTION_BACKWARD}).")
    if not finite["dw"]:
        raise AssertionError(
            f"dW has non-finite values ({where}) while the loss is finite: the dW kernel reads past the end of hidden "
            "(its rows ≥ N are NaN here): mask the token tile (rows < N) in every load of hidden, and use its row "
            f"stride, not d ({SECTION_BACKWARD}).")


@pytest.mark.points(2)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_fused_loss_gradients_match_float64(worker, dtype):
    """dH and dW of dloss·loss (dloss = 0.7) equal float64 autograd: hidden and weight as views of NaN-filled buffers
    (rows d + 8 elements apart, NaN after each row and after the last: nothing outside a view may be read), flat
    rows, and a (B, T, d) view that is not contiguous; ragged sizes, some tokens ignored; gradients in the inputs'
    dtype."""
    # The padded case first: in the others, whatever memory follows W and hidden decides whether a read past their
    # end shows (NaN there poisons a gradient; zeros hide it).
    for (hidden_shape, vocab), layout in zip([SHAPES[0], *SHAPES], ("padded", "rows", "transposed")):
        h, w, t = make_inputs(hidden_shape, vocab, dtype)
        if layout == "transposed":  # the worker passes h.transpose(0, 1) of this (T, B, d) tensor: strides (d, B·d, 1)
            base = h.transpose(0, 1).contiguous()
            got = worker.call(_run, base, w, t, transposed=True)
            where = describe(hidden_shape, vocab, dtype, ", hidden a (B, T, d) view of a (T, B, d) tensor")
        elif layout == "padded":  # big[:N, :d] of NaN-filled buffers with PAD_ROWS more rows, PAD_COLUMNS more columns
            got = worker.call(_run, h, w, t, padded=True)
            d = hidden_shape[-1]
            where = describe(hidden_shape, vocab, dtype, f", hidden and weight views big[:N, :{d}] with row stride "
                             f"{d + PAD_COLUMNS} of buffers holding NaN outside them ({PAD_ROWS} rows after the last)")
            check_reads_inside(got, where)
        else:
            got = worker.call(_run, h, w, t)
            where = describe(hidden_shape, vocab, dtype)
        check_against_float64(got, h, w, t, where)


@pytest.mark.points(1)
def test_fused_loss_one_input_frozen(worker):
    """Only the inputs that require grad get a gradient: a frozen LM head (weight without grad) still gives dH,
    detached hidden states still give dW, and the frozen input's .grad stays None."""
    h, w, t = make_inputs((37, 40), 101, torch.float32)
    exact = loss_float64(h, w, t)
    for grad_hidden in (True, False):
        got = worker.call(_run, h, w, t, grad_hidden=grad_hidden, grad_weight=not grad_hidden)
        key, other, name = ("dh", "dw", "dH") if grad_hidden else ("dw", "dh", "dW")
        frozen, trained = ("weight", "hidden") if grad_hidden else ("hidden", "weight")
        where = f"fp32, hidden (37, 40), V = 101, {frozen} frozen (requires_grad=False)"
        assert got[key] is not None, (
            f"{name} is None ({where}): {trained} requires grad, so backward must return its gradient. "
            "ctx.needs_input_grad[i] tells whether input i needs one: [0] for hidden, [1] for weight — skip a "
            f"gradient only when its own flag is False ({SECTION_BACKWARD}).")
        assert got[other] is None, f"{frozen} does not require grad ({where}), yet its .grad was set"
        assert_close(got[key], exact[key], name=f"{name} ({where})", section=SECTION_BACKWARD,
                     **tolerance(h, w, t, key))


@pytest.mark.points(2)
def test_fused_loss_gradients_accumulate_in_fp32(worker):
    """bf16, 1,024 vocabulary entries summed into dH and 1,024 tokens into dW — dozens of tiles at any interpreter
    tile size — with partial sums far larger than the result: rounding each partial sum to bf16 loses the answer;
    accumulating in fp32 does not."""
    # dH_t ∝ Σ_v p_tv W_v − W_{y_t}. With W_v = 16 + ε_v the partial sums over vocabulary tiles grow to ≈ 16 while
    # the result is ≈ ε (about 1): each bf16 rounding of a partial sum costs up to half an ulp of 16 = 0.06, and
    # tens of them swamp it. Symmetrically for dW_v ∝ Σ_t p_tv h_t − Σ_{y_t = v} h_t with h_t = 16 + ε_t over 1024
    # tokens. Plain PyTorch rounds each gradient once (fp32 accumulation inside its bf16 matmul): the tolerance.
    g = torch.Generator().manual_seed(3)
    cases = []
    h = (0.3 * torch.randn(16, 16, generator=g)).bfloat16()
    w = (16 + torch.randn(1024, 16, generator=g)).bfloat16()
    cases.append(("dh", "dH", h, w, torch.randint(0, 1024, (16,), generator=g), "bf16, 16 tokens, V = 1024, d = 16, "
                  "weight rows 16 + N(0, 1)"))
    h = (16 + torch.randn(1024, 16, generator=g)).bfloat16()
    w = (0.3 * torch.randn(32, 16, generator=g)).bfloat16()
    cases.append(("dw", "dW", h, w, torch.randint(0, 32, (1024,), generator=g), "bf16, 1024 tokens, V = 32, d = 16, "
                  "hidden rows 16 + N(0, 1)"))
    for key, name, h, w, t, where in cases:
        h, w, t = h.to(DEVICE), w.to(DEVICE), t.to(DEVICE)
        got = worker.call(_run, h, w, t)
        exact = loss_float64(h, w, t)
        assert_close(got[key], exact[key], name=f"{name} ({where}) — accumulate in fp32 across tiles",
                     section=SECTION_BACKWARD, **tolerance(h, w, t, key))


@pytest.mark.points(2)
def test_fused_loss_backward_is_deterministic(worker):
    """Two forward + backward passes give bitwise-equal loss and gradients, and no atomic operation is used."""
    h, w, t = make_inputs((100, 32), 150, torch.float32)
    got = worker.call(_run_twice, h, w, t)
    first, second, atomics = got["first"], got["second"], got["atomics"]
    for key, name in (("loss", "the loss"), ("dh", "dH"), ("dw", "dW")):
        a, b = first[key], second[key]
        assert a is not None and b is not None, f"{name} is None: backward must return gradients (handout 07 §3)"
        assert torch.equal(a, b), (f"{name} differs between two identical passes (max |diff| "
                                   f"{(a.double() - b.double()).abs().max().item():.3g}). See handout 07 §3.")
    assert not atomics, (f"the kernels used atomic operations ({sorted(set(atomics))}): their summation order varies "
                         "from run to run on a GPU. Give every row of dH to one token-tile program and every row of dW "
                         "to one vocabulary-tile program (handout 07 §3).")


# The interpreter runs kernel bodies as Python, so it accepts code the compiler rejects and cannot show what exists
# only in a compiled kernel (tl.dot's precision, shared memory). kit.triton_compile records the kernels the loss
# really launches and compiles exactly those for a Hopper GPU (sm_90) with the interpreter off — no GPU needed.
@pytest.mark.points(2)
def test_fused_loss_kernels_compile_for_a_gpu(worker):
    """Every kernel the forward and backward launch on a GPU — fp32, fp16 and bf16, at 40 tokens × V = 72 × d = 64
    and at the smallest input (1 token, V = 1, d = 1), with the tiles the implementation picks when the interpreter
    is off — compiles for sm_90, fits its shared memory, and multiplies fp32 tiles at IEEE precision (not TF32)."""
    reports = worker.call(_compiled_kernels)
    assert reports, ("the fused loss launched no @triton.jit kernel: the forward and backward must run Triton "
                     "kernels (kernel[grid](...)), not PyTorch code (handout 07 §2).")
    for r in reports:
        launch = triton_compile.Launch(r["launch"]["module"], r["launch"]["name"], r["launch"]["args"],
                                       tuple(r["launch"]["grid"]), r["launch"]["options"])
        where = triton_compile.describe(launch)
        if r["error"] and "K >= 16" in r["error"]:
            raise AssertionError(
                f"{where}, launched as on a GPU, does not compile for sm_90: a tl.dot's inner dimension K is below "
                "16, which the GPU's tl.dot needs (K ≥ 16; the interpreter does not check). Keep every tile "
                "dimension a tl.dot sums over at 16 or more however small the input — 1 token, V = 1, d = 1 is "
                f"valid — and let the masks handle the rest (handout 07 §3). The compiler says:\n{r['error'][-600:]}")
        assert not r["error"], (
            f"{where}, launched as on a GPU (the tiles your code picks with the interpreter off), does not compile "
            "for sm_90. The interpreter runs code the compiler rejects, e.g. a tl.dot whose summed dimension K is "
            "below 16 (a GPU's tl.dot needs K ≥ 16: tiles shrunk for a small input — 1 token, V = 1, d = 1 is valid), "
            "Python lists, raise, Python control flow on tensor values (handout 07 §3). The compiler says (an error "
            f"inside a @triton.jit helper points at the call):\n{r['error']}")
        assert r["shared"] <= triton_compile.SM90_SHARED_BYTES, (
            f"{where} needs {r['shared']:,} bytes of shared memory on a GPU; an H100 block has at most "
            f"{triton_compile.SM90_SHARED_BYTES:,}. Shared memory holds num_stages copies of each tile a tl.dot "
            "reads (BLOCK × BLOCK_D elements of the dtype each): use smaller tiles or fewer stages for this "
            "dtype (handout 07 §3).")
        bad = triton_compile.tf32_dots(r["ttir"])
        assert not bad, (
            f"{where}: compiled for a GPU, {len(bad)} tl.dot on fp32 tiles run in TF32 (10-bit mantissa), e.g.\n  "
            f"{bad[0]}\ntl.dot defaults to TF32 on a GPU; pass input_precision=DOT_PRECISION (\"ieee\" for fp32) to "
            "every tl.dot (handout 07 §3). The interpreter multiplies exactly: only the compiled IR shows it.")
        print(where, f"shared {r['shared']} B", r["ptxas"].replace("\n", " | "))


# ------------------------------------------------------------------------------------ a drop-in loss (§1–§2)


@pytest.mark.points(3)
def test_fused_loss_never_materialises_the_logits(worker):
    """256 tokens × V = 256 (d = 16, fp32): no allocation during forward + backward, and nothing autograd saves,
    comes near the 256 KiB of fp32 logits; a tile, a chunk of tokens, or d-wide rows are fine."""
    # The bound is a quarter of the fp32 logits, N·V bytes: a chunked design whose chunks hold at most a quarter of
    # the tokens passes; the logits in fp32 (4·N·V bytes) or bf16 (2·N·V) do not. What is saved for the backward
    # must be the inputs and per-token statistics (lse: N floats), not the logits in pieces: the total saved is
    # bounded the same way. (N·d and V·d are 16 KiB each here.)
    n, vocab, d = 256, 256, 16
    h, w, t = make_inputs((n, d), vocab, torch.float32)
    got = worker.call(_memory_record, h, w, t)
    logits, bound = 4 * n * vocab, n * vocab
    assert got["largest"] <= bound, (
        f"during forward + backward an operation allocated {got['largest']:,} bytes ({got['what']}); the fp32 logits "
        f"of {n} tokens × V = {vocab} are {logits:,} bytes (allowed per allocation: a quarter, {bound:,}). The logits "
        "were materialised: compute them one tile at a time inside the kernels and never allocate (tokens, V) "
        "(handout 07 §1–§2).")
    saved = sum(size for _, size in got["saved"])
    assert saved <= bound, (
        f"autograd saved {saved:,} bytes for the backward ({len(got['saved'])} tensors of shapes "
        f"{[tuple(shape) for shape, _ in got['saved']][:8]}); the fp32 logits are {logits:,} bytes (allowed: "
        f"{bound:,}). Save the inputs and one float per token (the log-sum-exp), and recompute the logits tile by "
        "tile in the backward (handout 07 §3).")
    assert got["grads"] == [True, True], "the backward gave no gradient for hidden or weight (handout 07 §3)"


@pytest.mark.points(3)
def test_fused_loss_ignore_index(worker):
    """Ignored tokens neither add to the loss nor count in the mean: all but one ignored, an ignore_index that is
    also a class (5), and none counted at all (NaN loss, zero gradients, as F.cross_entropy)."""
    h, w, t = make_inputs((37, 40), 101, torch.float32, ignore_every=0)
    lone = torch.full_like(t, IGNORE)
    lone[17] = t[17]
    got = worker.call(_run, h, w, lone)
    check_against_float64(got, h, w, lone, "fp32, 37 tokens of which 36 ignored: the mean is the one counted token's "
                                           "loss, over 1 token, not 37")
    as_class = t.clone()
    as_class[::3] = 5  # a real class id used as ignore_index: tokens whose target is 5 do not count
    got = worker.call(_run, h, w, as_class, ignore_index=5)
    check_against_float64(got, h, w, as_class, "fp32, ignore_index = 5: tokens with target 5 are ignored (every 3rd)",
                          ignore_index=5)
    none = torch.full_like(t, IGNORE)
    got = worker.call(_run, h, w, none)
    where = "fp32, every token ignored"
    assert torch.isnan(got["loss"]), (
        f"the loss is {got['loss'].item()} ({where}); F.cross_entropy gives NaN — the mean over 0 counted tokens, "
        "0/0. Divide the sum by the number of counted tokens (handout 07 §2).")
    for key, name in (("dh", "dH"), ("dw", "dW")):
        assert got[key] is not None and torch.equal(got[key], torch.zeros_like(got[key])), (
            f"{name} ({where}) is not exactly 0: no token counts, so no token may contribute (max |{name}| "
            f"{got[key].abs().max().item() if got[key] is not None else 'None'}); keep the scale dloss/n out of "
            "ignored rows with a where, not a multiplication (handout 07 §3).")


@pytest.mark.points(2)
def test_fused_loss_bad_inputs_raise_clear_errors(worker):
    """Bad input gives a TypeError/ValueError that names what is wrong (after good input works)."""
    h, w, t = make_inputs((2, 9, 16), 40, torch.float32, ignore_every=0)
    bad = {
        "hidden and weight dtypes differ": (TypeError, "dtype"),
        "integer hidden": (TypeError, "hidden"),
        "targets not int64": (TypeError, "int64"),
        "weight d differs from hidden d": (ValueError, "hidden"),
        "weight not 2-D": (ValueError, "weight"),
        "targets of the wrong shape": (ValueError, "targets"),
        "a target equal to V": (ValueError, "targets"),
        "a negative target other than ignore_index": (ValueError, "targets"),
        "weight on another device": (ValueError, "device"),
        "hidden not a tensor": (TypeError, "hidden"),
        "ignore_index not an int": (TypeError, "ignore_index"),
    }
    got = worker.call(_bad_input_outcomes, h, w, t, list(bad))
    assert torch.isfinite(got["loss"]), f"the loss on good input is {got['loss'].item()}"
    for case, (error, phrase) in bad.items():
        assert_raised(got["outcomes"][case], error, phrase, what=f"fused_linear_cross_entropy with {case}",
                      section="handout 07, problem 7.3")
        print(f"{case} → {error.__name__}")
