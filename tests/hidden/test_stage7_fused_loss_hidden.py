"""Stage 7 hidden checks (fused loss): fp16, the loss inside the kit's Transformer, one input frozen, sizes smaller
than a tile.

The implementation runs in the worker (stage7_fused_loss_hidden_worker.py); the references and comparisons are here.
"""

from __future__ import annotations

import pytest
import torch
from stage7_fused_loss_hidden_worker import loss_and_grads, transformer_step

import kit  # noqa: F401 — before triton: the interpreter on machines without CUDA
from kit.model import TransformerLM, cross_entropy
from kit.testing import assert_close
from tests.test_stage7_fused_loss import DEVICE, UPSTREAM, check_against_float64, loss_float64, make_inputs, tolerance

pytestmark = [
    pytest.mark.stage7,
    pytest.mark.hidden,
    pytest.mark.builds("triton-loss"),  # each test grades the fused loss (tests/test_stage7_rules.py)
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]


@pytest.mark.points(1)
def test_fused_loss_fp16(worker):
    """fp16 inputs: the loss and both gradients against float64, by the rule of the public tests."""
    h, w, t = make_inputs((37, 40), 101, torch.float16)
    got = worker.call(loss_and_grads, h, w, t, UPSTREAM)
    check_against_float64(got, h, w, t, "float16, hidden (37, 40), V = 101, every 5th token ignored")


@pytest.mark.points(2)
def test_fused_loss_trains_the_transformer(worker):
    """fused_linear_cross_entropy(model.hidden_states(x), model.lm_head.weight, y) is a drop-in for
    cross_entropy(model(x), y): same loss and same gradient for every parameter of TransformerLM("tiny")."""
    torch.manual_seed(0)
    model = TransformerLM("tiny")
    tokens = torch.randint(0, model.config.vocab_size, (2, 21))
    targets = torch.randint(0, model.config.vocab_size, (2, 21))
    state = {name: p.detach().clone() for name, p in model.state_dict().items()}
    got = worker.call(transformer_step, state, tokens.to(DEVICE), targets.to(DEVICE))
    loss = cross_entropy(model(tokens), targets)
    loss.backward()
    # fp32 everywhere: the two losses differ by rounding only (the logits' sums in another order, a mean over 42
    # tokens): a few ulps of ≈ 6.4 (ulp 4.8e-7), and 1e-5 relative is ~100 of them. A gradient flows back through
    # the whole model: each side ~√K·u·Σ|terms| from exact, measured ≤ 2e-8 against float64 at |g| ≲ 0.08, i.e.
    # ≤ 0.015 of rtol 1e-4 / atol 1e-6 (the floor for elements near 0, ~1e-3 of a median |g|).
    assert_close(got["loss"], loss.detach(), name="loss of TransformerLM('tiny') with the fused loss",
                 section="handout 07 §1", rtol=1e-5, atol=1e-6)
    for (name, grad), p in zip(got["grads"], model.parameters()):
        assert grad is not None, f"no gradient reached {name}: the fused loss must be differentiable (handout 07 §3)"
        assert_close(grad, p.grad, name=f"gradient of {name} with the fused loss", section="handout 07 §3",
                     rtol=1e-4, atol=1e-6)


@pytest.mark.points(1)
def test_fused_loss_one_input_frozen(worker):
    """A frozen LM head (weight without grad) still gives dH, and detached hidden states still give dW: bf16,
    (B, T, d) hidden (the public test_fused_loss_one_input_frozen runs fp32 rows)."""
    h, w, t = make_inputs((2, 19, 24), 77, torch.bfloat16)
    exact = loss_float64(h, w, t)
    for grad_hidden, grad_weight in ((True, False), (False, True)):
        got = worker.call(loss_and_grads, h, w, t, UPSTREAM, grad_hidden, grad_weight)
        key, other = ("dh", "dw") if grad_hidden else ("dw", "dh")
        frozen = "weight" if grad_hidden else "hidden"
        assert got[other] is None, f"{frozen} does not require grad, yet it received one"
        assert_close(got[key], exact[key], name=f"{key} with {frozen} frozen",
                     section="handout 07 §3", **tolerance(h, w, t, key))


@pytest.mark.points(1)
def test_fused_loss_smaller_than_a_tile(worker):
    """Sizes below every tile: 3 tokens, V = 7, d = 5; and a single token given as hidden (d,) with a 0-dim target."""
    h, w, t = make_inputs((3, 5), 7, torch.float32, ignore_every=0)
    got = worker.call(loss_and_grads, h, w, t, UPSTREAM)
    check_against_float64(got, h, w, t, "fp32, 3 tokens, V = 7, d = 5")
    h1, t1 = h[1], t[1]
    got = worker.call(loss_and_grads, h1, w, t1, UPSTREAM)
    check_against_float64(got, h1, w, t1, "fp32, one token: hidden (5,), target 0-dim, V = 7")
