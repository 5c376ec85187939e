"""``FlashAttentionTriton``: the Triton kernels behind torch's autograd (handout 03 §5–§6).

The forward launches :func:`triton_attention_forward` and saves exactly what the backward needs to
recompute the attention matrix tile by tile — q, k, v, o and the log-sum-exp L — and nothing of size
Nq × Nk. The backward launches :func:`triton_attention_backward` (three kernels), or the one-kernel
:func:`triton_attention_backward_fused` where ``triton_config.run_backward`` picks it (§6: on a GPU, the
faster of the two; ``LLMSYS_FA_BACKWARD=fused`` forces it).
"""

from __future__ import annotations

import torch

from .checks import TRITON_HEAD_DIMS, check_attention_inputs
from .triton_backward import triton_attention_backward
from .triton_backward_fused import triton_attention_backward_fused
from .triton_config import check_triton_device, run_backward
from .triton_forward import triton_attention_forward


class FlashAttentionTriton(torch.autograd.Function):
    """``FlashAttentionTriton.apply(q, k, v, is_causal=False) -> o``, the same contract as
    :class:`FlashAttentionPytorch`: q ``(..., Nq, D)``, k/v ``(..., Nk, D)``, fp32/fp16/bf16, D in
    {16, 32, 64, 128}; saves exactly ``q, k, v, o, L`` with L ``(..., Nq)`` fp32. CUDA tensors, or CPU
    tensors under the Triton interpreter.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        check_attention_inputs(q, k, v, is_causal, head_dims=TRITON_HEAD_DIMS)
        check_triton_device(q)
        # BEGIN SOLUTION run triton_attention_forward; save q, k, v, o, L and is_causal (handout 03 §5)
        o, L = triton_attention_forward(q, k, v, is_causal)
        ctx.save_for_backward(q, k, v, o, L)
        ctx.is_causal = is_causal
        return o
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, o, L = ctx.saved_tensors
        # BEGIN SOLUTION gradients from run_backward (or triton_attention_backward), None for is_causal (handout 03 §6)
        designs = {
            "split": lambda: triton_attention_backward(q, k, v, o, L, grad_out, ctx.is_causal),
            "fused": lambda: triton_attention_backward_fused(q, k, v, o, L, grad_out, ctx.is_causal),
        }
        dq, dk, dv = run_backward(designs, q, k.shape[-2], ctx.is_causal)
        return dq, dk, dv, None
        # END SOLUTION
