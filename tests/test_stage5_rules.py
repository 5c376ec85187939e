"""Stage 5's rules: the student builds ZeRO-1 and FSDP; torch's ``ZeroRedundancyOptimizer`` and ``fully_shard``
(or ``FullyShardedDataParallel``) may not build them for them.

A ``ShardedOptimizer`` that subclasses or wraps ``ZeroRedundancyOptimizer`` trains exactly as torch's does — which
is what ``test_matches_torch_zero_redundancy_optimizer`` checks — so only this rule tells it from one the student
wrote (handout 05, What is graded); likewise an ``FSDP`` built on ``fully_shard`` (handout 05b, What is graded).
Each judge below runs construction and two training steps on 2 spawned ranks under
:func:`kit.grading.library_rules.watch`, and hands the objects the submission built (the optimizer; the FSDP wrapper and
every module under it, since ``fully_shard`` swaps a module's class for an ``FSDPModule`` subclass) to
``check_object``. :mod:`tests.support.rules` adds a reading of the source and, when a rule is broken, fails every
test marked ``builds("torch-zero")`` or ``builds("torch-fsdp")`` with the same message.

Allowed, and exercised here: ``ShardedOptimizer`` constructing and stepping the ``optimizer_cls`` it is given
(``torch.optim.AdamW``) on its shard; collectives of every kind. The tests' own references (torch's
``ZeroRedundancyOptimizer`` and ``fully_shard``) run on ranks of the kit's own (``reference_ranks``), never
under a watch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import kit.impl
from kit.checks import run_check
from kit.grading import library_rules
from tests.support import rules
from tests.support.fsdp import fsdp_train

pytestmark = pytest.mark.stage5

TIMEOUT = 120.0  # seconds for one spawn, start-up included (~10 s under load)


def _zero_workload() -> list[dict]:
    """ShardedOptimizer over a small model (two param groups, AdamW): construction and two steps, watched."""
    impl = kit.impl.load()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    groups = [{"params": [model[0].weight, model[2].weight]},
              {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0}]
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))  # the same batch on every rank
    with library_rules.watch(["torch-zero"]) as seen:
        optimizer = impl.zero.ShardedOptimizer(groups, torch.optim.AdamW, lr=1e-2)
        seen.check_object(optimizer)
        for _ in range(2):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
        optimizer.owner_of(model[0].weight)
        seen.check_object(optimizer)
    return seen.as_data()


def _fsdp_workload() -> list[dict]:
    """FSDP over the toy model (two units, a replicated gain): construction and two SGD steps, watched; then the
    wrapper and every module under it (fully_shard turns a module into an FSDPModule)."""
    impl = kit.impl.load()
    with library_rules.watch(["torch-fsdp"]) as seen:
        fsdp, _ = fsdp_train(impl, "toy", "sgd", steps=2)
        fsdp.gather_full_params()
        for module in (fsdp, *fsdp.modules()):
            seen.check_object(module)
    return seen.as_data()


def _violations(per_rank: list[Any]) -> list[dict]:
    """The ranks' records, each breach once (data from the ranks: anything malformed is dropped)."""
    out: list[dict] = []
    for record in per_rank:
        for v in record if isinstance(record, list) else []:
            if not (isinstance(v, dict) and v.get("how") in ("called", "derives", "dispatched")
                    and all(isinstance(v.get(k), str) for k in ("rule", "what", "where"))):
                continue
            if not any(o["how"] == v["how"] and o["what"] == v["what"] for o in out):
                out.append(v)
    return out


@rules.judge("torch-zero")
def _judge_zero(request: pytest.FixtureRequest) -> list[dict]:
    return _violations(run_check(_zero_workload, 2, timeout=TIMEOUT))


@rules.judge("torch-fsdp")
def _judge_fsdp(request: pytest.FixtureRequest) -> list[dict]:
    return _violations(run_check(_fsdp_workload, 2, timeout=TIMEOUT))


def _assert_kept(key: str, request: pytest.FixtureRequest, workload: str, section: str) -> None:
    rules.assert_kept(key, request, (
        f"the workload ({workload}) failed with "
        f"{{error}}. Make those tests pass first ({section})."))


@pytest.mark.points(1)
def test_builds_its_own_sharded_optimizer(request) -> None:
    """ShardedOptimizer neither wraps nor subclasses torch's ZeroRedundancyOptimizer."""
    _assert_kept("torch-zero", request, "ShardedOptimizer(groups, AdamW) on 2 ranks, two steps", "handout 05 §2–3")


@pytest.mark.points(1)
def test_builds_its_own_fsdp(request) -> None:
    """FSDP neither calls fully_shard / FullyShardedDataParallel nor hands back an FSDPModule."""
    _assert_kept("torch-fsdp", request, "FSDP(toy model) on 2 ranks, two SGD steps, gather_full_params",
                 "handout 05b §2–5")
