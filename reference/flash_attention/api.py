"""Given code: one function to call either implementation, the drop-in for the kit's Transformer, and the block
interface ring attention (Stage 6, handout 06b) builds on."""

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


# ------------------------------------------------------------------------------------------------------------------
# The block interface: one attention block's forward with its log-sum-exp, and its backward given the rows' final
# output and log-sum-exp. Ring attention (Stage 6, handout 06b) calls these for each (query block, key block) pair
# and merges the blocks itself. They run the chosen backend's own forward and backward staticmethods — the student's
# Stage 3 code — outside autograd, with a small stand-in for autograd's ctx: the Stage 3 contract says the forward
# saves exactly q, k, v, o, L, so L is read back from what it saved and the backward is handed the o and L it wants.
# ------------------------------------------------------------------------------------------------------------------


class _BlockContext:
    """What the backends' forward/backward use of autograd's ``ctx``: ``save_for_backward``, ``saved_tensors``
    and attributes of their own (``is_causal``)."""

    needs_input_grad = (True, True, True, False)

    def __init__(self, saved: tuple[torch.Tensor, ...] = ()) -> None:
        self.saved_tensors = saved

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def _backend(name: str) -> type[torch.autograd.Function]:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}")
    return BACKENDS[name]


def attention_forward_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                               backend: str = "pytorch") -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention and its rows' log-sum-exp, without autograd.

    q: ``(..., Nq, D)``; k, v: ``(..., Nk, D)``; fp32, fp16 or bf16. Returns ``(o, lse)``: o ``(..., Nq, D)`` in
    q's dtype, lse ``(..., Nq)`` fp32, the natural log of Σ_j exp(q_i · k_j / √D) over the keys row i sees
    (causal: j ≤ i, the block's own positions). Runs ``BACKENDS[backend].forward``.
    """
    ctx = _BlockContext()
    with torch.no_grad():
        o = _backend(backend).forward(ctx, q, k, v, is_causal)
    saved = ctx.saved_tensors
    if len(saved) != 5:
        raise RuntimeError(f"the {backend} FlashAttention forward saved {len(saved)} tensors; the Stage 3 contract "
                           "is exactly q, k, v, o, L (handout 03 §2)")
    return o, saved[4]


def attention_backward_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                                lse: torch.Tensor, grad_out: torch.Tensor, is_causal: bool,
                                backend: str = "pytorch") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's ``(dq, dk, dv)`` given the rows' *final* output o and log-sum-exp lse, without autograd.

    The backward recomputes P = exp(S − lse) and uses D = rowsum(dO ∘ O): with the o and lse of the whole row
    (every key block merged), P is this block's columns of the full softmax and the result is exactly this
    block's share of the full gradient — dq summed over the blocks, dk and dv are this block's. Shapes as in
    :func:`attention_forward_with_lse`; grad_out like o. Runs ``BACKENDS[backend].backward``.
    """
    ctx = _BlockContext((q, k, v, o.to(q.dtype), lse.float()))
    ctx.is_causal = is_causal
    with torch.no_grad():
        dq, dk, dv, *_ = _backend(backend).backward(ctx, grad_out.to(q.dtype))
    return dq, dk, dv
