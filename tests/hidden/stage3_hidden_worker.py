"""Stage 3 hidden checks, the worker's half: run the implementation, return what it computed (data).

The judge's half (tests/hidden/test_stage3_hidden.py) holds the inputs' construction, the references,
tolerances and messages; this module is the only part of the hidden tests a worker can read.
"""

from __future__ import annotations

from tests.support.flash_attention import backward_design, flash_class, run


def causal_runs(name: str, q, k, v, k2, v2, do) -> dict:
    """O and dQ of a causal forward + backward on (q, k, v), then on (q, k2, v2)."""
    fn = flash_class(name)
    first = run(fn, q, k, v, do, True, backward=True)
    second = run(fn, q, k2, v2, do, True, backward=True)
    return {"o1": first["o"], "dq1": first["grads"][0], "o2": second["o"], "dq2": second["grads"][0]}


def triton_causal(q, k, v, do, design=None) -> dict:
    """O, saved tensors and gradients of a causal FlashAttentionTriton forward + backward (``design``: the
    backward design asked for)."""
    with backward_design(design):
        return run(flash_class("FlashAttentionTriton"), q, k, v, do, True, backward=True)
