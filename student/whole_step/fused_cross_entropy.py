# Your work goes in this file. Generated from the kit's reference by `make student`.
"""The LM head and the cross-entropy, fused: the loss and its gradients without the logits (handout 07 §1–§3).

Public API (the tests call exactly this):

    fused_linear_cross_entropy(hidden, weight, targets, *, ignore_index=-100) -> loss

``hidden`` ``(..., d)`` and ``weight`` ``(V, d)`` of one float dtype (fp32, bf16 or fp16), ``targets`` ``(...)``
int64 (``ignore_index`` marks tokens that do not count). Returns the mean cross-entropy over the counted tokens
as a 0-dim fp32 tensor, differentiable with respect to ``hidden`` and ``weight`` (gradients in their dtypes),
without ever holding the ``(tokens, V)`` logits. Equal to
``F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=ignore_index)`` in every case — including
the one where no token counts: the mean of nothing is NaN, as PyTorch says, and the gradients are exactly 0.

The maths (handout 07 §2–§3). Flatten the tokens to rows: h ``(N, d)``, W ``(V, d)``, targets y ``(N,)``. The
logits are z = h Wᵀ ``(N, V)``; token t's loss is

    ℓ_t = lse_t − z_{t, y_t},      lse_t = log Σ_v exp(z_tv)      (the log-sum-exp of row t)

and the loss is L = (1/n) Σ_{t counted} ℓ_t, n = the number of counted tokens. Its gradient with respect to the
logits is ∂L/∂z_tv = (softmax(z_t)_v − [v = y_t]) / n on counted rows, 0 on ignored ones, with
softmax(z_t)_v = exp(z_tv − lse_t); the chain rule through z = h Wᵀ gives

    dH = dZ W  (N × d)          dW = dZᵀ H  (V × d)           dZ = dloss · ∂L/∂z

Nothing here needs the whole N × V matrix at once:

* **forward** (one program per tile of BLOCK_T tokens): stream the vocabulary past the token tile, BLOCK_V
  columns at a time. Each step computes one BLOCK_T × BLOCK_V tile of logits — itself a loop over d in chunks
  of BLOCK_D, because d (4096 in the 8B task) is far too wide to hold — and folds it into the *online*
  log-sum-exp (running max m, running sum s = Σ exp(z − m), rescaled by exp(m − m_new) when the max grows:
  Stage 3's online softmax without the value accumulator) and into the target's logit (the one column of the
  tile, if any, equal to the row's target). Stored: lse ``(N,)`` and ℓ ``(N,)`` in fp32; the loss is their
  mean over counted rows, summed in PyTorch (deterministic).
* **backward** recomputes each logit tile from h and W (as FlashAttention recomputes P) and turns it into
  dZ = (exp(z − lse) − onehot) · dloss/n on the spot. Two kernels, so that every output row has one owner and
  no atomics are needed (the result is bitwise reproducible): the **dH kernel**, one program per token tile,
  streams the vocabulary and accumulates dZ W into its own rows of dH; the **dW kernel**, one program per
  vocabulary tile, streams the tokens and accumulates dZᵀ H into its own rows of dW. Each recomputes the
  logits once, so the backward does 4 matmul sweeps of 2·N·V·d FLOPs against the minimum of 2 (as the
  deterministic FlashAttention backward recomputes twice).
* **the accumulators live in global memory.** In attention the head dimension is ≤ 128, so a tile's output
  accumulator fits in registers. Here a dH tile is BLOCK_T × d with d in the thousands: the dH program keeps it
  in an fp32 buffer and adds each vocabulary tile's contribution chunk by chunk (read, add dZ·W, write). Only
  this program touches these rows, in a fixed order, so the sum is deterministic; ``tl.debug_barrier()`` before
  each read-modify-write sweep makes the previous sweep's stores (made by other threads of the same program)
  visible. The buffers are fp32 whatever the input dtype: accumulating in bf16 would round at every tile
  (§3), and the result is cast once at the end.

What is allocated: lse and ℓ ``(N,)`` fp32 in the forward (and what autograd saves: h, W, targets, lse);
dH ``(N, d)`` and dW ``(V, d)`` fp32 accumulators in the backward, cast to the input dtype. Never ``(N, V)``.

Speed on a GPU is **unmeasured** (no GPU was available when this was written). What to expect: the forward is a
GEMM with a long inner dimension and an epilogue of exponentials (V·N exps against 2·V·N·d FLOPs: at d = 4096
they are noise, unlike attention's); the backward pays for recomputation and for the read-modify-write of its
fp32 accumulators, BLOCK_V/2 FLOPs per accumulator byte in the dH kernel (handout 07 §3).

On a CPU the kernels run in Triton's interpreter (``import kit`` first), with small fixed tiles and bf16 tiles
upcast to fp32 right after loading (the 3.6 interpreter's bf16 ``tl.dot`` is wrong), as in Stage 3.
"""

