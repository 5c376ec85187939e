import torch

from .checks import as_3d


class FlashAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        check_attention_inputs(q, k, v, is_causal, head_dims=TRITON_HEAD_DIMS)
        check_triton_device(q)
        o, L = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            as_3d(q).unsqueeze(0), as_3d(k).unsqueeze(0), as_3d(v).unsqueeze(0), 0.0, is_causal)
        o, L = o.view(q.shape), L.view(q.shape[:-1])
        ctx.save_for_backward(q, k, v, o, L)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, o, L = ctx.saved_tensors
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            as_3d(grad_out.to(q.dtype)).unsqueeze(0), as_3d(q).unsqueeze(0), as_3d(k).unsqueeze(0),
            as_3d(v).unsqueeze(0), as_3d(o).unsqueeze(0), L.reshape(1, -1, q.shape[-2]), 0.0, ctx.is_causal)
        dq, dk, dv = (g.reshape(t.shape) for g, t in zip(grads, (q, k, v)))
        return dq, dk, dv, None
