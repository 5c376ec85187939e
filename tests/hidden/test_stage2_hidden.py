"""Stage 2 hidden checks: corners of GradScaler's rules and the memory count at another size.

The implementation runs in the worker (``stage2_hidden_worker``); the expected values — GradScaler's
scales, the bytes the test's own hook sees saved — are computed here.
"""

from __future__ import annotations

import copy

import pytest
import torch
from stage2_hidden_worker import checkpointed_saved_bytes, estimate, scaler_scales

from kit.model import TransformerLM, get_config
from kit.testing import assert_close, assert_equal
from tests.support.precision import Steps, checkpointed_by_test, saved_bytes_independent

pytestmark = [pytest.mark.stage2, pytest.mark.hidden]


@pytest.mark.builds("grad-scaler")
@pytest.mark.points(1)
def test_hidden_scaler_fp32_rounding_and_overflow(worker) -> None:
    """GradScaler's scale lives in fp32: growth by 3 rounds to fp32 each time, and growth that would
    overflow fp32 is refused. The scaler must follow both rules step for step."""
    for kwargs, steps in (({"init_scale": 2.0**126, "growth_interval": 1}, 4),
                          ({"init_scale": 1.0, "growth_factor": 3.0, "backoff_factor": 0.7, "growth_interval": 1}, 30)):
        models = [torch.nn.Linear(2, 1) for _ in range(2)]  # (the second: the implementation's, in the worker)
        model = models[0]
        xs = [torch.randn(3, 2) for _ in range(steps)]
        ours = Steps(worker.call(scaler_scales, kwargs, copy.deepcopy(model.state_dict()), xs), "scaler_scales")
        ref = torch.amp.GradScaler("cpu", **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for step in range(steps):
            opt.zero_grad()
            ref.scale(model(xs[step]).sum() * 1e-30).backward()
            if step % 11 == 10:
                model.weight.grad.fill_(float("nan"))
            ref.step(opt)
            ref.update()
            assert_equal(ours.get(step, "scale"), ref.get_scale(), name=f"scale after step {step} with {kwargs}",
                         section="handout 02 §4")


@pytest.mark.points(1)
def test_hidden_estimate_mini_bf16_with_checkpoint(worker) -> None:
    """The analytic count matches the measurement for the mini preset in bf16, with and without
    checkpointing every 2 blocks."""
    config = get_config("mini", num_layers=2)
    base = TransformerLM(config)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (1, 49), generator=g)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()  # separate storages, as a loader gives
    for policy, k in (("none", None), (2, 2)):
        # Measured here with the test's own hook, on a model the test checkpoints itself (torch.utils.checkpoint
        # around each segment of k blocks), as the public test_activation_estimate_matches_measurement does. The
        # test used to compare the estimate with the implementation's own measurement (saved_activation_bytes of
        # the model its checkpointed() made): that one comparison is now two against this measurement, the
        # estimate's and the implementation's measurement's, so a mistake in either is still caught, by name.
        model = copy.deepcopy(base) if k is None else checkpointed_by_test(copy.deepcopy(base), k)
        measured = saved_bytes_independent(model, inputs, targets, torch.bfloat16)
        # The count is exact but for the loss's one 4-byte fp32 scalar: 16 bytes of slack, far below any item.
        est = worker.call(estimate, config, 1, 48, torch.bfloat16, policy)
        assert_close(torch.tensor(float(est["total"])), torch.tensor(float(measured)),
                     name=f"estimated bytes, mini bf16, policy {policy!r}", section="handout 02 §6", rtol=0, atol=16)
        # The same forward measured by the same rules (handout 02 §6) on the same checkpointing (§7): equal but for
        # 0-dim scalars, so the same 16 bytes.
        theirs = worker.call(checkpointed_saved_bytes, config, base.state_dict(), policy, inputs, targets)
        assert_close(torch.tensor(float(theirs)), torch.tensor(float(measured)),
                     name=f"saved_activation_bytes of the mini model, bf16, checkpointed(model, {policy!r})",
                     section="handout 02 §6 and §7", rtol=0, atol=16)
