"""Stage 1 — instructor-only checks (not in the student release)."""

from __future__ import annotations

import pytest
import torch
from stage1_hidden_worker import attention, time_fn_one_iteration

pytestmark = [pytest.mark.stage1, pytest.mark.hidden]


@pytest.mark.points(1)
def test_time_fn_single_iteration(worker):
    """One timed call: std is 0 and every statistic equals the one sample."""
    stats = worker.call(time_fn_one_iteration)
    got = (stats["mean"], stats["std"], stats["median"], stats["min"])
    # Exact: 0.25 − 0 and a mean of one value are exact in binary floating point.
    assert got == (0.25, 0.0, 0.25, 0.25), (
        f"one sample of 0.25 s gave mean, std, median, min = {got}; expected mean=median=min=0.25 and std=0 "
        "(handout 01 §1)"
    )


@pytest.mark.points(1)
def test_annotated_attention_rectangular_causal(worker):
    """Nq ≠ Nk with causal masking aligns query i with key i (the top-left convention)."""
    q, k, v = torch.randn(5, 8), torch.randn(9, 8), torch.randn(9, 8)
    out = worker.call(attention, q, k, v, True)
    scores = (q.double() @ k.double().T) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(5, 9, dtype=torch.bool).tril().logical_not(), float("-inf"))
    expected = torch.softmax(scores, -1) @ v.double()
    # fp32 vs float64: D = 8 products and 9 keys give ~(8 + 18)·2⁻²⁴ ≈ 2e-6 relative error at |out| ≲ 3;
    # atol 1e-5 (plus allclose's default rtol 1e-5) is a ≥ 2× margin, a wrong mask alignment moves outputs by O(0.1).
    assert isinstance(out, torch.Tensor) and out.shape == expected.shape, f"output {type(out)} (handout 01 §3)"
    assert torch.allclose(out.double(), expected, atol=1e-5), "causal mask with Nq != Nk (handout 01 §3)"
