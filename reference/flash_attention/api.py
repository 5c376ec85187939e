"""Given code: one function to call either implementation, and the drop-in for the kit's Transformer."""

from __future__ import annotations

import torch

from .pytorch_impl import FlashAttentionPytorch
from .triton_impl import FlashAttentionTriton

BACKENDS = {"triton": FlashAttentionTriton, "pytorch": FlashAttentionPytorch}


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                    backend: str = "triton") -> torch.Tensor:
    """softmax(q kᵀ / √D) v by FlashAttention-2, differentiable.

    q: ``(..., Nq, D)``; k, v: ``(..., Nk, D)``; fp32, fp16 or bf16. Returns ``(..., Nq, D)`` in q's dtype.
    ``backend`` is ``"triton"`` (the kernels; CUDA, or the interpreter on a CPU) or ``"pytorch"``.

    Raises:
        TypeError: inputs that are not tensors, or of integer or mixed dtypes.
        ValueError: an unknown ``backend``, mismatched shapes or devices, or a head dimension the Triton kernels do
            not support.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    return BACKENDS[backend].apply(q, k, v, is_causal)


def flash_attention_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """Drop-in attention for :class:`kit.model.TransformerLM` (``attention_fn(q, k, v, is_causal)`` on
    ``(B, H, T, d_head)``): ``TransformerLM(config, attention_fn=flash_attention_fn)`` or
    ``model.set_attention(flash_attention_fn)``. Runs the Triton kernels.

    Under ``torch.autocast`` the projections hand over bf16/fp16 q, k, v, which is what the kernels want;
    mixed dtypes (e.g. fp32 rotary output next to a bf16 v) are brought to q's dtype.
    """
    k, v = k.to(q.dtype), v.to(q.dtype)
    return FlashAttentionTriton.apply(q, k, v, is_causal)
