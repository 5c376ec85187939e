"""The FlashAttention-2 backward pass as three Triton kernels, deterministic by construction (handout 03 §6).

With s_ij = q_i·k_j/√D and P_ij = exp(s_ij − L_i) recomputed from the saved log-sum-exp L:

    dV = Pᵀ dO            dP = dO Vᵀ            dS = P ∘ (dP − D),   D_i = Σ_d dO_id O_id
    dK = dSᵀ Q / √D       dQ = dS K / √D

(§3 derives D: Σ_j P_ij dP_ij = dO_i · Σ_j P_ij v_j = dO_i · o_i.)

dK and dV are sums over *queries*; dQ is a sum over *keys*. A single kernel that owns a key tile could
add its share of dQ into memory with atomics — but atomic float additions land in a nondeterministic
order, so two runs would differ in the last bits. Instead:

1. ``flash_bwd_preprocess_kernel``: D = rowsum(dO ∘ O), one float per query row.
2. ``flash_bwd_dkdv_kernel``: one program per key tile, streaming query tiles past it; it owns its rows
   of dK and dV, accumulates them in registers and writes them once.
3. ``flash_bwd_dq_kernel``: one program per query tile, streaming key tiles past it; it owns its rows of dQ.

Kernels 2 and 3 both recompute P (that is 2.5× the forward FLOPs in all, §7) but no result is ever
written by two programs: the gradients are bitwise reproducible. Causal tiles are skipped as in the
forward: a key tile is seen only by query tiles at or below the diagonal.

The forward's speed tricks carry over (triton_forward.py explains them; expected gains are estimates
from the Triton tutorial's design, not measured here — no GPU was available):

* **One FMA per element for P.** The forward saved L in natural log; the kernels load it once per
  query row as L₂ = L · log2 e, so that P = exp(s − L) = exp2(qk · qk_scale − L₂) with qk the raw
  score tile and qk_scale = log2(e)/√D: one fused multiply-add and one exp2 per element, no
  ``tl.where`` outside the diagonal and the last tile.
* **No masks on full tiles.** The streamed dimension (queries in the dK/dV kernel, keys in the dQ
  kernel) is split at its last whole tile: full tiles load with no mask and skip the bounds
  ``tl.where``; only the one partial tile pays for it (``CHECK_ROWS`` / ``CHECK_KEYS``).
* **Heavy causal tiles first in the dQ kernel**, as in the forward (program 0 takes the last query
  tile). The dK/dV kernel's heaviest tiles — the first key tiles, seen by the most queries — are
  already launched first.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .checks import as_3d
from .triton_config import configure, dot_precision, upcast_in_kernel

LOG2E = 1.4426950408889634


@triton.jit
def flash_bwd_preprocess_kernel(
    O, DO, Delta,
    stride_ob, stride_on, stride_dob, stride_don, stride_db,
    Nq,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Delta[bh, i] = Σ_d O[bh, i, d] · dO[bh, i, d] in fp32. Grid ``(BH, ⌈Nq/BLOCK_M⌉)``."""
    # BEGIN SOLUTION row-wise dot products of O and dO tiles, in fp32 (handout 03 §6)
    bh = tl.program_id(0).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Nq
    o = tl.load(O + bh * stride_ob + offs_m[:, None] * stride_on + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + bh * stride_dob + offs_m[:, None] * stride_don + offs_d[None, :], mask=row_ok[:, None],
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + bh * stride_db + offs_m, delta, mask=row_ok)
    # END SOLUTION


