"""The FlashAttention-2 forward pass as a Triton kernel (handout 03 §5).

One *program* (a thread block on the GPU) owns one tile of BLOCK_M query rows of one (batch, head):

    grid = (batch·heads, ⌈Nq / BLOCK_M⌉)        program (bh, i) computes O[bh, i·BLOCK_M : (i+1)·BLOCK_M]

Batch·heads go on grid axis 0 because CUDA allows 2³¹ − 1 programs along x but only 65,535 along y
and z: B·H = 65,536 (e.g. 512 sequences × 128 heads) would not launch on axis 1.

It loads its query tile once, keeps it and an fp32 accumulator in registers, and streams the keys and
values past it BLOCK_N rows at a time, running the online softmax of §1. Nothing of size Nq × Nk is
ever written to memory: the kernel reads Q, K, V once per query tile and writes O and L once.

Two tricks make it fast:

* **exp2.** The GPU's special-function unit computes 2^x natively; e^x costs an extra multiply. Scaling
  the scores by log2(e) up front, s₂ = (q·k) · (1/√D) · log2(e), turns every exp into exp2 and the
  running maximum into log2 units. L is converted back to natural log when it is stored:
  L = ln 2 · (m₂ + log2 l).
* **Causal tile skipping.** With the causal mask, query row i sees keys j ≤ i. For the query tile
  starting at row start_m, key tiles entirely left of start_m need no mask at all, the tile(s) on the
  diagonal need the element mask, and key tiles right of the diagonal are never loaded — they would
  contribute exactly zero. That halves the work and keeps the mask arithmetic off the hot loop.
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
    BLOCK_N: tl.constexpr, MASK_DIAGONAL: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Stream key tiles [lo, hi) past the query tile, updating (acc, l_i, m_i) by the online softmax.

    For each key tile starting at ``start_n``: load K and V (rows ≥ Nk masked to 0); scores
    s₂ = q kᵀ · qk_scale (log2 units, fp32); set s₂ = −inf for keys ≥ Nk and, when ``MASK_DIAGONAL``,
    for keys j > i; then m_new = max(m, rowmax s₂), p = exp2(s₂ − m_new), α = exp2(m − m_new),
    l = α·l + rowsum p, acc = α·acc + p V (p cast to V's dtype). Returns the new (acc, l_i, m_i).
    """
    # BEGIN SOLUTION per key tile: log2-domain scores, masks, online-softmax update (handout 03 §5)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_range = offs_n < Nk
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=in_range[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=in_range[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # s₂ = (q kᵀ) / √D · log2(e): a BLOCK_M × BLOCK_N tile of scores in log2 units, fp32 accumulation.
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        keep = in_range[None, :]
        if MASK_DIAGONAL:
            keep = keep & (offs_m[:, None] >= offs_n[None, :])
        s = tl.where(keep, s, float("-inf"))
        # Online softmax. Every row sees key 0 in the first tile, so m_i is finite from then on and
        # masked scores give exp2(-inf) = 0 exactly.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
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

    Steps: load this program's query tile (rows ≥ Nq masked; upcast when ``UPCAST``); start from
    m = −inf, l = 0, acc = 0 in fp32; run :func:`_fwd_inner` over the key tiles — non-causal: all of
    [0, Nk) unmasked; causal: [0, start_m) unmasked, then [start_m, start_m + BLOCK_M) with the diagonal
    mask, and nothing beyond; store O = acc / l in O's dtype and L = ln 2 · (m + log2 l).
    """
    # BEGIN SOLUTION load the Q tile, run _fwd_inner (off-diagonal, then diagonal), store O and L (handout 03 §5)
    bh = tl.program_id(0).to(tl.int64)  # 64-bit: bh · stride can pass 2³¹ for long sequences
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
    if IS_CAUSAL:
        # Key tiles left of start_m are fully visible to every row of this tile: no mask (besides Nk).
        diag = tl.minimum(start_m, Nk)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, Nk,
                                   qk_scale, 0, diag, BLOCK_N, False, UPCAST, DOT_PRECISION)
        # The diagonal: key tiles inside [start_m, start_m + BLOCK_M) need the element mask j ≤ i.
        # Key tiles from start_m + BLOCK_M on are skipped — the mask would zero them entirely.
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, Nk,
                                   qk_scale, diag, tl.minimum(start_m + BLOCK_M, Nk), BLOCK_N, True, UPCAST,
                                   DOT_PRECISION)
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, Nk,
                                   qk_scale, 0, Nk, BLOCK_N, False, UPCAST, DOT_PRECISION)

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
