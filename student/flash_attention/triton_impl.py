# Your work goes in this file. Generated from the kit's reference by `make student`.
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
        raise NotImplementedError("FlashAttentionTriton.forward: run triton_attention_forward; save q, k, v, o, L and is_causal (handout 03 §5)")

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, o, L = ctx.saved_tensors
        raise NotImplementedError("FlashAttentionTriton.backward: gradients from run_backward (or triton_attention_backward), None for is_causal (handout 03 §6)")