@triton.jit
def _dkdv_inner(
    dk, dv, k, v,
    q_base, do_base, l_base, d_base, stride_qn, stride_don,
    offs_n, offs_d, Nq, qk_scale,
    lo, hi,
    BLOCK_M: tl.constexpr, MASK_DIAGONAL: tl.constexpr, CHECK_ROWS: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Stream query tiles [lo, hi) past one key tile, accumulating dK (unscaled) and dV.

    Works with transposed tiles (BLOCK_N keys × BLOCK_M queries) so no tile is ever transposed twice.
    For each query tile: load q, dO, L₂ = L·log2 e and D (masked only when ``CHECK_ROWS``: the tile may
    pass Nq); raw scores qkᵀ = k qᵀ; Pᵀ = exp2(qkᵀ · qk_scale − L₂) — one FMA per element — with
    −inf first for query rows ≥ Nq (``CHECK_ROWS``) and, when ``MASK_DIAGONAL``, where i < j;
    dV += Pᵀ dO; dPᵀ = v dOᵀ; dSᵀ = Pᵀ ∘ (dPᵀ − D); dK += dSᵀ q. Returns (dk, dv).
    """
    # BEGIN SOLUTION per query tile: recompute Pᵀ, accumulate dV and dK (handout 03 §6)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        if CHECK_ROWS:  # the last, partial query tile: rows ≥ Nq load as 0 and contribute nothing
            row_ok = offs_m < Nq
            q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_don + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(l_base + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634  # L in log2 units
            delta = tl.load(d_base + offs_m, mask=row_ok, other=0.0)
        else:  # a full tile: unmasked loads
            q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :])
            do = tl.load(do_base + offs_m[:, None] * stride_don + offs_d[None, :])
            lse2 = tl.load(l_base + offs_m) * 1.4426950408889634
            delta = tl.load(d_base + offs_m)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        # Pᵀ_ji = exp(s_ij − L_i) = exp2(qk_ji · qk_scale − L₂_i), recomputed exactly from the saved L.
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        if MASK_DIAGONAL or CHECK_ROWS:
            keep = offs_m[None, :] < Nq
            if MASK_DIAGONAL:
                keep = keep & (offs_m[None, :] >= offs_n[:, None])
            # masked before exp2: exactly 0, never an inf on the way
            pT = tl.math.exp2(tl.where(keep, qkT * qk_scale, float("-inf")) - lse2[None, :])
        else:
            pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])  # one FMA per element
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv
    # END SOLUTION


@triton.jit
def flash_bwd_dkdv_kernel(
    Q, K, V, DO, L, Delta, DK, DV,
    stride_qb, stride_qn, stride_kb, stride_kn, stride_vb, stride_vn, stride_dob, stride_don,
    stride_lb, stride_dkb, stride_dkn, stride_dvb, stride_dvn,
    Nq, Nk, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dK, dV for one tile of BLOCK_N keys of one batch·head. Grid ``(BH, ⌈Nk/BLOCK_N⌉)``.

    L and Delta are ``(BH, Nq)`` fp32 (they share strides); ``qk_scale`` = log2(e)/√D, ``sm_scale`` = 1/√D.

    Steps: load this key tile's k and v; dk = dv = 0 in fp32; :func:`_dkdv_inner` over the query tiles,
    the full ones (below nq_full = ⌊Nq/BLOCK_M⌋·BLOCK_M) unchecked and the last partial one with
    ``CHECK_ROWS`` — non-causal: all of [0, Nq); causal: [start_n, start_n + BLOCK_N) with the diagonal
    mask, then [start_n + BLOCK_N, Nq) without it (rows < start_n see none of these keys); store
    dK · sm_scale and dV.
    """
    # BEGIN SOLUTION load k, v; run _dkdv_inner (diagonal masked, rest unmasked); store dK, dV (handout 03 §6)
    tl.static_assert(BLOCK_N % BLOCK_M == 0, "BLOCK_N must be a multiple of BLOCK_M: the causal diagonal of a "
                                             "key tile then starts on a query-tile boundary (§4)")
    bh = tl.program_id(0).to(tl.int64)
    start_n = tl.program_id(1) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n < Nk
    k = tl.load(K + bh * stride_kb + offs_n[:, None] * stride_kn + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    v = tl.load(V + bh * stride_vb + offs_n[:, None] * stride_vn + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    q_base, do_base = Q + bh * stride_qb, DO + bh * stride_dob
    l_base, d_base = L + bh * stride_lb, Delta + bh * stride_lb
    nq_full = (Nq // BLOCK_M) * BLOCK_M  # query rows in whole tiles: [0, nq_full) needs no bounds check
    if IS_CAUSAL:
        # Query rows < start_n see none of these keys: start on the diagonal (BLOCK_N is a multiple of
        # BLOCK_M, so start_n is a query-tile boundary). Rows ≥ start_n + BLOCK_N see every key: no mask.
        diag_end = tl.minimum(start_n + BLOCK_N, Nq)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qn, stride_don, offs_n, offs_d,
                             Nq, qk_scale, start_n, diag_end, BLOCK_M, True, True, UPCAST, DOT_PRECISION)
        full = tl.maximum(start_n + BLOCK_N, nq_full)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qn, stride_don, offs_n, offs_d,
                             Nq, qk_scale, start_n + BLOCK_N, full, BLOCK_M, False, False, UPCAST, DOT_PRECISION)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qn, stride_don, offs_n, offs_d,
                             Nq, qk_scale, full, Nq, BLOCK_M, False, True, UPCAST, DOT_PRECISION)
    else:
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qn, stride_don, offs_n, offs_d,
                             Nq, qk_scale, 0, nq_full, BLOCK_M, False, False, UPCAST, DOT_PRECISION)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qn, stride_don, offs_n, offs_d,
                             Nq, qk_scale, nq_full, Nq, BLOCK_M, False, True, UPCAST, DOT_PRECISION)
    dk = dk * sm_scale  # s = q·k/√D, so ∂s/∂k = q/√D
    tl.store(DK + bh * stride_dkb + offs_n[:, None] * stride_dkn + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=key_ok[:, None])
    tl.store(DV + bh * stride_dvb + offs_n[:, None] * stride_dvn + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=key_ok[:, None])
    # END SOLUTION


