"""Stage 2 hidden checks: corners of GradScaler's rules and the memory count at another size."""

from __future__ import annotations

import copy

import pytest
import torch

from kit.model import TransformerLM, cross_entropy, get_config
from kit.testing import assert_close, assert_equal

pytestmark = [pytest.mark.stage2, pytest.mark.hidden]


@pytest.mark.points(1)
def test_hidden_scaler_fp32_rounding_and_overflow(impl) -> None:
    """GradScaler's scale lives in fp32: growth by 3 rounds to fp32 each time, and growth that would
    overflow fp32 is refused. The scaler must follow both rules step for step."""
    for kwargs, steps in (({"init_scale": 2.0**126, "growth_interval": 1}, 4),
                          ({"init_scale": 1.0, "growth_factor": 3.0, "backoff_factor": 0.7, "growth_interval": 1}, 30)):
        ours = impl.precision.DynamicLossScaler(**kwargs)
        ref = torch.amp.GradScaler("cpu", **kwargs)
        models = [torch.nn.Linear(2, 1) for _ in range(2)]
        models[1].load_state_dict(models[0].state_dict())
        opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]
        for step in range(steps):
            x = torch.randn(3, 2)
            for model, opt, scaler in zip(models, opts, (ours, ref)):
                opt.zero_grad()
                scaler.scale(model(x).sum() * 1e-30).backward()
                if step % 11 == 10:
                    model.weight.grad.fill_(float("nan"))
                scaler.step(opt)
                scaler.update()
            assert_equal(ours.get_scale(), ref.get_scale(), name=f"scale after step {step} with {kwargs}",
                         section="handout 02 §4")


@pytest.mark.points(1)
def test_hidden_estimate_mini_bf16_with_checkpoint(impl) -> None:
    """The analytic count matches the measurement for the mini preset in bf16, with and without
    checkpointing every 2 blocks."""
    config = get_config("mini", num_layers=2)
    base = TransformerLM(config)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (1, 49), generator=g)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()  # separate storages, as a loader gives
    for policy in ("none", 2):
        model = impl.precision.checkpointed(copy.deepcopy(base), policy)

        def fn(model=model):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(inputs)
            return cross_entropy(logits, targets)

        measured = impl.precision.saved_activation_bytes(fn)
        # The count is exact but for the loss's one 4-byte fp32 scalar: 16 bytes of slack, far below any item.
        est = impl.precision.activation_memory_estimate(config, 1, 48, torch.bfloat16, device_type="cpu",
                                                        checkpoint_policy=policy)
        assert_close(torch.tensor(float(est["total"])), torch.tensor(float(measured)),
                     name=f"estimated bytes, mini bf16, policy {policy!r}", section="handout 02 §6", rtol=0, atol=16)
