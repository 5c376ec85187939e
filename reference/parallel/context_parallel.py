"""Context parallelism: ring attention over a ``cp`` group, each rank holding a slice of the sequence (handout 06b).

Stage 6, part 2. Long sequences make attention's activations the largest thing a rank holds, so the sequence itself
is split: with ``cp`` ranks, rank r keeps N/cp of the N tokens — their q, k and v — and never the whole sequence.
Every other layer of a Transformer is position-wise and needs nothing from the other ranks; attention needs every
key and value of the sequence for each query. Ring attention brings them to the queries one block at a time:

    step 0:  rank r attends its queries to its own K/V block                     (ranks in a ring 0 → 1 → … → cp−1 → 0)
    step s:  it passes the K/V block it holds to rank r+1 and receives rank r−1's, so at step s it holds the block
             of rank (r − s) mod cp; after cp steps every query has seen every key.

The send/receive of the next block is posted *before* the current block's attention and waited for after it, so
the network moves block s+1 while the cores compute block s (§3): with enough tokens per rank the communication
hides behind the compute entirely.

**Merging blocks (§2).** Each block's attention is the student's Stage 3 FlashAttention, through the block interface
:func:`~..flash_attention.api.attention_forward_with_lse`, which returns the block's output o_b and its rows'
log-sum-exp lse_b = log Σ_{j∈b} exp(s_ij). Two blocks a and b of the same query rows combine exactly:

    lse = log(e^{lse_a} + e^{lse_b})                      (the log-sum-exp over the keys of both blocks)
    o   = e^{lse_a − lse} · o_a + e^{lse_b − lse} · o_b    (each block's softmax renormalised to the union)

e^{lse} overflows fp32 once lse > 88 (large logits), so lse is computed as max + log(1 + e^{min − max})
= max(lse_a, lse_b) + log1p(exp(−|lse_a − lse_b|)): the exponent is ≤ 0, nothing overflows. Both are fp32.

**Backward (§4).** With the final o and lse of each row, the Stage 3 backward of one block,
:func:`~..flash_attention.api.attention_backward_with_lse`, gives exactly that block's share of the gradient:
P = exp(S − lse) are the block's columns of the full softmax and D = rowsum(dO ∘ O) is the full row's. So dq sums
over the blocks locally, while dk and dv of a block belong to the rank that owns it: their accumulators travel the
ring *with* the K/V block (same direction as the forward) and reach their owner after the last step's send.

**Causal load balance (§5).** With a causal mask, query i sees keys j ≤ i. In the contiguous layout rank r's queries
see r + 1 of the cp blocks, so the last rank does ≈ 2cp − 1 times the work of the first. The zig-zag layout cuts the
sequence into 2·cp chunks and gives rank r chunks r and 2cp − 1 − r: an early chunk with little work and a late one
with much, the same total on every rank. Whatever the layout, each rank splits its shard into its chunks and treats
each (query chunk, key chunk) pair by their global order: key chunk after query chunk → skipped; the same chunk → a
causal block; before → a full block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kit.validate import choice, index, instance, integer, positive_int

from ..flash_attention.api import attention_backward_with_lse, attention_forward_with_lse

__all__ = ["LAYOUTS", "causal_work", "gather_sequence", "ring_attention", "ring_attention_on_ranks", "shard_positions",
           "shard_sequence"]

LAYOUTS = ("contiguous", "zigzag")


# ------------------------------------------------------------------------------------------------------------------
# Given: argument checks
# ------------------------------------------------------------------------------------------------------------------


def _check_split(seq_len: int, cp: int, layout: str) -> None:
    """``ValueError`` naming seq_len unless it splits into the layout's equal chunks (cp, or 2·cp for zig-zag)."""
    choice("layout", layout, LAYOUTS)
    chunks = cp if layout == "contiguous" else 2 * cp
    if seq_len % chunks:
        raise ValueError(f"seq_len = {seq_len} must be divisible by {chunks} ({'cp' if chunks == cp else '2·cp'} "
                         f"= {chunks} equal chunks of the {layout} layout with cp = {cp}); pad the sequence first "
                         "(handout 06b §1)")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        instance(name, t, torch.Tensor, "a tensor")
        if not t.is_floating_point() or t.dtype == torch.float64:
            raise TypeError(f"{name} must be fp32, fp16 or bf16, got {t.dtype}")
    if k.shape != q.shape or v.shape != q.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must have one shape and dtype (each rank's shard of the same tokens), got "
                         f"{tuple(q.shape)} {q.dtype}, {tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}")
    if q.dim() < 2:
        raise ValueError(f"q, k, v must be (..., N_local, D), got {q.dim()} dimension(s)")


