"""Design override: a split-vocabulary forward (partial max/sum-exp per (token tile, vocabulary tile), combined in
PyTorch; the target's logit by a gather of W[targets]) and a backward whose accumulators live in registers: 2-D grids
over (tile, chunk of d), the logits recomputed once per chunk of d, every gradient written once in its own dtype.

Only what this design writes differently from reference/whole_step/fused_cross_entropy.py:
instructor/overrides.py builds the graded module from the reference and these definitions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kit import triton_interpreted

ADDS = ("design_tiles", "logit_block", "lse_partials_kernel", "grad_hidden_kernel", "grad_weight_kernel")


def design_tiles(dtype: torch.dtype) -> dict[str, int]:
    """TILE_N tokens × TILE_V vocabulary entries, TILE_D features: small in the interpreter, tensor-core sized on a
    GPU (fp32 smaller)."""
    if triton_interpreted():
        return {"TILE_N": 32, "TILE_V": 32, "TILE_D": 16}
    if dtype == torch.float32:
        return {"TILE_N": 32, "TILE_V": 32, "TILE_D": 32, "num_warps": 4, "num_stages": 2}
    return {"TILE_N": 64, "TILE_V": 64, "TILE_D": 64, "num_warps": 4, "num_stages": 3}


@triton.jit
def logit_block(Hid, Wt, row_stride_h, row_stride_w, tok, voc, n_tok, n_voc, n_feat,
                TILE_N: tl.constexpr, TILE_V: tl.constexpr, TILE_D: tl.constexpr,
                F32_TILES: tl.constexpr, PRECISION: tl.constexpr):
    """z[tok, voc] = Σ_k Hid[tok, k] · Wt[voc, k] over all features, fp32; −inf where voc ≥ n_voc."""
    z = tl.zeros([TILE_N, TILE_V], dtype=tl.float32)
    for k0 in range(0, n_feat, TILE_D):
        k = k0 + tl.arange(0, TILE_D)
        a = tl.load(Hid + tok[:, None] * row_stride_h + k[None, :], mask=(tok[:, None] < n_tok) & (k[None, :] < n_feat),
                    other=0.0)
        b = tl.load(Wt + voc[None, :] * row_stride_w + k[:, None], mask=(voc[None, :] < n_voc) & (k[:, None] < n_feat),
                    other=0.0)
        if F32_TILES:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        z += tl.dot(a, b, input_precision=PRECISION)  # b is already (TILE_D, TILE_V): loaded transposed
    return tl.where(voc[None, :] < n_voc, z, float("-inf"))


@triton.jit
def lse_partials_kernel(Hid, Wt, PartMax, PartSum, row_stride_h, row_stride_w, n_tok, n_voc, n_feat, n_blocks,
                        TILE_N: tl.constexpr, TILE_V: tl.constexpr, TILE_D: tl.constexpr,
                        F32_TILES: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (⌈n_tok/TILE_N⌉, ⌈n_voc/TILE_V⌉): the row max and Σ exp(z − max) of one logit block, into
    PartMax/PartSum[tok, block] (n_tok × n_blocks fp32)."""
    tok = tl.program_id(0).to(tl.int64) * TILE_N + tl.arange(0, TILE_N)
    block = tl.program_id(1)
    voc = block.to(tl.int64) * TILE_V + tl.arange(0, TILE_V)
    z = logit_block(Hid, Wt, row_stride_h, row_stride_w, tok, voc, n_tok, n_voc, n_feat, TILE_N, TILE_V, TILE_D,
                    F32_TILES, PRECISION)
    top = tl.max(z, axis=1)  # finite: the block holds at least one real column
    total = tl.sum(tl.exp(z - top[:, None]), axis=1)
    ok = tok < n_tok
    tl.store(PartMax + tok * n_blocks + block, top, mask=ok)
    tl.store(PartSum + tok * n_blocks + block, total, mask=ok)


