"""Stage 5 — instructor-only checks: ZeRO over a subgroup (what Stage 6 needs), an LR scheduler, another
optimizer class, a closure, and a rank that owns nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import kit.impl
from kit.checks import run_checks, spawned_checks
from kit.model import ModelConfig, TransformerLM, cross_entropy
from kit.testing import assert_close, assert_equal

pytestmark = [pytest.mark.stage5, pytest.mark.hidden]

TINY = ModelConfig(vocab_size=64, context_length=16, d_model=32, d_ff=64, num_layers=2, num_heads=2)
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
STEPS = 8
GROUP = [1, 2]  # not starting at global rank 0: owner and destination ranks must be translated to global ones


def _transformer() -> nn.Module:
    torch.manual_seed(4321)
    return TransformerLM(TINY)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.context_length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train_with_scheduler(make_optimizer: Callable[[list], torch.optim.Optimizer]):
    model = _transformer()
    optimizer = make_optimizer(list(model.parameters()))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.3)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        x, y = _batch(step)
        cross_entropy(model(x), y).backward()
        optimizer.step()
        scheduler.step()  # changes param_groups[i]["lr"]: the sharded optimizer must pass it on
    return model, optimizer


def _subgroup_section(group: Any) -> dict[str, Any]:
    impl = kit.impl.load()
    reference, ref_optimizer = _train_with_scheduler(lambda ps: torch.optim.AdamW(ps, **ADAMW))
    out: dict[str, Any] = {"reference": {n: p.detach().clone() for n, p in reference.named_parameters()},
                           "reference_state_dict": ref_optimizer.state_dict()}
    if dist.get_rank() in GROUP:
        model, optimizer = _train_with_scheduler(
            lambda ps: impl.zero.ShardedOptimizer(ps, torch.optim.AdamW, process_group=group, **ADAMW))
        out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out["state_dict"] = optimizer.state_dict()  # on group rank 0 = global rank 1
        out["state_count"] = len(optimizer.state)
    return out


def _sgd_section() -> dict[str, Any]:
    """Two parameters on three ranks: one rank owns nothing and must still take part in every broadcast."""
    impl = kit.impl.load()

    def run(make_optimizer):
        torch.manual_seed(7)
        model = nn.Linear(4, 2)
        optimizer = make_optimizer(model.parameters())
        x, y = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), torch.randn(6, 2)
        losses = []
        for _ in range(5):
            def closure():
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss
            losses.append(float(optimizer.step(closure)))
        return model, optimizer, losses

    sgd = {"lr": 0.1, "momentum": 0.9, "nesterov": True}
    model, optimizer, losses = run(lambda ps: impl.zero.ShardedOptimizer(ps, torch.optim.SGD, **sgd))
    reference, _, ref_losses = run(lambda ps: torch.optim.SGD(ps, **sgd))
    return {"params": [p.detach().clone() for p in model.parameters()],
            "reference": [p.detach().clone() for p in reference.parameters()],
            "losses": losses, "ref_losses": ref_losses, "state_count": len(optimizer.state)}


def _hidden_checks() -> dict:
    group = dist.new_group(GROUP)  # every rank calls new_group, members or not
    return run_checks({"subgroup": lambda: _subgroup_section(group), "sgd": _sgd_section})


hidden_ranks = spawned_checks(_hidden_checks, 3, timeout=240)


@pytest.mark.points(2)
def test_hidden_subgroup_with_lr_scheduler(hidden_ranks) -> None:
    results = hidden_ranks.values("subgroup")
    for rank in GROUP:
        r = results[rank]
        for name, expected in r["reference"].items():
            assert_close(r["params"][name], expected, name=f"global rank {rank} (group {GROUP}), {name} after "
                         f"{STEPS} steps with StepLR vs single-process AdamW", section="handout 05 §3",
                         rtol=1e-5, atol=1e-6)
    counts = [results[rank]["state_count"] for rank in GROUP]
    assert_equal(sum(counts), len(results[1]["reference"]), name="parameters with state, summed over the group",
                 section="handout 05 §2")
    assert results[2]["state_dict"] is None, "state_dict() is None except on the group's rank 0"
    got, expected = results[1]["state_dict"], results[1]["reference_state_dict"]
    assert got is not None, "state_dict() must be consolidated on the group's rank 0 (global rank 1 here)"
    assert_equal([g["lr"] for g in got["param_groups"]], [g["lr"] for g in expected["param_groups"]],
                 name="lr after the scheduler", section="handout 05 §4")
    for index, state in expected["state"].items():
        for key, value in state.items():
            assert_close(got["state"][index][key], value, name=f"state[{index}][{key!r}]", section="handout 05 §4",
                         rtol=1e-5, atol=1e-6)


@pytest.mark.points(2)
def test_hidden_sgd_closure_and_a_rank_without_parameters(hidden_ranks) -> None:
    results = hidden_ranks.values("sgd")
    for rank, r in enumerate(results):
        for i, (got, expected) in enumerate(zip(r["params"], r["reference"])):
            assert_close(got, expected, name=f"rank {rank}: parameter {i} after 5 SGD (Nesterov) steps",
                         section="handout 05 §3", rtol=1e-6, atol=1e-7)
        assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), name=f"rank {rank}: losses "
                     "returned by step(closure)", section="handout 05 §3", rtol=1e-6, atol=1e-7)
    assert_equal(sorted(r["state_count"] for r in results), [0, 1, 1],
                 name="parameters with state per rank (2 parameters, 3 ranks)", section="handout 05 §2")