# ------------------------------------------------------------------------------------------------------------------
# Sharding the sequence (§1, §5)
# ------------------------------------------------------------------------------------------------------------------


def _chunk_ids(cp: int, cp_rank: int, layout: str) -> list[int]:
    """The global chunk indices rank ``cp_rank`` holds, in the order it holds them: ``[r]`` of ``cp`` chunks
    (contiguous), ``[r, 2·cp − 1 − r]`` of ``2·cp`` chunks (zig-zag)."""
    # BEGIN SOLUTION one chunk r, or chunks r and 2cp−1−r of 2cp (handout 06b §1, §5)
    return [cp_rank] if layout == "contiguous" else [cp_rank, 2 * cp - 1 - cp_rank]
    # END SOLUTION


def shard_positions(seq_len: int, cp: int, cp_rank: int, layout: str = "contiguous") -> torch.Tensor:
    """int64 ``(seq_len // cp,)``: the global token positions rank ``cp_rank`` holds, in the order it holds them.

    contiguous: ``[r·n, (r+1)·n)`` with n = seq_len / cp. zigzag: chunks r and 2·cp − 1 − r of 2·cp equal chunks,
    in that order. ``ValueError`` naming seq_len when it does not divide into the layout's chunks.
    """
    positive_int("seq_len", seq_len)
    positive_int("cp", cp)
    index("cp_rank", cp_rank, cp)
    _check_split(seq_len, cp, layout)
    # BEGIN SOLUTION the positions of this rank's chunks, concatenated in order (handout 06b §1, §5)
    ids = _chunk_ids(cp, cp_rank, layout)
    size = seq_len // (cp * len(ids))
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in ids])
    # END SOLUTION


def shard_sequence(x: torch.Tensor, *, cp: int, cp_rank: int, layout: str = "contiguous",
                   dim: int = -2) -> torch.Tensor:
    """This rank's shard of the full-sequence tensor ``x`` along ``dim``:
    ``x.index_select(dim, shard_positions(x.shape[dim], cp, cp_rank, layout))``. Any dtype and device."""
    instance("x", x, torch.Tensor, "a tensor")
    integer("dim", dim, minimum=-x.dim(), maximum=x.dim() - 1)
    positive_int("cp", cp)
    index("cp_rank", cp_rank, cp)
    _check_split(x.shape[dim], cp, layout)
    # BEGIN SOLUTION select this rank's positions along dim (handout 06b §1)
    return x.index_select(dim, shard_positions(x.shape[dim], cp, cp_rank, layout).to(x.device))
    # END SOLUTION


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup | None, *, layout: str = "contiguous",
                    dim: int = -2) -> torch.Tensor:
    """The inverse of :func:`shard_sequence` over the cp ``group``: all-gather every rank's shard and put each token
    back at its global position. ``local``: this rank's shard; returns the full sequence along ``dim`` (not
    differentiable). Every rank of the group must call it."""
    instance("local", local, torch.Tensor, "a tensor")
    integer("dim", dim, minimum=-local.dim(), maximum=local.dim() - 1)
    choice("layout", layout, LAYOUTS)
    cp = dist.get_world_size(group)
    _check_split(local.shape[dim] * cp, cp, layout)
    # BEGIN SOLUTION all-gather the shards, then index_copy them to their positions (handout 06b §1)
    dim = dim % local.dim()
    shards = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(shards, local.contiguous(), group=group)
    seq_len = local.shape[dim] * cp
    positions = torch.cat([shard_positions(seq_len, cp, r, layout) for r in range(cp)]).to(local.device)
    shape = list(local.shape)
    shape[dim] = seq_len
    full = torch.empty(shape, dtype=local.dtype, device=local.device)
    return full.index_copy_(dim, positions, torch.cat(shards, dim=dim))
    # END SOLUTION


