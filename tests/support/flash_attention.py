"""Stage 3's worker-side harness, shared by the public tests and the hidden tests' worker half.

Everything here runs in a worker (it calls the implementation); the judge only reads the data it returns.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import kit.impl

# The backward designs an implementation may offer (flash_attention/triton_config.py, run_backward). On a GPU the
# faster one runs, so every test of the backward asks for each; one that is not offered runs the split design.
BACKWARD_DESIGNS = ("split", "fused")


@contextlib.contextmanager
def backward_design(design: str | None):
    """In a worker: ``triton_config.BACKWARD`` set to ``design`` for the duration (None: left as it is)."""
    with contextlib.ExitStack() as stack:
        if design is not None:
            config = kit.impl.load().flash_attention.triton_config
            stack.enter_context(mock.patch.object(config, "BACKWARD", design, create=True))
        yield


def run(fn, q, k, v, do, is_causal, backward) -> dict:
    """In a worker: output, saved tensors and (optionally) input gradients of ``fn.apply``, as data —
    ``{"o": O, "saved": [tensors autograd saved], "grads": [dQ, dK, dV] (None where not computed)}``."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o = fn.apply(q, k, v, is_causal)
    saved = list(o.grad_fn.saved_tensors) if o.grad_fn is not None else []
    if backward:
        o.backward(do)
    return {"o": o.detach(), "saved": saved, "grads": [q.grad, k.grad, v.grad]}


def flash_class(name: str):
    """The implementation's ``flash_attention.<name>`` (``FlashAttentionPytorch`` or ``FlashAttentionTriton``)."""
    if name not in ("FlashAttentionPytorch", "FlashAttentionTriton"):
        raise ValueError(f"no such FlashAttention class: {name!r}")
    return getattr(kit.impl.load().flash_attention, name)


def run_named(name: str, q, k, v, do, is_causal, backward, permute: tuple[int, ...] | None = None) -> dict:
    """:func:`run` of ``flash_attention.<name>``; with ``permute``, on ``t.permute(*permute)`` of each input
    (a non-contiguous view, made here so that its strides are exactly those the judge describes)."""
    if permute is not None:
        q, k, v, do = (t.permute(*permute) for t in (q, k, v, do))
    return run(flash_class(name), q, k, v, do, is_causal, backward)


__all__ = ["BACKWARD_DESIGNS", "backward_design", "flash_class", "run", "run_named"]
