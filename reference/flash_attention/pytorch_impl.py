"""FlashAttention-2 in plain PyTorch: the algorithm without the kernel language (handout 03 §1–§4).

Attention for one query row i over keys j = 0 … Nk−1, with scores s_ij = q_i · k_j / √D:

    o_i = Σ_j softmax(s_i)_j v_j = Σ_j exp(s_ij − L_i) v_j,      L_i = log Σ_j exp(s_ij)   (the log-sum-exp)

Naive attention builds the whole Nq × Nk matrix S, then P = softmax(S), then O = P V. FlashAttention
never builds it: queries are cut into tiles of ``Q_TILE`` rows and keys into tiles of ``K_TILE`` rows,
and each query tile walks over the key tiles keeping three running quantities per row

    m_i  the largest score seen so far,
    l_i  Σ exp(s_ij − m_i) over the keys seen so far,
    acc_i  Σ exp(s_ij − m_i) v_j over the keys seen so far,

rescaled by exp(m_old − m_new) whenever the running maximum grows (the *online softmax*, §1). After the
last key tile, o_i = acc_i / l_i and L_i = m_i + log l_i. Only O and L (one float per query row) are
saved for the backward pass, which recomputes P tile by tile from q, k and L (§3).

Everything is computed in fp32 whatever the input dtype, and O is returned in the input dtype.
"""

from __future__ import annotations

import math

import torch

from .checks import check_attention_inputs


class FlashAttentionPytorch(torch.autograd.Function):
    """``FlashAttentionPytorch.apply(q, k, v, is_causal=False) -> o``.

    q: ``(..., Nq, D)``; k, v: ``(..., Nk, D)``; fp32, fp16 or bf16; any leading batch/head dims.
    Returns o ``(..., Nq, D)`` in q's dtype. Saves exactly ``q, k, v, o, L`` for backward, with
    ``L`` ``(..., Nq)`` fp32 the natural-log log-sum-exp of each query row's scaled scores. Causal
    masking aligns query i with key i: query i attends to keys j ≤ i.
    """

    # Tile sizes (rows of Q and of K/V per step). At least 16, as the Triton kernels need for tl.dot.
    Q_TILE = 64
    K_TILE = 64

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        """For each tile of ``Q_TILE`` query rows: m = −inf, l = 0, acc = 0 (fp32); for each tile of
        ``K_TILE`` keys (causal: only tiles that start at or before the tile's last query row): scores
        S = q kᵀ/√D, masked to −inf where j > i, then the online-softmax update of m, l and acc. Write
        O = acc / l and L = m + log l, and save q, k, v, o, L (and ``ctx.is_causal``) for backward.
        """
        check_attention_inputs(q, k, v, is_causal)
        Bq, Bk = FlashAttentionPytorch.Q_TILE, FlashAttentionPytorch.K_TILE
        # BEGIN SOLUTION online softmax over K/V tiles for each Q tile; save q, k, v, o, L (handout 03 §1–§2)
        nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
        scale = 1.0 / math.sqrt(d)
        lead = q.shape[:-2]
        o = torch.empty_like(q)
        L = torch.empty(*lead, nq, dtype=torch.float32, device=q.device)
        for i0 in range(0, nq, Bq):
            i1 = min(i0 + Bq, nq)
            q_tile = q[..., i0:i1, :].float()
            m = torch.full((*lead, i1 - i0), float("-inf"), device=q.device)  # running row maximum
            l = torch.zeros((*lead, i1 - i0), device=q.device)  # running Σ exp(s − m)
            acc = torch.zeros((*lead, i1 - i0, d), device=q.device)  # running Σ exp(s − m) v
            # Causal: query rows i0 … i1−1 see keys j ≤ i1−1 only, so key tiles from i1 on are skipped.
            k_end = min(nk, i1) if is_causal else nk
            for j0 in range(0, k_end, Bk):
                j1 = min(j0 + Bk, nk)
                s = (q_tile @ k[..., j0:j1, :].float().transpose(-2, -1)) * scale  # (..., Bq, Bk) — one tile
                if is_causal and j1 - 1 > i0:  # the tile reaches above the diagonal: mask exactly
                    rows = torch.arange(i0, i1, device=q.device)[:, None]
                    cols = torch.arange(j0, j1, device=q.device)[None, :]
                    s = s.masked_fill(cols > rows, float("-inf"))
                # Key 0 is in the first tile and every row sees it, so m is finite from the first step on
                # and exp(-inf - m) = 0 excludes masked scores exactly.
                m_new = torch.maximum(m, s.amax(dim=-1))
                p = torch.exp(s - m_new[..., None])
                alpha = torch.exp(m - m_new)  # rescales what was accumulated under the old maximum
                l = alpha * l + p.sum(dim=-1)
                acc = alpha[..., None] * acc + p @ v[..., j0:j1, :].float()
                m = m_new
            o[..., i0:i1, :] = (acc / l[..., None]).to(q.dtype)
            L[..., i0:i1] = m + torch.log(l)
        ctx.save_for_backward(q, k, v, o, L)
        ctx.is_causal = is_causal
        return o
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        """Gradients by recomputation (handout 03 §3), with P_ij = exp(s_ij − L_i) rebuilt tile by tile:

            D_i = Σ_d dO_id O_id                 (= rowsum(dO ∘ O), one float per query row)
            dV  = Pᵀ dO        dP = dO Vᵀ        dS = P ∘ (dP − D)
            dQ  = dS K / √D    dK = dSᵀ Q / √D
        """
        q, k, v, o, L = ctx.saved_tensors
        Bq, Bk = FlashAttentionPytorch.Q_TILE, FlashAttentionPytorch.K_TILE
        # BEGIN SOLUTION D = rowsum(dO ∘ O), then recompute P tile by tile; accumulate dQ, dK, dV (handout 03 §3)
        nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
        scale = 1.0 / math.sqrt(d)
        is_causal = ctx.is_causal
        do = grad_out.float()
        delta = (do * o.float()).sum(dim=-1)  # (..., Nq)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        for j0 in range(0, nk, Bk):
            j1 = min(j0 + Bk, nk)
            k_tile, v_tile = k[..., j0:j1, :].float(), v[..., j0:j1, :].float()
            # Causal: query rows below j0 see none of these keys, so start at the query tile holding row j0.
            i_start = (j0 // Bq) * Bq if is_causal else 0
            for i0 in range(i_start, nq, Bq):
                i1 = min(i0 + Bq, nq)
                q_tile, do_tile = q[..., i0:i1, :].float(), do[..., i0:i1, :]
                s = (q_tile @ k_tile.transpose(-2, -1)) * scale
                if is_causal and j1 - 1 > i0:
                    rows = torch.arange(i0, i1, device=q.device)[:, None]
                    cols = torch.arange(j0, j1, device=q.device)[None, :]
                    s = s.masked_fill(cols > rows, float("-inf"))
                p = torch.exp(s - L[..., i0:i1, None])  # the softmax, recomputed exactly from L
                dv[..., j0:j1, :] += p.transpose(-2, -1) @ do_tile
                dp = do_tile @ v_tile.transpose(-2, -1)
                ds = p * (dp - delta[..., i0:i1, None])
                dq[..., i0:i1, :] += (ds @ k_tile) * scale
                dk[..., j0:j1, :] += (ds.transpose(-2, -1) @ q_tile) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
        # END SOLUTION