from __future__ import annotations

# isort: off
# First: on a machine without CUDA, `import kit` sets TRITON_INTERPRET=1, which triton reads when it is imported.
import kit  # noqa: F401
# isort: on
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kit import triton_interpreted
from kit.allocations import Allocations

__all__ = ["FusedLinearCrossEntropy", "fused_ce_backward", "fused_ce_forward", "fused_linear_cross_entropy",
           "launch_config", "naive_linear_cross_entropy", "peak_memory_bytes"]

# ==================================================================================================== Given
# The input contract, the launch configuration and the naive loss (the baseline the fused one replaces).

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument when the inputs break the contract.

    Contract: ``hidden`` ``(..., d)`` and ``weight`` ``(V, d)`` floating tensors of one dtype among fp32/fp16/bf16,
    ``targets`` an int64 tensor of shape ``hidden.shape[:-1]``, all on one device, at least one token, one
    vocabulary entry and one feature; ``ignore_index`` an int; every target in ``[0, V)`` or equal to
    ``ignore_index`` (one pass over the targets, O(tokens): cheap next to the loss, so it is always checked).

    Raises:
        TypeError: a non-tensor, an unsupported or mixed float dtype, targets that are not int64, a non-int
            ``ignore_index``.
        ValueError: wrong shapes, tensors on different devices, empty inputs, out-of-range targets.
    """
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("hidden", hidden), ("weight", weight)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"hidden and weight must share one dtype, got hidden {hidden.dtype} and weight {weight.dtype} "
                        "(cast one: the LM head runs in one precision)")
    if targets.dtype != torch.int64:
        raise TypeError(f"targets must be int64 (torch.long) class indices, got {targets.dtype}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape (V, d), got {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden must have shape (..., d) with d = weight.shape[1] = {weight.shape[1]}, got "
                         f"{tuple(hidden.shape)}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, got "
                         f"{tuple(targets.shape)}")
    if weight.device != hidden.device or targets.device != hidden.device:
        raise ValueError(f"hidden, weight and targets must be on one device, got hidden on {hidden.device}, weight on "
                         f"{weight.device}, targets on {targets.device}")
    if hidden.numel() == 0 or weight.numel() == 0:
        raise ValueError(f"hidden and weight must be non-empty, got hidden {tuple(hidden.shape)} and weight "
                         f"{tuple(weight.shape)}")
    vocab = weight.shape[0]
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        first = int(targets.reshape(-1)[bad.reshape(-1)][0])
        raise ValueError(f"targets must lie in [0, V = {vocab}) or equal ignore_index = {ignore_index}; "
                         f"{int(bad.sum())} do not, e.g. {first}")


def check_triton_device(t: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors; the interpreter runs on CPU tensors. ``ValueError`` otherwise."""
    if not triton_interpreted() and t.device.type != "cuda":
        raise ValueError(f"the fused loss runs Triton kernels, which need CUDA tensors (hidden is on {t.device}); on "
                         "a machine without a GPU, `import kit` before triton so that TRITON_INTERPRET=1 runs them "
                         "on the CPU")


# Tile sizes. In the interpreter: small enough that the tests' ragged sizes (tens of tokens, ~100 vocabulary
# entries, d 16–64) span several tiles in every dimension, large enough that the interpreted loops stay short.
# tl.dot needs every tile dimension ≥ 16. On a GPU (unmeasured — chosen to compile for sm_90 within its shared
# memory, handout 07 §3): bf16/fp16 tiles for the tensor cores, fp32 smaller (CUDA cores, exact fp32).
INTERPRETER_BLOCKS = {"BLOCK_T": 16, "BLOCK_V": 32, "BLOCK_D": 16}
# Checked by compiling all three kernels for sm_90 on a CPU (kit.triton_compile): the bf16/fp16 tiles use wgmma, fit
# shared memory (≤ 37 KiB) and spill no registers (184–237 of 255 per thread); BLOCK_D = 64 spills in both
# backward kernels. fp32 is not tuned: its dW kernel spills 80 bytes.
GPU_BLOCKS = {
    torch.bfloat16: {"BLOCK_T": 64, "BLOCK_V": 128, "BLOCK_D": 32, "num_warps": 8, "num_stages": 3},
    torch.float16: {"BLOCK_T": 64, "BLOCK_V": 128, "BLOCK_D": 32, "num_warps": 8, "num_stages": 3},
    torch.float32: {"BLOCK_T": 32, "BLOCK_V": 64, "BLOCK_D": 16, "num_warps": 4, "num_stages": 2},
}