@triton.jit
def grad_hidden_kernel(Hid, Wt, Tgt, Lse, Coef, GradH, row_stride_h, row_stride_w, row_stride_g,
                       n_tok, n_voc, n_feat, skip,
                       TILE_N: tl.constexpr, TILE_V: tl.constexpr, TILE_D: tl.constexpr,
                       F32_TILES: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (⌈n_tok/TILE_N⌉, ⌈n_feat/TILE_D⌉): GradH[tok, feats] = Σ over vocabulary blocks of dz · Wt[voc, feats],
    accumulated in registers and stored once."""
    tok = tl.program_id(0).to(tl.int64) * TILE_N + tl.arange(0, TILE_N)
    feats = tl.program_id(1) * TILE_D + tl.arange(0, TILE_D)
    live = tok < n_tok
    y = tl.load(Tgt + tok, mask=live, other=skip)
    lse = tl.load(Lse + tok, mask=live, other=0.0)
    weight_of_row = tl.where(live & (y != skip), tl.load(Coef), 0.0)
    grad = tl.zeros([TILE_N, TILE_D], dtype=tl.float32)
    for v0 in range(0, n_voc, TILE_V):
        voc = v0 + tl.arange(0, TILE_V).to(tl.int64)
        z = logit_block(Hid, Wt, row_stride_h, row_stride_w, tok, voc, n_tok, n_voc, n_feat, TILE_N, TILE_V, TILE_D,
                        F32_TILES, PRECISION)
        dz = (tl.exp(z - lse[:, None]) - (voc[None, :] == y[:, None]).to(tl.float32)) * weight_of_row[:, None]
        wv = tl.load(Wt + voc[:, None] * row_stride_w + feats[None, :],
                     mask=(voc[:, None] < n_voc) & (feats[None, :] < n_feat), other=0.0)
        if F32_TILES:
            wv = wv.to(tl.float32)
        grad += tl.dot(dz.to(wv.dtype), wv, input_precision=PRECISION)
    tl.store(GradH + tok[:, None] * row_stride_g + feats[None, :], grad.to(GradH.dtype.element_ty),
             mask=live[:, None] & (feats[None, :] < n_feat))


@triton.jit
def grad_weight_kernel(Hid, Wt, Tgt, Lse, Coef, GradW, row_stride_h, row_stride_w, row_stride_g,
                       n_tok, n_voc, n_feat, skip,
                       TILE_N: tl.constexpr, TILE_V: tl.constexpr, TILE_D: tl.constexpr,
                       F32_TILES: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (⌈n_voc/TILE_V⌉, ⌈n_feat/TILE_D⌉): GradW[voc, feats] = Σ over token blocks of dzᵀ · Hid[tok, feats]."""
    voc = tl.program_id(0).to(tl.int64) * TILE_V + tl.arange(0, TILE_V)
    feats = tl.program_id(1) * TILE_D + tl.arange(0, TILE_D)
    coef = tl.load(Coef)
    grad = tl.zeros([TILE_V, TILE_D], dtype=tl.float32)
    for n0 in range(0, n_tok, TILE_N):
        tok = n0 + tl.arange(0, TILE_N).to(tl.int64)
        live = tok < n_tok
        y = tl.load(Tgt + tok, mask=live, other=skip)
        lse = tl.load(Lse + tok, mask=live, other=0.0)
        z = logit_block(Hid, Wt, row_stride_h, row_stride_w, tok, voc, n_tok, n_voc, n_feat, TILE_N, TILE_V, TILE_D,
                        F32_TILES, PRECISION)
        dz = (tl.exp(z - lse[:, None]) - (voc[None, :] == y[:, None]).to(tl.float32)) \
            * tl.where(live & (y != skip), coef, 0.0)[:, None]
        hv = tl.load(Hid + tok[:, None] * row_stride_h + feats[None, :],
                     mask=live[:, None] & (feats[None, :] < n_feat), other=0.0)
        if F32_TILES:
            hv = hv.to(tl.float32)
        grad += tl.dot(tl.trans(dz.to(hv.dtype)), hv, input_precision=PRECISION)
    tl.store(GradW + voc[:, None] * row_stride_g + feats[None, :], grad.to(GradW.dtype.element_ty),
             mask=(voc[:, None] < n_voc) & (feats[None, :] < n_feat))


def fused_ce_forward(h2: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partial (max, Σ exp) per logit block in a kernel, combined here; z_target = ⟨h, W[target]⟩ by a gather."""
    n_tok, n_feat = h2.shape
    n_voc = weight.shape[0]
    tiles = design_tiles(h2.dtype)
    n_blocks = triton.cdiv(n_voc, tiles["TILE_V"])
    part_max = torch.empty((n_tok, n_blocks), dtype=torch.float32, device=h2.device)
    part_sum = torch.empty_like(part_max)
    f32 = triton_interpreted() and h2.dtype == torch.bfloat16
    lse_partials_kernel[(triton.cdiv(n_tok, tiles["TILE_N"]), n_blocks)](
        h2, weight, part_max, part_sum, h2.stride(0), weight.stride(0), n_tok, n_voc, n_feat, n_blocks,
        F32_TILES=f32, PRECISION="ieee" if f32 or h2.dtype == torch.float32 else "tf32", **tiles)
    top = part_max.max(dim=1).values
    lse = top + torch.log((part_sum * torch.exp(part_max - top[:, None])).sum(dim=1))
    keep = targets != ignore_index
    picked = weight.index_select(0, torch.where(keep, targets, 0))
    z_target = (h2.float() * picked.float()).sum(dim=1)
    per_token = torch.where(keep, lse - z_target, 0.0)
    n_counted = keep.sum()
    return per_token.sum() / n_counted, lse, n_counted


def fused_ce_backward(h2: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                      scale: torch.Tensor, ignore_index: int, *,
                      need_weight_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Register accumulators: each program owns a (tile × chunk of d) block of a gradient and writes it once."""
    n_tok, n_feat = h2.shape
    n_voc = weight.shape[0]
    tiles = design_tiles(h2.dtype)
    f32 = triton_interpreted() and h2.dtype == torch.bfloat16
    flags = dict(F32_TILES=f32, PRECISION="ieee" if f32 or h2.dtype == torch.float32 else "tf32", **tiles)
    chunks = triton.cdiv(n_feat, tiles["TILE_D"])
    grad_h = torch.empty((n_tok, n_feat), dtype=h2.dtype, device=h2.device)
    grad_hidden_kernel[(triton.cdiv(n_tok, tiles["TILE_N"]), chunks)](
        h2, weight, targets, lse, scale, grad_h, h2.stride(0), weight.stride(0), grad_h.stride(0),
        n_tok, n_voc, n_feat, ignore_index, **flags)
    grad_w = None
    if need_weight_grad:
        grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        grad_weight_kernel[(triton.cdiv(n_voc, tiles["TILE_V"]), chunks)](
            h2, weight, targets, lse, scale, grad_w, h2.stride(0), weight.stride(0), grad_w.stride(0),
            n_tok, n_voc, n_feat, ignore_index, **flags)
    return grad_h, grad_w
