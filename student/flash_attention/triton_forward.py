# Your work goes in this file. Generated from the kit's reference by `make student`.
"""The FlashAttention-2 forward pass as a Triton kernel (handout 03 §5).

One *program* (a thread block on the GPU) owns one tile of BLOCK_M query rows of one (batch, head):

    grid = (batch·heads, ⌈Nq / BLOCK_M⌉)        program (bh, i) computes O[bh, i·BLOCK_M : (i+1)·BLOCK_M]

Batch·heads go on grid axis 0 because CUDA allows 2³¹ − 1 programs along x but only 65,535 along y
and z: B·H = 65,536 (e.g. 512 sequences × 128 heads) would not launch on axis 1.

It loads its query tile once, keeps it and an fp32 accumulator in registers, and streams the keys and
values past it BLOCK_N rows at a time, running the online softmax of §1. Nothing of size Nq × Nk is
ever written to memory: the kernel reads Q, K, V once per query tile and writes O and L once.

What makes it fast (the Triton tutorial "Fused Attention" does the same; the expected gains below are
estimates from that tutorial's design, not measured here — no GPU was available when this was written):

* **exp2, with the scale folded into one FMA.** The GPU's special-function unit computes 2^x natively;
  e^x costs an extra multiply. Since e^x = 2^(x·log2 e), the scores are measured in log2 units,
  s₂ = (q·k) · qk_scale with qk_scale = log2(e)/√D, and every exp becomes exp2. The running maximum
  m₂ is kept in the same units, and because qk_scale > 0, max_j(qk_j · qk_scale) = qk_scale · max_j qk_j:
  the maximum is taken on the raw scores and scaled once per *row*. The per-*element* work is then

      p = exp2(qk · qk_scale − m₂)          one fused multiply-add, then one exp2

  instead of a multiply, a ``tl.where`` and a subtract. L is converted back to natural log when stored:
  L = ln 2 · (m₂ + log2 l).
* **Causal tile skipping.** With the causal mask, query row i sees keys j ≤ i. For the query tile
  starting at row start_m, key tiles entirely left of start_m need no mask at all, the tile(s) on the
  diagonal need the element mask, and key tiles right of the diagonal are never loaded — they would
  contribute exactly zero. That halves the work.
* **No masks on full tiles (boundary-tile peeling).** Only the last key tile can stick out past Nk
  (when Nk is not a multiple of BLOCK_N). The loop over keys is split at nk_full = ⌊Nk / BLOCK_N⌋ ·
  BLOCK_N: tiles before it are loaded and used with no mask and no ``tl.where`` (the ``CHECK_KEYS``
  constexpr is False, so the compiler emits no mask code at all), and only the one tile after it pays
  for the bounds check — the same effect as the tutorial's EVEN_N constexpr, without needing the tile
  size at launch time (expected +10–20 % forward; estimate, unmeasured). The query rows ≥ Nq are masked
  only when this program's Q tile is loaded and its O stored, once per program, outside the hot loop.
* **Heavy causal tiles first.** With the causal mask the last query tile visits ⌈Nq/BLOCK_N⌉ key tiles
  and the first visits one. Blocks are scheduled in launch order, so program 0 along axis 1 takes the
  *last* query tile: the long programs start first and the short ones fill the tail of the launch
  instead of leaving SMs idle at the end (a load-balancing gain of a few %; estimate, unmeasured).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .checks import as_3d
from .triton_config import configure, dot_precision, upcast_in_kernel

LOG2E = 1.4426950408889634  # log2(e): e^x = 2^(x · log2 e)


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q,  # running state of this query tile, and the tile itself
    k_base, v_base, stride_kn, stride_vn,
    offs_m, offs_d, Nk, qk_scale,
    lo, hi,
    BLOCK_N: tl.constexpr, MASK_DIAGONAL: tl.constexpr, CHECK_KEYS: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Stream key tiles [lo, hi) past the query tile, updating (acc, l_i, m_i) by the online softmax.

    For each key tile starting at ``start_n``: load K and V; raw scores qk = q kᵀ (fp32). When neither
    mask applies (the hot loop): m_new = max(m, qk_scale · rowmax qk) and p = exp2(qk · qk_scale − m_new)
    (one FMA per element). When ``CHECK_KEYS`` (the tile may pass Nk: loads masked, keys ≥ Nk get −inf)
    or ``MASK_DIAGONAL`` (keys j > i get −inf): s₂ = where(keep, qk · qk_scale, −inf), m_new =
    max(m, rowmax s₂), p = exp2(s₂ − m_new). Then α = exp2(m − m_new), l = α·l + rowsum p,
    acc = α·acc + p V (p cast to V's dtype). Returns the new (acc, l_i, m_i).
    """
    if not triton.knobs.runtime.interpret:  # compiled for a GPU: fail to compile, with this message
        tl.static_assert(False, "NotImplementedError: _fwd_inner: per key tile: log2-domain scores, masks, online-softmax update (handout 03 §5)")
    raise NotImplementedError("_fwd_inner: per key tile: log2-domain scores, masks, online-softmax update (handout 03 §5)")


