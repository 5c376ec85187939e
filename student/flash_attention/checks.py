# Given code — read, don't edit. Generated from the kit's reference by `make student`.
"""Given code: the input contract every FlashAttention entry point checks before doing any work.

The kernels see attention as a batch of independent problems: ``q`` of shape ``(..., Nq, D)``, ``k`` and
``v`` of shape ``(..., Nk, D)``, where ``...`` is any number of leading batch/head dimensions (``(B, N, D)``
and ``(B, H, N, D)`` are the common cases). :func:`check_attention_inputs` turns bad input into an error
that names the argument; :func:`as_3d` flattens the leading dimensions into one "batch·heads" axis, the
layout the Triton launch grid indexes.
"""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Triton's tl.arange needs a power of two and tl.dot needs at least 16 along the reduced dimension.
TRITON_HEAD_DIMS = (16, 32, 64, 128)


def check_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, *, head_dims: tuple[int, ...] | None = None
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument when ``q, k, v, is_causal`` break the contract.

    Contract: tensors on one device, one floating dtype among fp32/fp16/bf16, at least 2 dimensions,
    identical leading (batch/head) dimensions, one head dimension ``D`` shared by q, k and v, as many
    keys as values, non-empty sequences, and ``is_causal`` a bool. ``head_dims`` restricts ``D``
    (the Triton kernels support 16, 32, 64 and 128).

    Raises:
        TypeError: inputs that are not tensors, or of integer or mixed dtypes.
        ValueError: mismatched batch or head dimensions, k and v of different lengths, or tensors on different
            devices.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16 (got {t.dtype}); attention on integer "
                            "or float64 tensors is not supported")
        if t.dim() < 2:
            raise ValueError(f"{name} must have shape (..., N, D) with at least 2 dimensions, got {tuple(t.shape)}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}")
    if q.shape[:-2] != k.shape[:-2] or q.shape[:-2] != v.shape[:-2]:
        raise ValueError("q, k and v must have the same leading (batch/head) dimensions, got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"q, k and v must share the head dimension D (last dim), got q {q.shape[-1]}, "
                         f"k {k.shape[-1]}, v {v.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must hold the same number of keys (dim -2), got k {k.shape[-2]}, v {v.shape[-2]}")
    if q.shape[-2] == 0 or k.shape[-2] == 0 or d == 0:
        raise ValueError(f"sequences and head dimension must be non-empty, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if head_dims is not None and d not in head_dims:
        raise ValueError(f"head dimension D = {d} (last dim of q, k, v) is not supported; use one of {head_dims}")


def as_3d(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` of shape ``(..., N, D)`` as ``(batch·heads, N, D)`` with unit stride along ``D``.

    ``reshape`` returns a view when the leading dimensions can be merged and copies otherwise (e.g. a
    transposed ``(B, H, T, D)`` view of a ``(B, T, H, D)`` tensor), so any strided input is handled.

    The kernels compute row offsets ``row · stride_n`` in 32 bits (only the batch·head offset is 64-bit:
    int64 arithmetic in the hot loop costs registers). A view whose rows lie further apart than that —
    ``(N − 1) · stride_n ≥ 2³¹``, e.g. a ``(B, H, T, D)`` permutation of a huge ``(T, B, H, D)`` tensor — is
    therefore copied to contiguous rows, where ``(N − 1) · D`` is small.
    """
    x3 = x.reshape(-1, x.shape[-2], x.shape[-1])
    if x3.stride(-1) != 1 or (x3.shape[1] - 1) * x3.stride(1) >= 2**31:
        x3 = x3.contiguous()
    return x3
