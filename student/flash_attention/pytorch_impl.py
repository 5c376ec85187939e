# Your work goes in this file. Generated from the kit's reference by `make student`.
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
        raise NotImplementedError("FlashAttentionPytorch.forward: online softmax over K/V tiles for each Q tile; save q, k, v, o, L (handout 03 §1–§2)")

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        """Gradients by recomputation (handout 03 §3), with P_ij = exp(s_ij − L_i) rebuilt tile by tile:

            D_i = Σ_d dO_id O_id                 (= rowsum(dO ∘ O), one float per query row)
            dV  = Pᵀ dO        dP = dO Vᵀ        dS = P ∘ (dP − D)
            dQ  = dS K / √D    dK = dSᵀ Q / √D
        """
        q, k, v, o, L = ctx.saved_tensors
        Bq, Bk = FlashAttentionPytorch.Q_TILE, FlashAttentionPytorch.K_TILE
        raise NotImplementedError("FlashAttentionPytorch.backward: D = rowsum(dO ∘ O), then recompute P tile by tile; accumulate dQ, dK, dV (handout 03 §3)")