@triton.jit
def flash_fwd_kernel(
    Q, K, V, O, L,
    stride_qb, stride_qn, stride_kb, stride_kn, stride_vb, stride_vn, stride_ob, stride_on, stride_lb,
    Nq, Nk, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """O = softmax(Q Kᵀ / √D) V and L = logsumexp(Q Kᵀ / √D) for one query tile of one batch·head.

    Q, O: ``(BH, Nq, HEAD_DIM)``; K, V: ``(BH, Nk, HEAD_DIM)``, unit stride along HEAD_DIM; L:
    ``(BH, Nq)`` fp32. ``qk_scale`` = log2(e)/√D. Grid ``(BH, ⌈Nq/BLOCK_M⌉)``.

    Steps: pick this program's query tile (causal: the heaviest first, tile ⌈Nq/BLOCK_M⌉ − 1 − pid);
    load it (rows ≥ Nq masked; upcast when ``UPCAST``); start from m = −inf, l = 0, acc = 0 in fp32;
    run :func:`_fwd_inner` over the key tiles — the full tiles without any mask, the last partial tile
    (from nk_full = ⌊Nk/BLOCK_N⌋·BLOCK_N) with ``CHECK_KEYS``; causal: [0, min(start_m, nk_full))
    unmasked, then up to start_m + BLOCK_M with both masks (the diagonal), nothing beyond; store
    O = acc / l in O's dtype and L = ln 2 · (m + log2 l).
    """
    if not triton.knobs.runtime.interpret:  # compiled for a GPU: fail to compile, with this message
        tl.static_assert(False, "NotImplementedError: flash_fwd_kernel: load the Q tile, run _fwd_inner (off-diagonal, then diagonal), store O and L (handout 03 §5)")
    raise NotImplementedError("flash_fwd_kernel: load the Q tile, run _fwd_inner (off-diagonal, then diagonal), store O and L (handout 03 §5)")


_forward_kernel = configure(flash_fwd_kernel, "forward")


def triton_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. q ``(..., Nq, D)``, k/v ``(..., Nk, D)`` (already checked).

    Returns ``o`` ``(..., Nq, D)`` in q's dtype and ``L`` ``(..., Nq)`` fp32 (natural-log log-sum-exp).

    Launch ``_forward_kernel[grid](...)`` with ``grid(meta) = (BH, ⌈Nq / meta["BLOCK_M"]⌉)`` (a function
    of the tile size, because the autotuner picks it on a GPU), the tensors and their batch and row
    strides, ``Nq``, ``Nk``, ``qk_scale = log2(e)/√D``, and the constexprs ``HEAD_DIM``, ``IS_CAUSAL``,
    ``UPCAST=upcast_in_kernel(dtype)`` and ``DOT_PRECISION=dot_precision(dtype)``; the tile sizes are
    filled in by the launcher (:class:`~.triton_config.Launcher`).
    """
    lead, nq, nk, d = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1]
    q3, k3, v3 = as_3d(q), as_3d(k), as_3d(v)
    bh = q3.shape[0]
    raise NotImplementedError("triton_attention_forward: allocate o and L, launch _forward_kernel on (⌈Nq/BLOCK_M⌉, BH) (handout 03 §5)")
