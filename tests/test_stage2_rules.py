"""Stage 2's rule: the student builds the dynamic loss scaler; ``torch.amp.GradScaler`` may not build it for them.

A ``DynamicLossScaler`` that wraps or subclasses GradScaler makes every decision GradScaler makes — which is what
``test_scaler_matches_grad_scaler`` checks — so only this rule tells it from one the student wrote
(handout 02, What is graded). The judge below runs the scaler through scale, unscale, a skipped step and growth
under :func:`kit.grading.library_rules.watch`, in the worker; :mod:`tests.support.rules` adds a reading of the source
and, when the rule is broken, fails every test marked ``builds("grad-scaler")`` with the same message.
"""

from __future__ import annotations

import math

import pytest
import torch

import kit.impl
from kit.grading import library_rules
from tests.support import rules

pytestmark = pytest.mark.stage2


def _scaler_workload() -> list[dict]:
    """Scale, unscale, a step with an inf gradient (skipped, backoff) and clean steps (growth), watched."""
    precision = kit.impl.load().precision
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with library_rules.watch(["grad-scaler"]) as seen:
        scaler = precision.DynamicLossScaler(init_scale=1024.0, growth_interval=2)
        seen.check_object(scaler)
        for overflow in (False, True, False, False, False):
            opt.zero_grad()
            scaler.scale(model(torch.randn(2, 3)).sum()).backward()
            if overflow:
                model.weight.grad[0, 0] = math.inf
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        scaler.get_scale()
        scaler.load_state_dict(scaler.state_dict())
    return seen.as_data()


@rules.judge("grad-scaler")
def _judge_scaler(request: pytest.FixtureRequest) -> list[dict]:
    return request.getfixturevalue("worker").call(_scaler_workload)


@pytest.mark.points(1)
def test_builds_its_own_loss_scaler(request) -> None:
    """DynamicLossScaler neither wraps nor subclasses torch.amp.GradScaler, nor runs its update kernel."""
    rules.assert_kept("grad-scaler", request, (
        "the scaler's workload (scale, unscale_, step, "
        "update) failed with {error}. Make the scaler tests pass first "
        "(handout 02 §4)."))