def launch_config(dtype: torch.dtype) -> dict[str, int]:
    """The tile sizes (``BLOCK_T`` tokens, ``BLOCK_V`` vocabulary entries, ``BLOCK_D`` features) and, on a GPU,
    ``num_warps``/``num_stages`` for inputs of ``dtype``: fixed, no autotuning (the interpreter cannot autotune)."""
    return dict(INTERPRETER_BLOCKS) if triton_interpreted() else dict(GPU_BLOCKS[dtype])


def upcast_in_kernel(dtype: torch.dtype) -> bool:
    """Whether kernels must upcast loaded tiles to fp32: only bf16 under the interpreter (Stage 3's rule)."""
    return triton_interpreted() and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` for ``tl.dot``: exact ``"ieee"`` for fp32 (Triton's GPU default is TF32)."""
    return "ieee" if dtype == torch.float32 or upcast_in_kernel(dtype) else "tf32"


def as_rows(hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` ``(..., d)`` as ``(N, d)`` rows with unit stride along d (a view when possible)."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def naive_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               ignore_index: int = -100) -> torch.Tensor:
    """The loss the fused kernels replace: the ``(N, V)`` logits in the input dtype, upcast to fp32, then
    ``F.cross_entropy`` — what ``kit.model.cross_entropy(model(tokens), targets)`` does. Same contract as
    :func:`fused_linear_cross_entropy`; it holds N·V·(c + 4) bytes of logits (c = 2 in bf16) at its peak."""
    check_inputs(hidden, weight, targets, ignore_index)
    logits = as_rows(hidden) @ weight.T
    return F.cross_entropy(logits.float(), targets.reshape(-1), ignore_index=ignore_index)


def peak_memory_bytes(fn: Callable[[], object]) -> int:
    """The most bytes of tensor memory allocated by ``fn()`` and alive at once, on any device.

    On CUDA: ``torch.cuda.max_memory_allocated`` above what was allocated before. On a CPU, where PyTorch keeps no
    such statistic: :class:`kit.allocations.Allocations`, a dispatch mode that adds the bytes of each new storage
    an aten operation creates and subtracts them when the last tensor using it dies (views and in-place results
    share their input's storage and count nothing; nor do the Triton interpreter's views of kernel arguments).
    Memory allocated before ``fn()`` (inputs, parameters) is not counted; what autograd keeps for the backward is,
    while it lives.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return max(torch.cuda.max_memory_allocated() - before, 0)
    with Allocations() as seen:
        fn()
    return seen.peak


# ==================================================================================================== the kernels


@triton.jit
def _logits_tile(
    H, W, stride_hn, stride_wv, rows, cols, N, V, D,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One ``(BLOCK_T, BLOCK_V)`` fp32 tile of the logits z = h Wᵀ: token rows ``rows`` (int64) × vocabulary rows
    ``cols`` (int64), summed over d in chunks of BLOCK_D.

    For each chunk [d0, d0 + BLOCK_D): load h[rows, chunk] and W[cols, chunk] (masked: rows ≥ N, cols ≥ V and
    features ≥ D load as 0, so they add nothing), upcast when ``UPCAST``, and accumulate
    ``tl.dot(h, Wᵀ)`` in fp32. Columns ≥ V come out as 0 (the caller masks them).
    """
    if not triton.knobs.runtime.interpret:  # compiled for a GPU: fail to compile, with this message
        tl.static_assert(False, "NotImplementedError: _logits_tile: loop over d in chunks: masked loads of h and W, tl.dot into an fp32 tile (handout 07 §2)")
    raise NotImplementedError("_logits_tile: loop over d in chunks: masked loads of h and W, tl.dot into an fp32 tile (handout 07 §2)")


