"""Stage 5 — instructor-only checks: ZeRO over a subgroup (what Stage 6 needs), an LR scheduler, another
optimizer class, a closure, and a rank that owns nothing.

The judge's half: the ranks run ``stage5_hidden_worker`` and return what they computed; the references
(single-process AdamW with the same scheduler, single-process SGD with the same closure) are trained
here, and compared here.
"""

from __future__ import annotations

import pytest
import torch
from stage5_hidden_worker import ADAMW, GROUP, SGD, STEPS, hidden_checks, sgd_with_closure, train_with_scheduler

from kit.checks import spawned_checks
from kit.testing import assert_close, assert_equal

pytestmark = [pytest.mark.stage5, pytest.mark.hidden]

hidden_ranks = spawned_checks(hidden_checks, 3, timeout=240)


@pytest.mark.builds("torch-zero")
@pytest.mark.points(2)
def test_hidden_subgroup_with_lr_scheduler(hidden_ranks) -> None:
    results = hidden_ranks.values("subgroup")
    reference_model, ref_optimizer = train_with_scheduler(lambda ps: torch.optim.AdamW(ps, **ADAMW))
    reference = {n: p.detach().clone() for n, p in reference_model.named_parameters()}
    # Every rank's gradient is the whole batch's and the owner steps torch's AdamW with the scheduler's lr: the
    # reference's arithmetic, bit for bit on one machine; rtol 1e-5 / atol 1e-6 (test_stage5_zero.TOL) is slack
    # for ≤ 1 ulp per step computed in another order. The state (exp_avg, exp_avg_sq) below likewise.
    for rank in GROUP:
        r = results[rank]
        for name, expected in reference.items():
            assert_close(r["params"][name], expected, name=f"global rank {rank} (group {GROUP}), {name} after "
                         f"{STEPS} steps with StepLR vs single-process AdamW", section="handout 05 §3",
                         rtol=1e-5, atol=1e-6)
    counts = [results[rank]["state_count"] for rank in GROUP]
    assert_equal(sum(counts), len(reference), name="parameters with state, summed over the group",
                 section="handout 05 §2")
    assert results[2]["state_dict"] is None, "state_dict() is None except on the group's rank 0"
    got, expected = results[1]["state_dict"], ref_optimizer.state_dict()
    assert got is not None, "state_dict() must be consolidated on the group's rank 0 (global rank 1 here)"
    assert_equal([g["lr"] for g in got["param_groups"]], [g["lr"] for g in expected["param_groups"]],
                 name="lr after the scheduler", section="handout 05 §4")
    for index, state in expected["state"].items():
        for key, value in state.items():  # the owner's own AdamW state: bit for bit, TOL as slack (see above)
            assert_close(got["state"][index][key], value, name=f"state[{index}][{key!r}]", section="handout 05 §4",
                         rtol=1e-5, atol=1e-6)


@pytest.mark.builds("torch-zero")
@pytest.mark.points(2)
def test_hidden_sgd_closure_and_a_rank_without_parameters(hidden_ranks) -> None:
    results = hidden_ranks.values("sgd")
    reference_model, _, ref_losses = sgd_with_closure(lambda ps: torch.optim.SGD(ps, **SGD))
    reference = [p.detach().clone() for p in reference_model.parameters()]
    # The same closure on the same data on every rank, torch's SGD on the owner: bit for bit on one machine. SGD
    # moves a parameter by lr × the update's difference, so a reordered update (≤ 1 ulp per step, 5 steps) stays
    # ≲ 10u·|p| ≈ 6e-7·|p|: rtol 1e-6, atol 1e-7 for values near 0. The losses are computed before each step.
    for rank, r in enumerate(results):
        assert_equal(len(r["params"]), len(reference), name=f"rank {rank}: parameters of the model",
                     section="handout 05 §3")
        for i, (got, expected) in enumerate(zip(r["params"], reference)):
            assert_close(got, expected, name=f"rank {rank}: parameter {i} after 5 SGD (Nesterov) steps",
                         section="handout 05 §3", rtol=1e-6, atol=1e-7)
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), name=f"rank {rank}: losses "
                     "returned by step(closure)", section="handout 05 §3", rtol=1e-6, atol=1e-7)
    assert_equal(sorted(r["state_count"] for r in results), [0, 1, 1],
                 name="parameters with state per rank (2 parameters, 3 ranks)", section="handout 05 §2")