def causal_work(seq_len: int, cp: int, layout: str) -> list[int]:
    """Per cp rank, the number of (query, key) score pairs it computes under a causal mask: query position p sees
    keys 0 … p, so a rank's work is Σ (p + 1) over its positions — exactly what its diagonal (causal) and full
    blocks compute together, skipped blocks adding nothing."""
    positive_int("seq_len", seq_len)
    positive_int("cp", cp)
    _check_split(seq_len, cp, layout)
    # BEGIN SOLUTION Σ (p + 1) over each rank's positions (handout 06b §5)
    return [int((shard_positions(seq_len, cp, r, layout) + 1).sum()) for r in range(cp)]
    # END SOLUTION


# ------------------------------------------------------------------------------------------------------------------
# The ring: merge, exchange, forward and backward (§2–§4)
# ------------------------------------------------------------------------------------------------------------------


def _merge(o: torch.Tensor | None, lse: torch.Tensor | None, o_block: torch.Tensor,
           lse_block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a block's ``(o_block, lse_block)`` into the rows' running ``(o, lse)`` (``None``: nothing yet).
    o: ``(..., n, D)`` fp32; lse: ``(..., n)`` fp32. Returns the merged pair, fp32."""
    o_block, lse_block = o_block.float(), lse_block.float()
    if o is None or lse is None:
        return o_block, lse_block
    # BEGIN SOLUTION lse = max + log1p(exp(−|Δ|)); o = e^{lse_a−lse} o_a + e^{lse_b−lse} o_b (handout 06b §2)
    new_lse = torch.maximum(lse, lse_block) + torch.log1p(torch.exp(-(lse - lse_block).abs()))
    new_o = torch.exp(lse - new_lse)[..., None] * o + torch.exp(lse_block - new_lse)[..., None] * o_block
    return new_o, new_lse
    # END SOLUTION


def _block_pairs(q_ids: list[int], k_ids: list[int], is_causal: bool) -> list[tuple[int, int, bool]]:
    """The (local query chunk, local key chunk, causal) blocks to compute, given the chunks' global indices:
    without a mask every pair, full; with one, key chunk after query chunk → skipped, the same chunk → causal,
    before → full."""
    # BEGIN SOLUTION compare the chunks' global indices (handout 06b §5)
    pairs = []
    for qi, q_id in enumerate(q_ids):
        for ki, k_id in enumerate(k_ids):
            if not is_causal or k_id < q_id:
                pairs.append((qi, ki, False))
            elif k_id == q_id:
                pairs.append((qi, ki, True))
    return pairs
    # END SOLUTION


def _ring_exchange(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup | None,
                   tag: int = 0) -> list[dist.Work]:
    """Post, without waiting, the send of ``send`` to the next rank of the ring and the receive of the previous
    rank's into ``recv``; the handles to wait on. Every rank of the group calls it."""
    # BEGIN SOLUTION isend to (r+1) mod cp, irecv from (r−1) mod cp, as global ranks (handout 06b §3)
    group = group if group is not None else dist.group.WORLD
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    to_next = dist.get_global_rank(group, (rank + 1) % cp)
    from_prev = dist.get_global_rank(group, (rank - 1) % cp)
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, to_next, group, tag),
                                   dist.P2POp(dist.irecv, recv, from_prev, group, tag)])
    # END SOLUTION