@triton.jit
def _dlogits_tile(logits, lse, cols, tgt, counted, scale, V):
    """∂loss/∂z for one tile, fp32: (exp(z − lse) − [col = target]) · scale on counted rows, exactly 0 on the
    others (ignored tokens, rows ≥ N) and in columns ≥ V. ``scale`` = dloss/n."""
    if not triton.knobs.runtime.interpret:  # compiled for a GPU: fail to compile, with this message
        tl.static_assert(False, "NotImplementedError: _dlogits_tile: softmax from the saved lse, minus the one-hot target, times dloss/n on counted rows (handout 07 §3)")
    raise NotImplementedError("_dlogits_tile: softmax from the saved lse, minus the one-hot target, times dloss/n on counted rows (handout 07 §3)")


@triton.jit
def fused_ce_forward_kernel(
    H, W, T, LSE, LOSS,
    N, V, D, stride_hn, stride_wv, ignore_index,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """lse and the per-token loss for one tile of BLOCK_T tokens. Grid ``(⌈N / BLOCK_T⌉,)``.

    H ``(N, D)``, W ``(V, D)`` (unit stride along D), T ``(N,)`` int64; LSE and LOSS ``(N,)`` fp32.

    Steps: this program's rows (int64: row · stride can pass 2³¹), their targets (rows ≥ N read as
    ``ignore_index``); m = −inf, s = 0, z_target = 0 in fp32; for each vocabulary tile: the logit tile
    (:func:`_logits_tile`), columns ≥ V set to −inf; m_new = max(m, row max); s = s·exp(m − m_new) +
    Σ exp(z − m_new); z_target += the tile's logit in the target's column (if the target falls in this tile);
    then store lse = m + log s and loss = lse − z_target on counted rows, 0 on ignored ones.
    """
    if not triton.knobs.runtime.interpret:  # compiled for a GPU: fail to compile, with this message
        tl.static_assert(False, "NotImplementedError: fused_ce_forward_kernel: stream the vocabulary: online log-sum-exp, the target's logit; store lse, loss (handout 07 §2)")
    raise NotImplementedError("fused_ce_forward_kernel: stream the vocabulary: online log-sum-exp, the target's logit; store lse, loss (handout 07 §2)")


@triton.jit
def fused_ce_dhidden_kernel(
    H, W, T, LSE, SCALE, DH,
    N, V, D, stride_hn, stride_wv, stride_dhn, ignore_index,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dH for one tile of BLOCK_T tokens: dH[rows] = Σ over vocabulary tiles of dZ[rows, tile] · W[tile].
    Grid ``(⌈N / BLOCK_T⌉,)``.

    DH ``(N, D)`` is the accumulator, zero on entry (fp32, or what the launcher chose); SCALE a 1-element fp32
    tensor holding dloss/n (a tensor, so that no value has to come back to the host before the launch).

    Steps: rows, targets, lse and ``counted`` of this tile; for each vocabulary tile: recompute the logits
    (:func:`_logits_tile`), dZ (:func:`_dlogits_tile`); ``tl.debug_barrier()``; then for each chunk of d:
    acc = DH[rows, chunk] (upcast to fp32), acc += dZ · W[tile, chunk] (dZ cast to W's dtype for the tensor
    cores), store acc in DH's dtype. Only this program writes these rows: no atomics.
    """
    if not triton.knobs.runtime.interpret:  # compiled for a GPU: fail to compile, with this message
        tl.static_assert(False, "NotImplementedError: fused_ce_dhidden_kernel: per vocabulary tile: recompute z, dZ, then DH[rows] += dZ·W chunk by chunk (handout 07 §3)")
    raise NotImplementedError("fused_ce_dhidden_kernel: per vocabulary tile: recompute z, dZ, then DH[rows] += dZ·W chunk by chunk (handout 07 §3)")


@triton.jit
def fused_ce_dweight_kernel(
    H, W, T, LSE, SCALE, DW,
    N, V, D, stride_hn, stride_wv, stride_dwv, ignore_index,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dW for one tile of BLOCK_V vocabulary rows: dW[cols] = Σ over token tiles of dZ[tile, cols]ᵀ · H[tile].
    Grid ``(⌈V / BLOCK_V⌉,)``.

    The mirror image of :func:`fused_ce_dhidden_kernel`: this program owns rows ``cols`` of the accumulator DW
    ``(V, D)`` (zero on entry) and streams the token tiles past them — every token tile, the last partial one
    included, because every token's softmax reaches every vocabulary entry. Per token tile: targets, lse and
    ``counted`` of its rows; recompute z and dZ; ``tl.debug_barrier()``; per chunk of d:
    acc = DW[cols, chunk], acc += dZᵀ · H[tile, chunk], store.
    """
    if not triton.knobs.runtime.interpret:  # compiled for a GPU: fail to compile, with this message
        tl.static_assert(False, "NotImplementedError: fused_ce_dweight_kernel: per token tile: recompute z, dZ, then DW[cols] += dZᵀ·H chunk by chunk (handout 07 §3)")
    raise NotImplementedError("fused_ce_dweight_kernel: per token tile: recompute z, dZ, then DW[cols] += dZᵀ·H chunk by chunk (handout 07 §3)")


# ==================================================================================================== the launchers


def fused_ce_forward(h2: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. h2 ``(N, d)`` and weight ``(V, d)`` with unit stride along d, targets ``(N,)``
    int64 (already checked).

    Returns ``(loss, lse, n_counted)``: the mean loss over counted tokens (0-dim fp32; NaN when none counts),
    lse ``(N,)`` fp32 and the number of counted tokens (0-dim int64, a tensor: no host synchronisation).

    Allocate lse and the per-token losses ``(N,)`` fp32, launch :func:`fused_ce_forward_kernel` on
    ``(⌈N / BLOCK_T⌉,)`` with ``launch_config(dtype)``, ``UPCAST=upcast_in_kernel(dtype)`` and
    ``DOT_PRECISION=dot_precision(dtype)``; n = the number of targets ≠ ignore_index; loss = Σ losses / n.
    """
    n_tokens, d = h2.shape
    vocab = weight.shape[0]
    raise NotImplementedError("fused_ce_forward: lse and per-token losses, launch the kernel, mean over counted tokens (handout 07 §2)")


def fused_ce_backward(h2: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                      scale: torch.Tensor, ignore_index: int, *,
                      need_weight_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the backward kernels. h2, weight, targets as in :func:`fused_ce_forward`; lse ``(N,)`` fp32 from
    it; ``scale`` a 1-element fp32 tensor holding dloss/n.

    Returns ``(dh2, dw)`` with the shapes and dtypes of h2 and weight (``dw`` None when not needed).

    Allocate zeroed fp32 accumulators for dH ``(N, d)`` and dW ``(V, d)``; launch
    :func:`fused_ce_dhidden_kernel` on ``(⌈N / BLOCK_T⌉,)`` and :func:`fused_ce_dweight_kernel` on
    ``(⌈V / BLOCK_V⌉,)``; cast the accumulators to the input dtype.
    """
    n_tokens, d = h2.shape
    vocab = weight.shape[0]
    raise NotImplementedError("fused_ce_backward: fp32 accumulators, dH kernel over token tiles, dW kernel over vocab tiles (handout 07 §3)")


# ==================================================================================================== autograd


class FusedLinearCrossEntropy(torch.autograd.Function):
    """``FusedLinearCrossEntropy.apply(hidden, weight, targets, ignore_index) -> loss``: the kernels behind
    autograd. Saves h (as rows), W, the targets, lse and the count of counted tokens — nothing of size N × V."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                ignore_index: int) -> torch.Tensor:
        h2 = as_rows(hidden)
        w = weight if weight.stride(-1) == 1 else weight.contiguous()
        t = targets.reshape(-1).contiguous()
        raise NotImplementedError("FusedLinearCrossEntropy.forward: run fused_ce_forward; save what the backward recomputes from (handout 07 §2)")

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        raise NotImplementedError("FusedLinearCrossEntropy.backward: scale = dloss/n, run fused_ce_backward, gradients for hidden and weight (handout 07 §3)")


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of the logits ``hidden @ weight.T`` against ``targets``, without the logits.

    hidden ``(..., d)`` and weight ``(V, d)``: fp32, fp16 or bf16, one dtype; targets ``(...)`` int64 in
    ``[0, V)`` or ``ignore_index``. Returns a 0-dim fp32 tensor (NaN when no token counts, as
    ``F.cross_entropy``), differentiable with respect to hidden and weight. CUDA tensors, or CPU tensors under
    the Triton interpreter.

    Raises:
        TypeError: non-tensors, unsupported or mixed float dtypes, targets that are not int64.
        ValueError: mismatched shapes or devices, empty inputs, out-of-range targets, CPU tensors without the
            interpreter.
    """
    check_inputs(hidden, weight, targets, ignore_index)
    check_triton_device(hidden)
    raise NotImplementedError("fused_linear_cross_entropy: the autograd function (handout 07 §2)")
