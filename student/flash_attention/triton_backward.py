# Your work goes in this file. Generated from the kit's reference by `make student`.
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
    if not triton.knobs.runtime.interpret:  # compiled for a GPU: fail to compile, with this message
        tl.static_assert(False, "NotImplementedError: flash_bwd_preprocess_kernel: row-wise dot products of O and dO tiles, in fp32 (handout 03 §6)")
    raise NotImplementedError("flash_bwd_preprocess_kernel: row-wise dot products of O and dO tiles, in fp32 (handout 03 §6)")


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
    if not triton.knobs.runtime.interpret:  # compiled for a GPU: fail to compile, with this message
        tl.static_assert(False, "NotImplementedError: _dkdv_inner: per query tile: recompute Pᵀ, accumulate dV and dK (handout 03 §6)")
    raise NotImplementedError("_dkdv_inner: per query tile: recompute Pᵀ, accumulate dV and dK (handout 03 §6)")


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
    if not triton.knobs.runtime.interpret:  # compiled for a GPU: fail to compile, with this message
        tl.static_assert(False, "NotImplementedError: flash_bwd_dkdv_kernel: load k, v; run _dkdv_inner (diagonal masked, rest unmasked); store dK, dV (handout 03 §6)")
    raise NotImplementedError("flash_bwd_dkdv_kernel: load k, v; run _dkdv_inner (diagonal masked, rest unmasked); store dK, dV (handout 03 §6)")


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
    if not triton.knobs.runtime.interpret:  # compiled for a GPU: fail to compile, with this message
        tl.static_assert(False, "NotImplementedError: _dq_inner: per key tile: recompute P, accumulate dQ += dS k (handout 03 §6)")
    raise NotImplementedError("_dq_inner: per key tile: recompute P, accumulate dQ += dS k (handout 03 §6)")


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
    if not triton.knobs.runtime.interpret:  # compiled for a GPU: fail to compile, with this message
        tl.static_assert(False, "NotImplementedError: flash_bwd_dq_kernel: load q, dO, L, D; run _dq_inner over key tiles as in the forward; store dQ (handout 03 §6)")
    raise NotImplementedError("flash_bwd_dq_kernel: load q, dO, L, D; run _dq_inner over key tiles as in the forward; store dQ (handout 03 §6)")


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
    raise NotImplementedError("triton_attention_backward: allocate Delta, dq, dk, dv; launch preprocess, dK/dV and dQ kernels (handout 03 §6)")