def _backend(t: torch.Tensor) -> str:
    """The Stage 3 FlashAttention each block runs: the Triton kernels on a GPU, the PyTorch one on a CPU."""
    return "triton" if t.is_cuda else "pytorch"


class _RingAttention(torch.autograd.Function):
    """``_RingAttention.apply(q, k, v, group, is_causal, layout) -> o``: see :func:`ring_attention`."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                is_causal: bool, layout: str) -> torch.Tensor:
        """cp steps; at step s this rank holds the K/V of rank (r − s) mod cp. Post the exchange of the next block,
        attend this block's pairs and merge them into each query chunk's (o, lse), then wait. Save q, k, v, the
        merged o and lse for the backward."""
        # BEGIN SOLUTION exchange the next K/V block while attending the current one; merge by lse (handout 06b §2–§3)
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        backend = _backend(q)
        q_ids = _chunk_ids(cp, rank, layout)
        q_chunks = q.chunk(len(q_ids), dim=-2)
        out: list[torch.Tensor | None] = [None] * len(q_ids)
        lse: list[torch.Tensor | None] = [None] * len(q_ids)
        kv = torch.stack([k, v]).contiguous()  # one message per step: K and V travel together
        for step in range(cp):
            if step < cp - 1:  # post the next block's transfer first: it moves while this block computes
                incoming = torch.empty_like(kv)
                pending = _ring_exchange(kv, incoming, group)
            k_ids = _chunk_ids(cp, (rank - step) % cp, layout)
            k_chunks, v_chunks = kv[0].chunk(len(k_ids), dim=-2), kv[1].chunk(len(k_ids), dim=-2)
            for qi, ki, causal in _block_pairs(q_ids, k_ids, is_causal):
                o_block, lse_block = attention_forward_with_lse(q_chunks[qi], k_chunks[ki], v_chunks[ki], causal,
                                                                backend)
                out[qi], lse[qi] = _merge(out[qi], lse[qi], o_block, lse_block)
            if step < cp - 1:
                for work in pending:
                    work.wait()
                kv = incoming
        o, lse_all = torch.cat(out, dim=-2), torch.cat(lse, dim=-1)
        ctx.save_for_backward(q, k, v, o, lse_all)
        ctx.group, ctx.is_causal, ctx.layout = group, is_causal, layout
        return o.to(q.dtype)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:
        """The forward's ring again, same direction: at step s the K/V block of rank (r − s) mod cp arrives with the
        dk/dv accumulated for it so far; add this rank's share (from the final o and lse) and pass both on. dq stays
        here. After the last step one more send takes each dk/dv to its owner."""
        # BEGIN SOLUTION dq locally; dk/dv travel with their K/V block and end at the owner (handout 06b §4)
        q, k, v, o, lse = ctx.saved_tensors
        group, is_causal, layout = ctx.group, ctx.is_causal, ctx.layout
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        backend = _backend(q)
        q_ids = _chunk_ids(cp, rank, layout)
        n_chunks = len(q_ids)
        q_chunks, o_chunks = q.chunk(n_chunks, dim=-2), o.chunk(n_chunks, dim=-2)
        lse_chunks, do_chunks = lse.chunk(n_chunks, dim=-1), grad_out.chunk(n_chunks, dim=-2)
        dq = [torch.zeros(c.shape, dtype=torch.float32, device=q.device) for c in q_chunks]
        kv = torch.stack([k, v]).contiguous()
        dkv_incoming: torch.Tensor | None = None  # the dk/dv accumulated so far for the block arriving now
        dkv_pending: list[dist.Work] = []
        for step in range(cp):
            if step < cp - 1:
                incoming = torch.empty_like(kv)
                kv_pending = _ring_exchange(kv, incoming, group)
            k_ids = _chunk_ids(cp, (rank - step) % cp, layout)
            k_chunks, v_chunks = kv[0].chunk(len(k_ids), dim=-2), kv[1].chunk(len(k_ids), dim=-2)
            share = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # this rank's dk, dv of the block
            dk_chunks, dv_chunks = share[0].chunk(len(k_ids), dim=-2), share[1].chunk(len(k_ids), dim=-2)
            for qi, ki, causal in _block_pairs(q_ids, k_ids, is_causal):
                dq_b, dk_b, dv_b = attention_backward_with_lse(q_chunks[qi], k_chunks[ki], v_chunks[ki], o_chunks[qi],
                                                               lse_chunks[qi], do_chunks[qi], causal, backend)
                dq[qi] += dq_b.float()
                dk_chunks[ki].add_(dk_b.float())
                dv_chunks[ki].add_(dv_b.float())
            for work in dkv_pending:  # the accumulator of this block, from the previous rank (step ≥ 1)
                work.wait()
            dkv = share if dkv_incoming is None else dkv_incoming + share
            if cp == 1:  # no ring: the block is this rank's own
                dkv_incoming = dkv
            else:
                dkv_incoming = torch.empty_like(dkv)
                dkv_pending = _ring_exchange(dkv, dkv_incoming, group, tag=1)  # to the next holder, or the owner
            if step < cp - 1:
                for work in kv_pending:
                    work.wait()
                kv = incoming
        for work in dkv_pending:
            work.wait()
        dk, dv = dkv_incoming[0], dkv_incoming[1]  # this rank's own block's, home after cp steps
        return torch.cat(dq, dim=-2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
        # END SOLUTION


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None, *,
                   is_causal: bool = False, layout: str = "contiguous") -> torch.Tensor:
    """Exact softmax(q kᵀ/√D) v over the whole sequence, each rank of the cp ``group`` holding only its shard.

    q, k, v: ``(..., N_local, D)``, this rank's shard (positions ``shard_positions(N_local·cp, cp, rank, layout)``),
    fp32, fp16 or bf16. Returns ``(..., N_local, D)`` in q's dtype; differentiable (the backward passes dK/dV
    around the ring back to their owners). K/V blocks travel the ring with asynchronous send/receive posted before
    the local block's attention; partial outputs merge through the log-sum-exp in fp32; each block is the Stage 3
    FlashAttention through the block interface. ``group`` ``None`` is the default group.
    """
    _check_qkv(q, k, v)
    instance("is_causal", is_causal, bool, "a bool")
    choice("layout", layout, LAYOUTS)
    cp = dist.get_world_size(group)
    _check_split(q.shape[-2] * cp, cp, layout)
    # BEGIN SOLUTION run the autograd.Function (handout 06b §3)
    return _RingAttention.apply(q, k, v, group, is_causal, layout)
    # END SOLUTION


# ------------------------------------------------------------------------------------------------------------------
# Given: one ring on the ranks of a spawn, for the notebook (notebooks/06b_context_parallel.py)
# ------------------------------------------------------------------------------------------------------------------


def ring_attention_on_ranks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                            layout: str = "contiguous", grad_out: torch.Tensor | None = None) -> dict:
    """Run on every rank of the default group (``kit.spawn.run_on_ranks(ring_attention_on_ranks, cp, …)``): shard
    the full-sequence ``(..., N, D)`` q, k, v over the world, run :func:`ring_attention`, and gather the result back
    into sequence order. Returns ``{"out": (..., N, D)}``, plus ``"dq"``, ``"dk"``, ``"dv"`` (full sequence, from
    the backward of ``grad_out``) when ``grad_out`` is given. Every rank returns the same tensors."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    local = [shard_sequence(x, cp=cp, cp_rank=rank, layout=layout).detach().requires_grad_() for x in (q, k, v)]
    out = ring_attention(*local, None, is_causal=is_causal, layout=layout)
    result = {"out": gather_sequence(out.detach(), None, layout=layout)}
    if grad_out is not None:
        out.backward(shard_sequence(grad_out, cp=cp, cp_rank=rank, layout=layout))
        for name, x in zip(("dq", "dk", "dv"), local, strict=True):
            result[name] = gather_sequence(x.grad, None, layout=layout)
    return result
