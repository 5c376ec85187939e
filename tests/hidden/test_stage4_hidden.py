"""Stage 4 — instructor-only checks: DDP over a subgroup, and agreement with torch's own DDP.

The ranks that run the implementation live in ``stage4_hidden_worker.py`` and return their parameters after
every step. The expected values are computed here: a single process training alone, and torch's
``DistributedDataParallel`` on reference ranks of its own (``kit.checks.reference_ranks``), which never load
the implementation.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from stage4_hidden_worker import (
    ACCUMULATION_KINDS,
    ACCUMULATION_STEPS,
    BUCKET_MB,
    KINDS,
    SUBGROUP_STEPS,
    WORLD,
    accumulation_rank,
    batch,
    build,
    loss,
    params,
    subgroup_rank,
)
from torch.nn.parallel import DistributedDataParallel

from kit.checks import SpawnedChecks, reference_ranks
from kit.testing import assert_close

pytestmark = [pytest.mark.stage4, pytest.mark.hidden]


def _trained_alone(rank: int) -> list[list[tuple[str, torch.Tensor]]]:
    """What ``rank`` computes training alone (SGD on its own shard): its parameters after each step."""
    reference = build(10 + rank)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    out = []
    for step in range(SUBGROUP_STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        loss(reference, x, y).backward()
        opt.step()
        out.append([(name, p.detach().clone()) for name, p in reference.named_parameters()])
    return out


def _torch_ddp_rank() -> list[dict]:
    """On a reference rank: torch's DistributedDataParallel trained as the worker half trains ours (AdamW, two
    accumulated micro-batches, the first inside no_sync); the parameters after each step."""
    rank = dist.get_rank()
    model = build(rank)
    theirs = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for step in range(ACCUMULATION_STEPS):
        x, y = batch(step, rank)
        opt.zero_grad(set_to_none=True)
        with theirs.no_sync():
            (loss(theirs, x[:2], y[:2]) / 2).backward()
        (loss(theirs, x[2:], y[2:]) / 2).backward()
        opt.step()
        out.append(params(model))
    return out


@pytest.mark.builds("torch-ddp")
@pytest.mark.points(2)
def test_process_group_is_respected() -> None:
    ranks = SpawnedChecks(subgroup_rank, WORLD, timeout=120)
    expected = [_trained_alone(rank) for rank in range(WORLD)]
    for kind in KINDS:
        for rank, steps in enumerate(ranks.values(kind)):
            for step in range(SUBGROUP_STEPS):
                # Over a one-rank group the all-reduce sums one gradient and divides by 1: exact, as training alone
                # (rtol 1e-5 / atol 1e-6 is slack); averaging with the default group instead moves each SGD step by
                # lr × (own − mean gradient) ≈ 1e-3 or more.
                for name, q in expected[rank][step]:
                    assert_close(steps[step].get(name), q,
                                 name=f"rank {rank}, {kind} over a one-rank process_group, step {step + 1}: {name} "
                                 "(vs this rank training alone)", section="handout 04 §1", rtol=1e-5, atol=1e-6)


@pytest.mark.builds("torch-ddp")
@pytest.mark.points(2)
def test_matches_torch_ddp_with_accumulation() -> None:
    ranks = SpawnedChecks(accumulation_rank, WORLD, timeout=120)
    # torch DDP's run does not depend on which of our classes it is compared with: trained once, compared with each.
    theirs = reference_ranks(_torch_ddp_rank, WORLD, timeout=120)
    for kind in ACCUMULATION_KINDS:
        ours = ranks.values(kind)
        for step in range(ACCUMULATION_STEPS):
            for rank in range(WORLD):
                # torch DDP divides by the world size before its sum, ours may after. With WORLD = 2 both are exact
                # in binary floating point (÷2 only lowers the exponent; g₀ + g₁ = g₁ + g₀), so the gradients AdamW
                # sees are the same bits and so are the parameters; a division by 3 or a reordered sum would give
                # δ ≈ u·(|g₀| + |g₁|), which AdamW could carry to ~lr where |g| ≲ δ (test_stage6_mesh_4d's
                # _adamw_step_allowance). rtol 1e-5 / atol 1e-6 are slack; a missing ÷2 barely shows through AdamW
                # (m̂/√v̂ ignores a uniform scale), but a lost or doubled micro-batch moves elements by ~lr = 1e-2.
                for name, q in theirs[rank][step].items():
                    assert_close(ours[rank][step].get(name), q,
                                 name=f"rank {rank}, {kind} vs torch DDP, step {step + 1}: {name}",
                                 section="handout 04 §5", rtol=1e-5, atol=1e-6)
