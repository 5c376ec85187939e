"""A second Triton backward: one kernel that adds dQ while it computes dK and dV, in a fixed order (handout 03 §6).

Optional (no points of its own). The three-kernel backward of ``triton_backward.py`` recomputes the scores
and dP twice — once per key tile for dK/dV, once per query tile for dQ: 7 matmuls per tile pair. This design
does it once: the program that owns a key tile, streaming the query tiles past it, also forms that pair's
share of dQ, dS k (5 matmuls), and adds it to an fp32 dQ accumulator in memory.

Many programs add to the same rows of dQ, and floating-point addition is not associative: with
``tl.atomic_add`` the sum would depend on the order the hardware happens to run them (flash-attention's own
CUDA backward has exactly this property). Here they add in a fixed order instead, as FlashAttention-3's
deterministic mode does: each query tile of each batch·head has a counter of the key tiles that have added
to it; key tile n waits until the counter reads n, adds its share with an ordinary load and store, and
sets the counter to n + 1. The additions to every row therefore happen in key-tile order, whatever the
schedule: the gradients are bitwise reproducible, and the counters are the only atomics (integers that
order the additions, never summed into a result).

Waiting on an earlier program is safe because key tile n − 1 is launched before key tile n (CUDA starts
blocks in order of their linear index, batch·heads fastest: program (bh, n − 1) precedes (bh, n)), so the
program waited on is running or done — the ordering FlashAttention-3 relies on too. In the interpreter
programs run one after another in that order, so no program ever waits. With the causal mask, key tile n
starts on its diagonal, about when tile n − 1 has passed it: the order costs little. Without it, every
program starts at query tile 0 and tile n lags tile n − 1 by one step — the autotuner's timing decides.

Memory ordering on a GPU: before a program releases a counter, ``tl.debug_barrier()`` makes every thread's
stores of dQ complete, and the counter is written with release semantics; the waiting program reads it with
acquire semantics and loads the accumulator through L2 (``.cg``), never from a stale L1 line.

After the kernel, dQ (fp32, already scaled by 1/√D) is cast to q's dtype. This design has not run on a GPU
yet: whether it beats the three kernels there is for the autotuner's measurement (``triton_config``,
``LLMSYS_FA_BACKWARD``); its speed is unmeasured.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kit import triton_interpreted

from .checks import as_3d
from .triton_backward import LOG2E, flash_bwd_preprocess_kernel
from .triton_config import configure, dot_precision, upcast_in_kernel

# Query tiles are counted in units of this many rows: enough counters for any BLOCK_M the autotuner may pick.
SEMAPHORE_ROWS = 16
# Compiled (a GPU, the sm_90 compile check): a program spins until its turn. Interpreted: programs run one after
# another, so spinning could only hang; the visiting order makes the turn come anyway (see _add_dq_in_order).
WAIT_FOR_TURN = tl.constexpr(not triton_interpreted())


@triton.jit
def _add_dq_in_order(dq, acc_ptrs, row_ok, turn, counter, CHECK_ROWS: tl.constexpr):
    """Wait until ``counter`` reads ``turn`` (the key tiles before this one have added), add ``dq`` to the
    accumulator at ``acc_ptrs`` (rows where ``row_ok``), then pass the turn on: ``counter`` = turn + 1."""
    # BEGIN SOLUTION wait for this key tile's turn, add dQ through L2, release the counter (handout 03 §6)
    done = tl.atomic_add(counter, 0, sem="acquire")  # read with acquire semantics
    if WAIT_FOR_TURN:
        while done < turn:
            done = tl.atomic_add(counter, 0, sem="acquire")
    else:
        # The interpreter runs one program at a time, to completion, so a wait could never end. It visits
        # batch·heads in the outer loop and key tiles in ascending order inside it — the order waited for —
        # so the turn has always come; should it not have, the sum is poisoned (NaN) instead of hanging.
        dq = tl.where(done == turn, dq, float("nan"))
    if CHECK_ROWS:
        old = tl.load(acc_ptrs, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        tl.store(acc_ptrs, old + dq, mask=row_ok[:, None])
    else:
        old = tl.load(acc_ptrs, cache_modifier=".cg")
        tl.store(acc_ptrs, old + dq)
    tl.debug_barrier()  # every thread's store is done before the counter says so
    tl.atomic_xchg(counter, turn + 1, sem="release")
    # END SOLUTION


@triton.jit
def _fused_inner(
    dk, dv, k, v,
    q_base, do_base, l_base, d_base, acc_base, sem_base, stride_qn, stride_don, stride_an,
    offs_n, offs_d, key_ok, Nq, qk_scale, sm_scale, turn,
    lo, hi,
    BLOCK_M: tl.constexpr, MASK_DIAGONAL: tl.constexpr, CHECK_ROWS: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SEMAPHORE_ROWS: tl.constexpr,
):
    """Stream query tiles [lo, hi) past one key tile: dK += dSᵀ q and dV += Pᵀ dO as in ``_dkdv_inner``, and
    for each query tile dQ_tile = dS k · sm_scale, added to the accumulator in key-tile order
    (:func:`_add_dq_in_order`, counter ``start_m / SEMAPHORE_ROWS`` of ``sem_base``). Returns (dk, dv)."""
    # BEGIN SOLUTION per query tile: recompute Pᵀ, accumulate dV and dK, add this key tile's dQ in order (§6)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < Nq
        if CHECK_ROWS:
            q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_don + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(l_base + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
            delta = tl.load(d_base + offs_m, mask=row_ok, other=0.0)
        else:
            q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :])
            do = tl.load(do_base + offs_m[:, None] * stride_don + offs_d[None, :])
            lse2 = tl.load(l_base + offs_m) * 1.4426950408889634
            delta = tl.load(d_base + offs_m)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        if MASK_DIAGONAL or CHECK_ROWS:
            keep = (offs_m[None, :] < Nq) & key_ok[:, None]
            if MASK_DIAGONAL:
                keep = keep & (offs_m[None, :] >= offs_n[:, None])
            pT = tl.math.exp2(tl.where(keep, qkT * qk_scale, float("-inf")) - lse2[None, :])
        else:
            # Keys ≥ Nk (a partial last key tile) load as 0, so their P would be 2^(−L₂): inf when L < −88,
            # and inf · 0 in dS k would put NaN into dQ. A select, not a multiply, makes them exactly 0.
            pT = tl.where(key_ok[:, None], tl.math.exp2(qkT * qk_scale - lse2[None, :]), 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk = tl.dot(dsT, q, dk, input_precision=DOT_PRECISION)
        dq = tl.dot(tl.trans(dsT), k, input_precision=DOT_PRECISION) * sm_scale  # this pair's share of dQ
        _add_dq_in_order(dq, acc_base + offs_m[:, None] * stride_an + offs_d[None, :], row_ok, turn,
                         sem_base + start_m // SEMAPHORE_ROWS, CHECK_ROWS)
    return dk, dv
    # END SOLUTION


@triton.jit
def flash_bwd_fused_kernel(
    Q, K, V, DO, L, Delta, DK, DV, DQ_ACC, SEM,
    stride_qb, stride_qn, stride_kb, stride_kn, stride_vb, stride_vn, stride_dob, stride_don,
    stride_lb, stride_dkb, stride_dkn, stride_dvb, stride_dvn, stride_ab, stride_an, stride_sb,
    Nq, Nk, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, SEMAPHORE_ROWS: tl.constexpr,
):
    """dK, dV of one tile of BLOCK_N keys of one batch·head, and its share of dQ. Grid ``(BH, ⌈Nk/BLOCK_N⌉)``.

    As ``flash_bwd_dkdv_kernel`` (the same query tiles, masks and peeling), plus: ``DQ_ACC`` ``(BH, Nq, D)``
    fp32 and ``SEM`` ``(BH, ⌈Nq/SEMAPHORE_ROWS⌉)`` int32, both zero before the launch; key tile n adds its
    dQ to each query tile it visits when that tile's counter reads n (:func:`_fused_inner`).
    """
    # BEGIN SOLUTION load k, v; run _fused_inner over the query tiles (diagonal masked, rest unmasked); store dK, dV
    tl.static_assert(BLOCK_N % BLOCK_M == 0, "BLOCK_N must be a multiple of BLOCK_M: the causal diagonal of a "
                                             "key tile then starts on a query-tile boundary")
    tl.static_assert(BLOCK_M % SEMAPHORE_ROWS == 0, "a query tile must span whole counter units")
    bh = tl.program_id(0).to(tl.int64)
    turn = tl.program_id(1)  # key tiles add to each query tile in this order
    start_n = turn * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n < Nk
    # The same loads as flash_bwd_dkdv_kernel's, written out again on purpose: a private helper imported from
    # triton_backward would not exist in the open-level release, which keeps each file's public names only.
    k = tl.load(K + bh * stride_kb + offs_n[:, None] * stride_kn + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    v = tl.load(V + bh * stride_vb + offs_n[:, None] * stride_vn + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    q_base, do_base = Q + bh * stride_qb, DO + bh * stride_dob
    l_base, d_base = L + bh * stride_lb, Delta + bh * stride_lb
    acc_base, sem_base = DQ_ACC + bh * stride_ab, SEM + bh * stride_sb
    nq_full = (Nq // BLOCK_M) * BLOCK_M
    if IS_CAUSAL:  # as in flash_bwd_dkdv_kernel: the diagonal masked, the rows below it not, the partial tile checked
        diag_end = tl.minimum(start_n + BLOCK_N, Nq)
        full = tl.maximum(start_n + BLOCK_N, nq_full)
        dk, dv = _fused_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, acc_base, sem_base, stride_qn, stride_don,
                              stride_an, offs_n, offs_d, key_ok, Nq, qk_scale, sm_scale, turn, start_n, diag_end,
                              BLOCK_M, True, True, UPCAST, DOT_PRECISION, SEMAPHORE_ROWS)
        dk, dv = _fused_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, acc_base, sem_base, stride_qn, stride_don,
                              stride_an, offs_n, offs_d, key_ok, Nq, qk_scale, sm_scale, turn, start_n + BLOCK_N,
                              full, BLOCK_M, False, False, UPCAST, DOT_PRECISION, SEMAPHORE_ROWS)
        dk, dv = _fused_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, acc_base, sem_base, stride_qn, stride_don,
                              stride_an, offs_n, offs_d, key_ok, Nq, qk_scale, sm_scale, turn, full, Nq,
                              BLOCK_M, False, True, UPCAST, DOT_PRECISION, SEMAPHORE_ROWS)
    else:
        dk, dv = _fused_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, acc_base, sem_base, stride_qn, stride_don,
                              stride_an, offs_n, offs_d, key_ok, Nq, qk_scale, sm_scale, turn, 0, nq_full,
                              BLOCK_M, False, False, UPCAST, DOT_PRECISION, SEMAPHORE_ROWS)
        dk, dv = _fused_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, acc_base, sem_base, stride_qn, stride_don,
                              stride_an, offs_n, offs_d, key_ok, Nq, qk_scale, sm_scale, turn, nq_full, Nq,
                              BLOCK_M, False, True, UPCAST, DOT_PRECISION, SEMAPHORE_ROWS)
    tl.store(DK + bh * stride_dkb + offs_n[:, None] * stride_dkn + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + bh * stride_dvb + offs_n[:, None] * stride_dvn + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=key_ok[:, None])
    # END SOLUTION


_fused_kernel = configure(flash_bwd_fused_kernel, "fused", reset_to_zero=("DQ_ACC", "SEM"))


def triton_attention_backward_fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, L: torch.Tensor, grad_out: torch.Tensor,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward in one kernel (plus the preprocess). Same contract as
    :func:`~.triton_backward.triton_attention_backward`: q/o/grad_out ``(..., Nq, D)``, k/v ``(..., Nk, D)``,
    L ``(..., Nq)``; returns dq, dk, dv with the shapes and dtypes of q, k, v.

    Allocate Delta ``(BH, Nq)`` fp32, the dQ accumulator ``(BH, Nq, D)`` fp32 and the counters
    ``(BH, ⌈Nq/SEMAPHORE_ROWS⌉)`` int32 — both zeroed — and dk, dv like k, v; launch the preprocess kernel,
    then the fused kernel on ``(BH, ⌈Nk/BLOCK_N⌉)``; return the accumulator cast to q's dtype as dq.
    """
    lead, nq, nk, d = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1]
    q3, k3, v3, o3, do3 = as_3d(q), as_3d(k), as_3d(v), as_3d(o), as_3d(grad_out.to(q.dtype))
    L3 = L.reshape(-1, nq).contiguous()
    bh = q3.shape[0]
    # BEGIN SOLUTION allocate Delta, the zeroed dQ accumulator and counters, dk, dv; launch preprocess and fused
    upcast, precision = upcast_in_kernel(q.dtype), dot_precision(q.dtype)
    sm_scale = 1.0 / math.sqrt(d)
    delta = torch.empty((bh, nq), dtype=torch.float32, device=q.device)
    pre_block = 64 if d <= 64 else 32
    flash_bwd_preprocess_kernel[(bh, triton.cdiv(nq, pre_block))](
        o3, do3, delta, o3.stride(0), o3.stride(1), do3.stride(0), do3.stride(1), delta.stride(0), nq,
        HEAD_DIM=d, BLOCK_M=pre_block,
    )
    dq_acc = torch.zeros((bh, nq, d), dtype=torch.float32, device=q.device)
    counters = torch.zeros((bh, triton.cdiv(nq, SEMAPHORE_ROWS)), dtype=torch.int32, device=q.device)
    dk3, dv3 = torch.empty_like(k3), torch.empty_like(v3)

    def grid(meta: dict) -> tuple[int, int]:
        return (bh, triton.cdiv(nk, meta["BLOCK_N"]))

    _fused_kernel[grid](
        q3, k3, v3, do3, L3, delta, dk3, dv3, dq_acc, counters,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1),
        do3.stride(0), do3.stride(1), L3.stride(0), dk3.stride(0), dk3.stride(1), dv3.stride(0), dv3.stride(1),
        dq_acc.stride(0), dq_acc.stride(1), counters.stride(0),
        nq, nk, sm_scale * LOG2E, sm_scale,
        HEAD_DIM=d, IS_CAUSAL=is_causal, UPCAST=upcast, DOT_PRECISION=precision, SEMAPHORE_ROWS=SEMAPHORE_ROWS,
    )
    return dq_acc.to(q.dtype).view(*lead, nq, d), dk3.view(*lead, nk, d), dv3.view(*lead, nk, d)
    # END SOLUTION
