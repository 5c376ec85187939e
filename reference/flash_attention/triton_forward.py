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
    # BEGIN SOLUTION per key tile: log2-domain scores, masks, online-softmax update (handout 03 §5)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if CHECK_KEYS:  # the last, partial key tile: rows ≥ Nk do not exist
            in_range = offs_n < Nk
            k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=in_range[:, None], other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=in_range[:, None], other=0.0)
        else:  # a full tile: no mask, so the compiler can vectorise and pipeline the loads freely
            k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :])
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :])
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # qk = q kᵀ: a BLOCK_M × BLOCK_N tile of raw (unscaled) scores, fp32 accumulation on tensor cores.
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASK_DIAGONAL or CHECK_KEYS:
            # Rare tiles (the diagonal, the last one): scale, then hide what this row may not see.
            keep = offs_n[None, :] < Nk
            if MASK_DIAGONAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            s = tl.where(keep, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        else:
            # The hot loop. qk_scale > 0, so max_j(qk_j · qk_scale) = qk_scale · max_j qk_j: one multiply
            # per row, and p = 2^(qk · qk_scale − m₂) is a single FMA per element before the exp2.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        # Online softmax. Every row sees key 0 in the first tile, so m_i is finite from then on and
        # masked scores give exp2(-inf) = 0 exactly.
        alpha = tl.math.exp2(m_i - m_new)  # rescales everything accumulated under the old maximum
        l_i = l_i * alpha + tl.sum(p, 1)
        # P goes into the second matmul in the input dtype (bf16/fp16 tensor cores), accumulating in fp32.
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i
    # END SOLUTION


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
    # BEGIN SOLUTION load the Q tile, run _fwd_inner (off-diagonal, then diagonal), store O and L (handout 03 §5)
    tl.static_assert(BLOCK_M % BLOCK_N == 0, "BLOCK_M must be a multiple of BLOCK_N: the causal diagonal of a "
                                             "query tile then starts on a key-tile boundary (§4)")
    bh = tl.program_id(0).to(tl.int64)  # 64-bit: bh · stride can pass 2³¹ for long sequences
    if IS_CAUSAL:
        # Heavy tiles first: query tile t visits t + 1 diagonal-bounded key ranges, so launch the last first.
        start_m = (tl.cdiv(Nq, BLOCK_M) - 1 - tl.program_id(1)) * BLOCK_M
    else:
        start_m = tl.program_id(1) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Nq
    q = tl.load(Q + bh * stride_qb + offs_m[:, None] * stride_qn + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + bh * stride_kb
    v_base = V + bh * stride_vb

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    nk_full = (Nk // BLOCK_N) * BLOCK_N  # keys in whole tiles: [0, nk_full) needs no bounds check
    if IS_CAUSAL:
        # Key tiles left of start_m are fully visible to every row of this tile: no causal mask, and no
        # bounds check up to nk_full. From there on — the diagonal tiles [start_m, start_m + BLOCK_M),
        # where j ≤ i must be masked element by element, and a partial last key tile when Nk < start_m,
        # where the causal mask happens to be all true — one loop applies both masks. Key tiles from
        # start_m + BLOCK_M on are skipped: the causal mask would zero them entirely.
        full = tl.minimum(start_m, nk_full)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, Nk,
                                   qk_scale, 0, full, BLOCK_N, False, False, UPCAST, DOT_PRECISION)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, Nk,
                                   qk_scale, full, tl.minimum(start_m + BLOCK_M, Nk), BLOCK_N, True, True, UPCAST,
                                   DOT_PRECISION)
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, Nk,
                                   qk_scale, 0, nk_full, BLOCK_N, False, False, UPCAST, DOT_PRECISION)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, Nk,
                                   qk_scale, nk_full, Nk, BLOCK_N, False, True, UPCAST, DOT_PRECISION)

    o = acc / l_i[:, None]
    tl.store(O + bh * stride_ob + offs_m[:, None] * stride_on + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(L + bh * stride_lb + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453,  # × ln 2
             mask=row_ok)
    # END SOLUTION


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
    # BEGIN SOLUTION allocate o and L, launch _forward_kernel on (⌈Nq/BLOCK_M⌉, BH) (handout 03 §5)
    o3 = torch.empty_like(q3)
    L3 = torch.empty((bh, nq), dtype=torch.float32, device=q.device)
    qk_scale = LOG2E / math.sqrt(d)

    def grid(meta: dict) -> tuple[int, int]:
        return (bh, triton.cdiv(nq, meta["BLOCK_M"]))  # B·H on axis 0: axes 1 and 2 stop at 65535

    _forward_kernel[grid](
        q3, k3, v3, o3, L3,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1),
        o3.stride(0), o3.stride(1), L3.stride(0),
        nq, nk, qk_scale,
        HEAD_DIM=d, IS_CAUSAL=is_causal, UPCAST=upcast_in_kernel(q.dtype), DOT_PRECISION=dot_precision(q.dtype),
    )
    return o3.view(*lead, nq, d), L3.view(*lead, nq)
    # END SOLUTION
