"""Stage 5, part two — instructor-only FSDP checks: the same training as torch's own ``fully_shard``
(FSDP2) on gloo, and a checkpoint saved at 2 ranks resumed at 3.

One 3-rank spawn runs FSDP (``stage5_fsdp_hidden_worker``); torch's ``fully_shard`` runs on reference
ranks of its own (``kit.checks.reference_ranks``), and the single-process runs and bounds are computed
here (``tests/support/fsdp.py``, as for the public tests).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from stage5_fsdp_hidden_worker import RUNS, SAVE_AT, hidden_checks, run_key

from kit.checks import reference_ranks, spawned_checks
from kit.testing import assert_equal
from tests.support.fsdp import (
    STEPS,
    batch,
    compare,
    default_units,
    loss_of,
    make_model,
    make_optimizer,
    reference_of,
    rows_of,
)

pytestmark = [pytest.mark.stage5, pytest.mark.hidden]


def torch_fully_shard(kind: str, optimizer: str, compute_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """torch's FSDP2 on the same run: each unit of the default rule its own ``fully_shard`` with the mixed-
    precision policy, and the root ``fully_shard`` for the rest in fp32 (this kit keeps them replicated:
    the same arithmetic)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_model(kind)
    units, _ = default_units(model)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for unit in units:
        fully_shard(model.get_submodule(unit), mp_policy=policy)
    fully_shard(model)
    opt = make_optimizer(optimizer, model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        x, y = batch(kind, step)
        opt.zero_grad(set_to_none=True)
        loss_of(kind, model(x[rows_of(rank, world)]), y[rows_of(rank, world)]).backward()
        opt.step()
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def torch_fully_shard_runs(runs: list[tuple[str, str, torch.dtype | None]]) -> dict[str, dict[str, torch.Tensor]]:
    """On the reference ranks (they cannot load the implementation): :func:`torch_fully_shard` of each run."""
    return {run_key(*run): torch_fully_shard(*run) for run in runs}


ranks = spawned_checks(hidden_checks, 3, timeout=300.0)


@pytest.mark.builds("torch-fsdp")
@pytest.mark.points(2)
def test_hidden_matches_torch_fully_shard(ranks) -> None:
    """Both runs reduce 3 fp32 numbers in some order: each is within 4× the order bound of the single
    process doing FSDP's arithmetic, so they are within 8× of each other."""
    results = ranks.values("fully_shard")
    expected = reference_ranks(torch_fully_shard_runs, 3, args=(RUNS,))
    for rank, result in enumerate(results):
        for kind, optimizer, dtype in RUNS:
            key = run_key(kind, optimizer, dtype)
            bound = {n: 2 * b for n, b in reference_of(kind, optimizer, 3, compute_dtype=dtype)["order_bound"].items()}
            compare(result[key], expected[rank][key], f"rank {rank} of 3, {key}, {STEPS} steps: FSDP vs torch's "
                    "fully_shard with the same units and MixedPrecisionPolicy(param_dtype=compute_dtype, "
                    "reduce_dtype=fp32)", "handout 05b §9", bound=bound)


@pytest.mark.builds("torch-fsdp")
@pytest.mark.points(2)
def test_hidden_resume_at_three_ranks_from_two(ranks) -> None:
    results: list[dict[str, Any]] = ranks.values("resume")
    plain_keys = sorted(make_model("transformer").state_dict())
    at_save = reference_of("transformer", "plain_sgd", 2, steps=SAVE_AT)["same"]
    resumed = reference_of("transformer", "plain_sgd", (2,) * SAVE_AT + (3,) * SAVE_AT, steps=2 * SAVE_AT)
    for rank, r in enumerate(results):
        assert_equal(r["state_keys"], plain_keys, name=f"rank {rank}: keys of FSDP.state_dict() (the plain "
                     "model's, no 'module.' prefix)", section="handout 05b §6")
        # Up to the save, 2 ranks average exactly and a checkpoint copies bits: bit for bit. After it, 3 ranks may
        # sum in another order: the order bound, derived in tests/support/fsdp.py (DriftBound).
        if rank == 0:
            compare(r["saved"], at_save, f"the checkpoint after {SAVE_AT} steps at 2 ranks (full tensors)",
                    "handout 05b §6")
        compare(r["loaded"], at_save, f"rank {rank} of 3: gather_full_params() right after load_state_dict",
                "handout 05b §6")
        compare(r["fsdp"], resumed["same"], f"rank {rank} of 3: {SAVE_AT} steps at 2 ranks, saved, loaded at 3, "
                f"{SAVE_AT} more steps, vs one process doing the same", "handout 05b §6",
                bound=resumed["order_bound"])
