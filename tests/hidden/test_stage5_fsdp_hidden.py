"""Stage 5, part two — instructor-only FSDP checks: the same training as torch's own ``fully_shard``
(FSDP2) on gloo, and a checkpoint saved at 2 ranks resumed at 3.

One 3-rank spawn. The models, data, references and bounds are the public tests' (``test_stage5_fsdp``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_stage5_fsdp import (
    STEPS,
    batch,
    compare,
    default_units,
    fsdp_train,
    loss_of,
    make_model,
    make_optimizer,
    reference_run,
    rows_of,
)

import kit.impl
from kit.checks import run_checks, spawned_checks
from kit.testing import assert_equal

pytestmark = [pytest.mark.stage5, pytest.mark.hidden]

RUNS = [("transformer", "adamw", None), ("transformer", "adamw", torch.bfloat16)]
SAVE_AT = 2  # steps at 2 ranks before the checkpoint; then 2 more at 3 ranks
SAVERS = [0, 1]


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


def fully_shard_check() -> dict[str, Any]:
    impl = kit.impl.load()
    out = {}
    for kind, optimizer, dtype in RUNS:
        fsdp, _ = fsdp_train(impl, kind, optimizer, compute_dtype=dtype)
        reference = reference_run(kind, optimizer, dist.get_world_size(), compute_dtype=dtype)
        out[f"{kind}/{optimizer}/{str(dtype).removeprefix('torch.')}"] = {
            "fsdp": fsdp.gather_full_params(), "torch": torch_fully_shard(kind, optimizer, dtype),
            "bound": reference["order_bound"]}
    return out


def resume_check() -> dict[str, Any]:
    """Ranks 0 and 1 train SAVE_AT steps and save; all three load it (into a model initialised otherwise) and
    train to step 2·SAVE_AT."""
    impl = kit.impl.load()
    group = dist.new_group(SAVERS)
    saved: list[Any] = [None, None]  # the checkpoint, or the error that prevented it: rank 0's, for every rank
    if dist.get_rank() in SAVERS:
        try:
            fsdp, _ = fsdp_train(impl, "transformer", "plain_sgd", steps=SAVE_AT, group=group)
            saved[0] = fsdp.state_dict()
        except Exception as exc:  # noqa: BLE001 — re-raised on every rank below, so none waits alone
            saved[1] = exc
    dist.broadcast_object_list(saved, src=0)
    if saved[1] is not None:
        raise saved[1]
    state = saved[0]
    fsdp = impl.fsdp.FSDP(make_model("transformer", seed=99))
    fsdp.load_state_dict(state)
    loaded = fsdp.gather_full_params()
    opt = make_optimizer("plain_sgd", fsdp.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(SAVE_AT, 2 * SAVE_AT):
        x, y = batch("transformer", step)
        opt.zero_grad(set_to_none=True)
        loss_of("transformer", fsdp(x[rows_of(rank, world)]), y[rows_of(rank, world)]).backward()
        fsdp.finish_gradient_synchronization()
        opt.step()
    at_save = reference_run("transformer", "plain_sgd", 2, steps=SAVE_AT)
    worlds = [2] * SAVE_AT + [3] * SAVE_AT
    return {"state_keys": sorted(state), "plain_keys": sorted(make_model("transformer").state_dict()),
            "saved": {k: state[k] for k in at_save["same"]}, "at_save": at_save["same"], "loaded": loaded,
            "fsdp": fsdp.gather_full_params(), **reference_run("transformer", "plain_sgd", worlds, steps=2 * SAVE_AT)}


def hidden_checks() -> dict:
    return run_checks({"fully_shard": fully_shard_check, "resume": resume_check})


ranks = spawned_checks(hidden_checks, 3, timeout=300.0)


@pytest.mark.points(2)
def test_hidden_matches_torch_fully_shard(ranks) -> None:
    """Both runs reduce 3 fp32 numbers in some order: each is within 4× the order bound of the single
    process doing FSDP's arithmetic, so they are within 8× of each other."""
    for rank, result in enumerate(ranks.values("fully_shard")):
        for key, r in result.items():
            bound = {n: 2 * b for n, b in r["bound"].items()}
            compare(r["fsdp"], r["torch"], f"rank {rank} of 3, {key}, {STEPS} steps: FSDP vs torch's fully_shard with "
                    "the same units and MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=fp32)",
                    "handout 05b §9", bound=bound)


@pytest.mark.points(2)
def test_hidden_resume_at_three_ranks_from_two(ranks) -> None:
    for rank, r in enumerate(ranks.values("resume")):
        assert_equal(r["state_keys"], r["plain_keys"], name=f"rank {rank}: keys of FSDP.state_dict() (the plain "
                     "model's, no 'module.' prefix)", section="handout 05b §6")
        if rank == 0:
            compare(r["saved"], r["at_save"], f"the checkpoint after {SAVE_AT} steps at 2 ranks (full tensors)",
                    "handout 05b §6")
        compare(r["loaded"], r["at_save"], f"rank {rank} of 3: gather_full_params() right after load_state_dict",
                "handout 05b §6")
        compare(r["fsdp"], r["same"], f"rank {rank} of 3: {SAVE_AT} steps at 2 ranks, saved, loaded at 3, "
                f"{SAVE_AT} more steps, vs one process doing the same", "handout 05b §6", bound=r["order_bound"])
