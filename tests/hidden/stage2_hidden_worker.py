"""Stage 2 hidden checks, the worker's half: what runs the implementation and returns data.

The judge's half (expected values, tolerances, messages) is ``test_stage2_hidden.py``.
"""

from __future__ import annotations

import torch

import kit.impl
from kit.model import TransformerLM, cross_entropy
from tests.support.precision import stepwise


def _precision():
    return kit.impl.load().precision


def scaler_scales(kwargs: dict, state: dict, xs: list) -> dict:
    """The implementation's scaler on a Linear(2, 1) with a tiny loss (× 1e-30) and a nan gradient every 11th
    step: its scale after each step, step by step."""
    precision = _precision()
    model = torch.nn.Linear(2, 1)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = precision.DynamicLossScaler(**kwargs)

    def step(i: int, record: dict) -> None:
        opt.zero_grad()
        scaler.scale(model(xs[i]).sum() * 1e-30).backward()
        if i % 11 == 10:
            model.weight.grad.fill_(float("nan"))
        scaler.step(opt)
        scaler.update()
        record["scale"] = scaler.get_scale()

    return stepwise(step, len(xs))


def estimate(config, batch_size: int, context_length: int, dtype, policy) -> dict:
    return _precision().activation_memory_estimate(config, batch_size, context_length, dtype, device_type="cpu",
                                                   checkpoint_policy=policy)


def checkpointed_saved_bytes(config, state: dict, policy, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """What the implementation's saved_activation_bytes measures for one bf16 forward + loss of the judge's model,
    checkpointed by the implementation's checkpointed(model, policy)."""
    precision = _precision()
    model = TransformerLM(config)
    model.load_state_dict(state)
    model = precision.checkpointed(model, policy)

    def fn():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(inputs)
        return cross_entropy(logits, targets)

    return precision.saved_activation_bytes(fn)
