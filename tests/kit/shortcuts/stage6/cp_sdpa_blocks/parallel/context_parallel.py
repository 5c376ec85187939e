import torch

ADDS = ("attention_forward_with_lse", "attention_backward_with_lse")


def attention_forward_with_lse(q, k, v, is_causal, backend="pytorch"):
    # The ring's block attention by torch's CPU flash kernel, which hands back the rows' log-sum-exp too.
    shape = q.shape
    q4, k4, v4 = (t.reshape(-1, 1, *t.shape[-2:]) for t in (q, k, v))
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q4, k4, v4, 0.0, is_causal)
    return o.reshape(shape), lse.reshape(shape[:-1]).float()


def attention_backward_with_lse(q, k, v, o, lse, grad_out, is_causal, backend="pytorch"):
    shape = q.shape
    q4, k4, v4 = (t.reshape(-1, 1, *t.shape[-2:]) for t in (q, k, v))
    o4 = o.to(q.dtype).reshape(q4.shape)
    do4 = grad_out.to(q.dtype).reshape(q4.shape)
    lse4 = lse.float().reshape(*q4.shape[:-1])
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do4, q4, k4, v4, o4, lse4, 0.0, is_causal)
    return dq.reshape(shape), dk.reshape(k.shape), dv.reshape(v.shape)