@triton.jit
def _dq_inner(
    dq, q, do, lse2, delta,
    k_base, v_base, stride_kn, stride_vn,
    offs_m, offs_d, Nk, qk_scale,
    lo, hi,
    BLOCK_N: tl.constexpr, MASK_DIAGONAL: tl.constexpr, CHECK_KEYS: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Stream key tiles [lo, hi) past one query tile, accumulating dQ (unscaled).

    For each key tile: load k and v (masked only when ``CHECK_KEYS``: the tile may pass Nk); raw scores
    qk = q kᵀ; P = exp2(qk · qk_scale − L₂) — one FMA per element — with −inf first for keys ≥ Nk
    (``CHECK_KEYS``) and, when ``MASK_DIAGONAL``, for j > i; dP = dO vᵀ; dS = P ∘ (dP − D); dQ += dS k.
    """
    # BEGIN SOLUTION per key tile: recompute P, accumulate dQ += dS k (handout 03 §6)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if CHECK_KEYS:  # the last, partial key tile
            key_ok = offs_n < Nk
            k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=key_ok[:, None], other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        else:  # a full tile: unmasked loads
            k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :])
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :])
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASK_DIAGONAL or CHECK_KEYS:
            keep = offs_n[None, :] < Nk
            if MASK_DIAGONAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            p = tl.math.exp2(tl.where(keep, qk * qk_scale, float("-inf")) - lse2[:, None])
        else:
            p = tl.math.exp2(qk * qk_scale - lse2[:, None])  # one FMA per element
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq
    # END SOLUTION


@triton.jit
def flash_bwd_dq_kernel(
    Q, K, V, DO, L, Delta, DQ,
    stride_qb, stride_qn, stride_kb, stride_kn, stride_vb, stride_vn, stride_dob, stride_don,
    stride_lb, stride_dqb, stride_dqn,
    Nq, Nk, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dQ for one tile of BLOCK_M queries of one batch·head. Grid ``(BH, ⌈Nq/BLOCK_M⌉)``.

    Steps: pick this program's query tile (causal: the heaviest first, tile ⌈Nq/BLOCK_M⌉ − 1 − pid);
    load q, dO, L·log2 e and D for it; dq = 0 in fp32; :func:`_dq_inner` over the key tiles exactly as
    the forward visits them (full tiles unchecked, the partial last one with ``CHECK_KEYS``; causal:
    unmasked left of the diagonal, masked on it, skipped right of it); store dQ · sm_scale.
    """
    # BEGIN SOLUTION load q, dO, L, D; run _dq_inner over key tiles as in the forward; store dQ (handout 03 §6)
    tl.static_assert(BLOCK_M % BLOCK_N == 0, "BLOCK_M must be a multiple of BLOCK_N: the causal diagonal of a "
                                             "query tile then starts on a key-tile boundary (§4)")
    bh = tl.program_id(0).to(tl.int64)
    if IS_CAUSAL:  # heavy tiles first, as in the forward
        start_m = (tl.cdiv(Nq, BLOCK_M) - 1 - tl.program_id(1)) * BLOCK_M
    else:
        start_m = tl.program_id(1) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Nq
    q = tl.load(Q + bh * stride_qb + offs_m[:, None] * stride_qn + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + bh * stride_dob + offs_m[:, None] * stride_don + offs_d[None, :], mask=row_ok[:, None],
                 other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = tl.load(L + bh * stride_lb + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(Delta + bh * stride_lb + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    k_base, v_base = K + bh * stride_kb, V + bh * stride_vb
    nk_full = (Nk // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        # As in the forward: unmasked up to min(start_m, nk_full), then both masks up to the diagonal's end.
        full = tl.minimum(start_m, nk_full)
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, Nk, qk_scale,
                       0, full, BLOCK_N, False, False, UPCAST, DOT_PRECISION)
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, Nk, qk_scale,
                       full, tl.minimum(start_m + BLOCK_M, Nk), BLOCK_N, True, True, UPCAST, DOT_PRECISION)
    else:
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, Nk, qk_scale,
                       0, nk_full, BLOCK_N, False, False, UPCAST, DOT_PRECISION)
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, Nk, qk_scale,
                       nk_full, Nk, BLOCK_N, False, True, UPCAST, DOT_PRECISION)
    dq = dq * sm_scale
    tl.store(DQ + bh * stride_dqb + offs_m[:, None] * stride_dqn + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=row_ok[:, None])
    # END SOLUTION


_preprocess_kernel = flash_bwd_preprocess_kernel  # memory-bound and simple: one fixed tile size
_dkdv_kernel = configure(flash_bwd_dkdv_kernel, "dkdv")
_dq_kernel = configure(flash_bwd_dq_kernel, "dq")


def triton_attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, L: torch.Tensor, grad_out: torch.Tensor,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the three backward kernels. q/o/grad_out ``(..., Nq, D)``, k/v ``(..., Nk, D)``, L ``(..., Nq)``.

    Returns dq, dk, dv with the shapes and dtypes of q, k, v.

    Allocate Delta ``(BH, Nq)`` fp32 and dq, dk, dv like q, k, v; launch the preprocess kernel on
    ``(BH, ⌈Nq/BLOCK_M⌉)``, then the dK/dV kernel on ``(BH, ⌈Nk/BLOCK_N⌉)`` and the dQ kernel on
    ``(BH, ⌈Nq/BLOCK_M⌉)`` (batch·heads on axis 0, whose limit is 2³¹ − 1; grids as functions of
    ``meta``; the launchers fill in the tile sizes), passing
    ``qk_scale = log2(e)/√D`` and ``sm_scale = 1/√D``.
    """
    lead, nq, nk, d = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1]
    q3, k3, v3, o3, do3 = as_3d(q), as_3d(k), as_3d(v), as_3d(o), as_3d(grad_out.to(q.dtype))
    L3 = L.reshape(-1, nq).contiguous()
    bh = q3.shape[0]
    # BEGIN SOLUTION allocate Delta, dq, dk, dv; launch preprocess, dK/dV and dQ kernels (handout 03 §6)
    upcast, precision = upcast_in_kernel(q.dtype), dot_precision(q.dtype)
    sm_scale = 1.0 / math.sqrt(d)
    delta = torch.empty((bh, nq), dtype=torch.float32, device=q.device)
    dq3, dk3, dv3 = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)
    pre_block = 64 if d <= 64 else 32
    _preprocess_kernel[(bh, triton.cdiv(nq, pre_block))](
        o3, do3, delta, o3.stride(0), o3.stride(1), do3.stride(0), do3.stride(1), delta.stride(0), nq,
        HEAD_DIM=d, BLOCK_M=pre_block,
    )

    def dkdv_grid(meta: dict) -> tuple[int, int]:
        return (bh, triton.cdiv(nk, meta["BLOCK_N"]))

    _dkdv_kernel[dkdv_grid](
        q3, k3, v3, do3, L3, delta, dk3, dv3,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1),
        do3.stride(0), do3.stride(1), L3.stride(0), dk3.stride(0), dk3.stride(1), dv3.stride(0), dv3.stride(1),
        nq, nk, sm_scale * LOG2E, sm_scale,
        HEAD_DIM=d, IS_CAUSAL=is_causal, UPCAST=upcast, DOT_PRECISION=precision,
    )

    def dq_grid(meta: dict) -> tuple[int, int]:
        return (bh, triton.cdiv(nq, meta["BLOCK_M"]))

    _dq_kernel[dq_grid](
        q3, k3, v3, do3, L3, delta, dq3,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1),
        do3.stride(0), do3.stride(1), L3.stride(0), dq3.stride(0), dq3.stride(1),
        nq, nk, sm_scale * LOG2E, sm_scale,
        HEAD_DIM=d, IS_CAUSAL=is_causal, UPCAST=upcast, DOT_PRECISION=precision,
    )
    return dq3.view(*lead, nq, d), dk3.view(*lead, nk, d), dv3.view(*lead, nk, d)
    # END SOLUTION
