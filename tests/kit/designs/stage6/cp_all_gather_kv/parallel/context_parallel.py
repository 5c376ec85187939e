"""Design override: context parallelism without a ring — an asynchronous all-gather of K/V overlapping the local
block's attention, and one all-reduce that takes each block's dK/dV home.

Only what this design writes differently from reference/parallel/context_parallel.py:
instructor/overrides.py builds the graded module from the reference and these definitions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..flash_attention.api import attention_backward_with_lse, attention_forward_with_lse


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                is_causal: bool, layout: str) -> torch.Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        backend = _backend(q)
        q_ids = _chunk_ids(cp, rank, layout)
        q_chunks = q.chunk(len(q_ids), dim=-2)
        kv = torch.stack([k, v]).contiguous()
        every_kv = [torch.empty_like(kv) for _ in range(cp)]
        gathering = dist.all_gather(every_kv, kv, group=group, async_op=True)
        out: list[torch.Tensor | None] = [None] * len(q_ids)
        lse: list[torch.Tensor | None] = [None] * len(q_ids)
        # The own block first, from the local K/V: it computes while the other blocks are on their way.
        for source in [rank] + [s for s in range(cp) if s != rank]:
            if source == rank:
                block = kv
            else:
                if gathering is not None:
                    gathering.wait()
                    gathering = None
                block = every_kv[source]
            k_ids = _chunk_ids(cp, source, layout)
            k_chunks, v_chunks = block[0].chunk(len(k_ids), dim=-2), block[1].chunk(len(k_ids), dim=-2)
            for qi, ki, causal in _block_pairs(q_ids, k_ids, is_causal):
                o_block, lse_block = attention_forward_with_lse(q_chunks[qi], k_chunks[ki], v_chunks[ki], causal,
                                                                backend)
                out[qi], lse[qi] = _merge(out[qi], lse[qi], o_block, lse_block)
        if gathering is not None:  # cp = 1: nothing else to attend
            gathering.wait()
        o, lse_all = torch.cat(out, dim=-2), torch.cat(lse, dim=-1)
        ctx.save_for_backward(q, k, v, o, lse_all)
        ctx.group, ctx.is_causal, ctx.layout = group, is_causal, layout
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:
        q, k, v, o, lse = ctx.saved_tensors
        group, is_causal, layout = ctx.group, ctx.is_causal, ctx.layout
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        backend = _backend(q)
        q_ids = _chunk_ids(cp, rank, layout)
        n = len(q_ids)
        q_chunks, o_chunks = q.chunk(n, dim=-2), o.chunk(n, dim=-2)
        lse_chunks, do_chunks = lse.chunk(n, dim=-1), grad_out.chunk(n, dim=-2)
        kv = torch.stack([k, v]).contiguous()
        every_kv = [torch.empty_like(kv) for _ in range(cp)]
        dist.all_gather(every_kv, kv, group=group)
        dq = [torch.zeros(c.shape, dtype=torch.float32, device=q.device) for c in q_chunks]
        shares = torch.zeros((cp, *kv.shape), dtype=torch.float32, device=q.device)  # this rank's dK/dV of each block
        for source in range(cp):
            k_ids = _chunk_ids(cp, source, layout)
            k_chunks, v_chunks = every_kv[source][0].chunk(len(k_ids), dim=-2), every_kv[source][1].chunk(len(k_ids),
                                                                                                          dim=-2)
            dk_chunks, dv_chunks = shares[source, 0].chunk(len(k_ids), dim=-2), shares[source, 1].chunk(len(k_ids),
                                                                                                        dim=-2)
            for qi, ki, causal in _block_pairs(q_ids, k_ids, is_causal):
                dq_b, dk_b, dv_b = attention_backward_with_lse(q_chunks[qi], k_chunks[ki], v_chunks[ki], o_chunks[qi],
                                                               lse_chunks[qi], do_chunks[qi], causal, backend)
                dq[qi] += dq_b.float()
                dk_chunks[ki].add_(dk_b.float())
                dv_chunks[ki].add_(dv_b.float())
        dist.all_reduce(shares, group=group)  # every rank's share of every block; each keeps its own block's
        dk, dv = shares[rank, 0], shares[rank, 1]
        return torch.cat(dq, dim=-2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
