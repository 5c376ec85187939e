"""Stage 5 hidden tests (ZeRO-1), the worker's half: what the ranks run, and the training loops the judge
also runs for its references. No expected values, tolerances or messages here: they stay in
``test_stage5_hidden.py``, which a worker cannot read while grading."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import kit.impl
from kit.checks import run_checks
from kit.model import ModelConfig, TransformerLM, cross_entropy

TINY = ModelConfig(vocab_size=64, context_length=16, d_model=32, d_ff=64, num_layers=2, num_heads=2)
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
SGD = {"lr": 0.1, "momentum": 0.9, "nesterov": True}
STEPS = 8
GROUP = [1, 2]  # not starting at global rank 0: owner and destination ranks must be translated to global ones


def _transformer() -> nn.Module:
    torch.manual_seed(4321)
    return TransformerLM(TINY)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.context_length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_with_scheduler(make_optimizer: Callable[[list], torch.optim.Optimizer]):
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


def sgd_with_closure(make_optimizer: Callable[[Any], torch.optim.Optimizer]):
    """5 steps of a 2-parameter linear model, each through ``step(closure)``: the model, optimizer, losses."""
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
        loss = optimizer.step(closure)
        losses.append(float(loss.detach() if isinstance(loss, torch.Tensor) else loss))
    return model, optimizer, losses


def _subgroup_section(group: Any) -> dict[str, Any] | None:
    """ShardedOptimizer over GROUP with an LR scheduler: parameters, consolidated state dict, state count."""
    if dist.get_rank() not in GROUP:
        return None
    impl = kit.impl.load()
    model, optimizer = train_with_scheduler(
        lambda ps: impl.zero.ShardedOptimizer(ps, torch.optim.AdamW, process_group=group, **ADAMW))
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "state_dict": optimizer.state_dict(),  # on group rank 0 = global rank 1
            "state_count": len(optimizer.state)}


def _sgd_section() -> dict[str, Any]:
    """Two parameters on three ranks: one rank owns nothing and must still take part in every broadcast."""
    impl = kit.impl.load()
    model, optimizer, losses = sgd_with_closure(lambda ps: impl.zero.ShardedOptimizer(ps, torch.optim.SGD, **SGD))
    return {"params": [p.detach().clone() for p in model.parameters()], "losses": losses,
            "state_count": len(optimizer.state)}


def hidden_checks() -> dict:
    group = dist.new_group(GROUP)  # every rank calls new_group, members or not
    return run_checks({"subgroup": lambda: _subgroup_section(group), "sgd": _sgd_section})
