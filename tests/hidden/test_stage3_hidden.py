"""Stage 3 hidden checks: causality is exact, and the larger head dimensions work.

The implementation runs in the worker (stage3_hidden_worker.py); the comparisons are made here.
"""

from __future__ import annotations

import pytest
import torch
from stage3_hidden_worker import causal_runs, triton_causal

import kit  # noqa: F401 — before triton: the interpreter on machines without CUDA
from kit.testing import assert_close
from tests.support.flash_attention import BACKWARD_DESIGNS
from tests.test_stage3_flash_attention import BY_CLASS, DEVICE, attention_float64, make_inputs, tolerance

pytestmark = [
    pytest.mark.stage3,
    pytest.mark.hidden,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]


@pytest.mark.points(1)
@pytest.mark.parametrize("name", BY_CLASS)
def test_causal_rows_ignore_future_keys(worker, name):
    """With the causal mask, O and dQ of rows i < n do not change when keys j ≥ n change wildly."""
    n = 50
    q, k, v, do = make_inputs((1, 2, 70, 32), (1, 2, 90, 32), torch.float32)
    k2, v2 = k.clone(), v.clone()
    k2[..., n:, :] *= 100.0  # huge scores: any leak through the mask would dominate the softmax
    v2[..., n:, :] = 1e4 * torch.randn_like(v2[..., n:, :])
    got = worker.call(causal_runs, name, q, k, v, k2, v2, do)
    o1, dq1, o2, dq2 = got["o1"], got["dq1"], got["o2"], got["dq2"]
    # Masked terms are exactly exp(−∞) = 0 in fp32 too, and the same tiles run in the same order, so rows < n
    # should be bit-identical; atol 1e-6 (≈ 16 ulps of |O|, |dQ| ≲ 1) is slack only, while any leak of ×100
    # scores or 1e4-sized values moves them by ≫ 1e-3.
    assert_close(o2[..., :n, :], o1[..., :n, :], name=f"{name} O of rows < {n} after changing keys ≥ {n}",
                 section="handout 03 §4", rtol=0, atol=1e-6)
    assert_close(dq2[..., :n, :], dq1[..., :n, :], name=f"{name} dQ of rows < {n} after changing keys ≥ {n}",
                 section="handout 03 §4", rtol=0, atol=1e-6)


@pytest.mark.points(2)
@pytest.mark.builds("triton-attention")
def test_triton_head_dims_64_and_128(worker):
    """The Triton kernels at head dims 64 and 128, bf16, causal, Nq < Nk, forward and backward."""
    for d, design in ((d, design) for d in (64, 128) for design in BACKWARD_DESIGNS):
        q, k, v, do = make_inputs((1, 1, 40, d), (1, 1, 70, d), torch.bfloat16, device=DEVICE)
        got = worker.call(triton_causal, q, k, v, do, design)
        o, grads = got["o"], got["grads"]
        o64, _, leaves = attention_float64(q, k, v, True)
        o64.backward(do.double())
        assert_close(o, o64, name=f"O (D={d})", section="handout 03 §5", **tolerance(q, k, v, True, "o"))
        for name, grad, leaf in zip(("dQ", "dK", "dV"), grads, leaves):
            assert_close(grad, leaf.grad, name=f"{name} (D={d}, backward design {design!r})",
                         section="handout 03 §6", **tolerance(q, k, v, True, name, do))
