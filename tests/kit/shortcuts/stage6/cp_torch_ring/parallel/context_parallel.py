import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._attention import _cp_options, _templated_ring_attention
from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention_backward

ADDS = ("_TorchRing",)


class _TorchRing(torch.autograd.Function):
    # torch's ring, rotaters and merger; each block through the block interface (no SDPA kernel dispatched).
    # torch's "load balance" is the zig-zag layout: rank r holds chunks r and 2cp-1-r.
    @staticmethod
    def forward(ctx, q, k, v, group, is_causal, layout):
        group = group if group is not None else dist.group.WORLD
        shape = q.shape
        q4, k4, v4 = (t.reshape(-1, 1, *t.shape[-2:]) for t in (q, k, v))
        _cp_options.enable_load_balance = is_causal and layout == "zigzag"

        def block(q, k, v, is_causal):
            return attention_forward_with_lse(q, k, v, bool(is_causal), _backend(q))

        out, lse = _templated_ring_attention(group, 2, block, q4, k4, v4, is_causal=is_causal)
        ctx.save_for_backward(q4, k4, v4, out, lse)
        ctx.group, ctx.is_causal, ctx.layout, ctx.shape = group, is_causal, layout, shape
        return out.reshape(shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q4, k4, v4, out, lse = ctx.saved_tensors
        _cp_options.enable_load_balance = ctx.is_causal and ctx.layout == "zigzag"

        def block(query, key, value, out, logsumexp, is_causal, grad_out):
            return attention_backward_with_lse(query, key, value, out, logsumexp, grad_out, bool(is_causal),
                                               _backend(query))

        dq, dk, dv = _templated_ring_attention_backward(ctx.group, 2, block, grad_out.reshape(q4.shape), "grad_out",
                                                        q4, k4, v4, out, lse, ctx.is_causal)
        return dq.reshape(ctx.shape), dk.reshape(ctx.shape), dv.reshape(ctx.shape), None, None, None


def ring_attention(q, k, v, group, *, is_causal=False, layout="contiguous"):
    _check_qkv(q, k, v)
    instance("is_causal", is_causal, bool, "a bool")
    choice("layout", layout, LAYOUTS)
    cp = dist.get_world_size(group)
    _check_split(q.shape[-2] * cp, cp, layout)
    return _TorchRing.apply(q, k, v, group, is_causal, layout)
