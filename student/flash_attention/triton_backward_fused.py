# Your work goes in this file. Generated from the kit's reference by `make student`.
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
    if not triton.knobs.runtime.interpret:  # compiled for a GPU: fail to compile, with this message
        tl.static_assert(False, "NotImplementedError: _add_dq_in_order: wait for this key tile's turn, add dQ through L2, release the counter (handout 03 §6)")
    raise NotImplementedError("_add_dq_in_order: wait for this key tile's turn, add dQ through L2, release the counter (handout 03 §6)")


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
    if not triton.knobs.runtime.interpret:  # compiled for a GPU: fail to compile, with this message
        tl.static_assert(False, "NotImplementedError: _fused_inner: per query tile: recompute Pᵀ, accumulate dV and dK, add this key tile's dQ in order (§6)")
    raise NotImplementedError("_fused_inner: per query tile: recompute Pᵀ, accumulate dV and dK, add this key tile's dQ in order (§6)")


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
    if not triton.knobs.runtime.interpret:  # compiled for a GPU: fail to compile, with this message
        tl.static_assert(False, "NotImplementedError: flash_bwd_fused_kernel: load k, v; run _fused_inner over the query tiles (diagonal masked, rest unmasked); store dK, dV")
    raise NotImplementedError("flash_bwd_fused_kernel: load k, v; run _fused_inner over the query tiles (diagonal masked, rest unmasked); store dK, dV")


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
    raise NotImplementedError("triton_attention_backward_fused: allocate Delta, the zeroed dQ accumulator and counters, dk, dv; launch preprocess and fused")
