import torch
import torch.nn.functional as F


class FlashAttentionPytorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        check_attention_inputs(q, k, v, is_causal)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        # L in query tiles, so that no tensor is the size of the score matrix.
        scale, nq, nk = 1.0 / math.sqrt(q.shape[-1]), q.shape[-2], k.shape[-2]
        L = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        for i0 in range(0, nq, 64):
            i1 = min(i0 + 64, nq)
            s = (q[..., i0:i1, :].float() @ k.float().transpose(-2, -1)) * scale
            if is_causal:
                rows = torch.arange(i0, i1, device=q.device)[:, None]
                s = s.masked_fill(torch.arange(nk, device=q.device)[None, :] > rows, float("-inf"))
            L[..., i0:i1] = torch.logsumexp(s, dim=-1)
        ctx.save_for_backward(q, k, v, o, L)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, o, L = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*leaves, is_causal=ctx.is_causal)
            dq, dk, dv = torch.autograd.grad(out, leaves, grad_out)
        return dq, dk, dv, None
