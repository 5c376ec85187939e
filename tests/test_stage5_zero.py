"""Stage 5 — ZeRO stage 1: optimizer-state sharding and memory accounting (handout/05-zero.md).

Independent references, all computed by the judge (this process), never next to the implementation:
``torch.optim.AdamW`` on a single process (no communication at all, trained here), torch's own
``ZeroRedundancyOptimizer`` and DDP's gradient average in ranks of the kit's own (``reference_ranks``),
and the ZeRO paper's formulas and Table 1 worked out here by hand.

The implementation runs only in workers (``kit.checks``): the ranks train with ``ShardedOptimizer`` and
return what they computed — parameters, which parameters hold state, the consolidated state dict, what a
bad call raised — and the tests below compare that data with the references. Spawning ranks costs
seconds, so each spawn runs several checks ("sections") and the tests read their parts of it. A section
that raises (a ``NotImplementedError`` of a stub) fails only the tests that read it, with that error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import kit.impl
from kit.checks import Failure, outcome_of, reference_ranks, run_checks, spawned_checks
from kit.model import ModelConfig, TransformerLM, cross_entropy
from kit.testing import assert_close, assert_equal, assert_raised

pytestmark = pytest.mark.stage5

TINY = ModelConfig(vocab_size=64, context_length=16, d_model=32, d_ff=64, num_layers=2, num_heads=2)
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
STEPS = 10
SAVE_AT = 5  # the 2-rank run checkpoints here; the 3-rank run resumes from it
TIMEOUT = 120.0  # seconds for one spawn, start-up included: ~25 s under load, so a hung collective costs 2 min, not 4
# Every rank computes the whole batch's gradient and each owner steps torch's AdamW on it: the reference's
# arithmetic, bit for bit on one machine. Slack for an update computed in another order (foreach or not): ≤ 1 ulp
# (2u·|p|, u = 2⁻²⁴) per step, ≈ 1.2e-6·|p| after 10 steps, below rtol 1e-5; atol 1e-6 for weights near 0.
TOL = {"rtol": 1e-5, "atol": 1e-6}
SUBGROUP = [1, 2]  # of the 3 ranks: group rank 0 is global rank 1, so owner and src/dst ranks must be translated


# ----------------------------------------------------------------------------------------------------
# Models, data and training loops: the ranks (by name) and the judge (for the references) share them
# ----------------------------------------------------------------------------------------------------


def make_model(kind: str, *, frozen: bool = True) -> nn.Module:
    """The same initial weights on every rank and in every reference run."""
    torch.manual_seed(1234)
    if kind == "toy":
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
        if frozen:
            model[2].bias.requires_grad_(False)  # in the optimizer, but never gets a gradient
    else:
        model = TransformerLM(TINY)
        if frozen:
            model.final_norm.weight.requires_grad_(False)
    return model


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups with different options: matrices decay, vectors (biases, norm gains) get another lr."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": matrices}, {"params": vectors, "lr": 3e-2, "weight_decay": 0.0}]


def batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number ``step``: 4 rows, the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    if kind == "toy":
        return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    tokens = torch.randint(0, TINY.vocab_size, (4, TINY.context_length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model: nn.Module, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return nn.functional.mse_loss(out, y) if kind == "toy" else cross_entropy(out, y)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, kind: str, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, kind, *batch(kind, step)).backward()
        optimizer.step()


def reference_run(kind: str, steps: int) -> tuple[nn.Module, torch.optim.AdamW]:
    """Unsharded AdamW in this process alone: no communication, the ground truth (run by the judge)."""
    model = make_model(kind)
    optimizer = torch.optim.AdamW(param_groups(model), **ADAMW)
    train(model, optimizer, kind, range(steps))
    return model, optimizer


def add_group_run(make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]):
    """Start with the matrices only; after 3 steps add the vectors as a second group with its own lr."""
    model = make_model("toy")
    matrices, vectors = param_groups(model)
    optimizer = make_optimizer([matrices])
    train(model, optimizer, "toy", range(3))
    optimizer.add_param_group(vectors)
    train(model, optimizer, "toy", range(3, STEPS))
    return model, optimizer


def half_batch(x: torch.Tensor) -> slice:
    """This rank's rows of a batch: DDP gives each of the ranks its share."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return slice(rank * len(x) // world, (rank + 1) * len(x) // world)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def param_names_in_order(model: nn.Module) -> list[str]:
    """Parameter names in the order of ``param_groups(model)``: a state dict's global indices."""
    names = {p: n for n, p in model.named_parameters()}
    return [names[p] for g in param_groups(model) for p in g["params"]]


def _clone_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


# ----------------------------------------------------------------------------------------------------
# What each section computes, inside the ranks (the implementation's side): data back, no verdict
# ----------------------------------------------------------------------------------------------------


def equivalence_section(kind: str) -> dict[str, Any]:
    """10 steps with two groups and a frozen parameter: what ShardedOptimizer computed."""
    impl = kit.impl.load()
    model = make_model(kind)
    optimizer = impl.zero.ShardedOptimizer(param_groups(model), torch.optim.AdamW, **ADAMW)
    train(model, optimizer, kind, range(STEPS))
    names = {p: n for n, p in model.named_parameters()}
    result = {
        "params": snapshot(model),
        "state_names": sorted(names[p] for p in optimizer.state),
        "groups": [(len(g["params"]), g["lr"], g["weight_decay"]) for g in optimizer.param_groups],
        "state_dict": optimizer.state_dict(),  # collective: every rank calls it
    }
    optimizer.zero_grad()
    result["grads_cleared"] = all(p.grad is None for p in model.parameters())
    return result


def balance_section() -> dict[str, Any]:
    """One group, everything trainable: which parameters does each rank keep state for?"""
    impl = kit.impl.load()
    model = make_model("transformer", frozen=False)
    optimizer = impl.zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    train(model, optimizer, "transformer", range(1))
    names = {p: n for n, p in model.named_parameters()}
    return {"state_names": sorted(names[p] for p in optimizer.state)}


def add_group_section() -> dict[str, Any]:
    """The second group added after 3 steps; then a parameter that is already in the optimizer, again."""
    impl = kit.impl.load()
    model, optimizer = add_group_run(lambda groups: impl.zero.ShardedOptimizer(groups, torch.optim.AdamW, **ADAMW))
    repeat = outcome_of(optimizer.add_param_group, {"params": [next(model.parameters())]})  # must be refused
    return {"params": snapshot(model), "groups": [len(g["params"]) for g in optimizer.param_groups],
            "repeat": repeat}


def checkpoint_section() -> dict[str, Any]:
    """Train SAVE_AT steps and checkpoint: parameters (rank 0) and what state_dict() returned on each rank."""
    impl = kit.impl.load()
    model = make_model("transformer")
    optimizer = impl.zero.ShardedOptimizer(param_groups(model), torch.optim.AdamW, **ADAMW)
    train(model, optimizer, "transformer", range(SAVE_AT))
    state_dict = optimizer.state_dict()
    return {"model": model.state_dict() if dist.get_rank() == 0 else None, "optimizer": state_dict}


def resume_section(checkpoint: dict[str, Any] | Failure) -> dict[str, Any]:
    """Load the 2-rank checkpoint at this world size and train the remaining steps."""
    if isinstance(checkpoint, Failure):
        checkpoint.reraise("no checkpoint to resume from: the 2-rank run saves it (see "
                           "test_state_dict_consolidated_on_rank0)")
    impl = kit.impl.load()
    model = make_model("transformer")
    model.load_state_dict(checkpoint["model"])
    optimizer = impl.zero.ShardedOptimizer(param_groups(model), torch.optim.AdamW, **ADAMW)
    optimizer.load_state_dict(checkpoint["optimizer"])
    names = {p: n for n, p in model.named_parameters()}
    loaded_names = sorted(names[p] for p in optimizer.state)
    train(model, optimizer, "transformer", range(SAVE_AT, STEPS))
    return {"params": snapshot(model), "loaded_state_names": loaded_names}


def bad_inputs_section() -> dict[str, Any]:
    """What a constructed optimizer does with what it must refuse (handout 05 §2, §4), call by call.

    Every call is recorded, not judged: the judge checks the outcomes in this order.
    """
    impl = kit.impl.load()
    model = make_model("toy")
    first, second, third = model[0], model[2], model[4]
    optimizer = impl.zero.ShardedOptimizer([first.weight, first.bias], torch.optim.AdamW, **ADAMW)
    out = {"repeat": outcome_of(optimizer.add_param_group, {"params": [first.weight]}),
           "twice": outcome_of(optimizer.add_param_group, {"params": [second.weight, second.weight]}),
           "valid": outcome_of(optimizer.add_param_group, {"params": [third.weight, third.bias], "lr": 3e-2})}
    out["groups"] = [len(g["params"]) for g in optimizer.param_groups]
    good = {"state": {}, "param_groups": [{**ADAMW, "params": [0, 1]}, {**ADAMW, "lr": 3e-2, "params": [2, 3]}]}
    out["one_group"] = outcome_of(optimizer.load_state_dict, {"state": {}, "param_groups": good["param_groups"][:1]})
    out["short_group"] = outcome_of(optimizer.load_state_dict, {
        "state": {}, "param_groups": [good["param_groups"][0], {**good["param_groups"][1], "params": [2]}]})
    return out


def reload_section(saved: dict[str, Any], group: Any = None, members: list[int] | None = None
                   ) -> dict[str, Any] | None:
    """Step twice (so the state is full), then load another run's checkpoint and train on.

    ``saved`` is the judge's single-process AdamW checkpoint after SAVE_AT steps; the judge checks that
    after the load every rank holds exactly the loaded state of its own parameters, and that training on
    equals AdamW for STEPS steps.
    """
    if members is not None and dist.get_rank() not in members:
        return None
    impl = kit.impl.load()
    model = make_model("transformer")
    optimizer = impl.zero.ShardedOptimizer(param_groups(model), torch.optim.AdamW, process_group=group, **ADAMW)
    train(model, optimizer, "transformer", range(2))  # another trajectory: its state must not survive the load
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    names = {p: n for n, p in model.named_parameters()}
    # Copies now: the loaded optimizer may share tensors with `saved` (AdamW keeps the `step` tensor itself).
    loaded = {names[p]: _clone_state(state) for p, state in optimizer.state.items()}
    train(model, optimizer, "transformer", range(SAVE_AT, STEPS))
    return {"loaded": loaded, "params": snapshot(model)}


def subgroup_section(group: Any) -> dict[str, Any] | None:
    """Ranks [1, 2] of 3: the Transformer with two groups, as in the equivalence check."""
    if dist.get_rank() not in SUBGROUP:
        return None
    impl = kit.impl.load()
    model = make_model("transformer")
    optimizer = impl.zero.ShardedOptimizer(param_groups(model), torch.optim.AdamW, process_group=group, **ADAMW)
    train(model, optimizer, "transformer", range(STEPS))
    names = {p: n for n, p in model.named_parameters()}
    return {"params": snapshot(model), "state_names": sorted(names[p] for p in optimizer.state),
            "owners": {n: optimizer.owner_of(p) for n, p in model.named_parameters()},
            "state_dict": optimizer.state_dict()}


def two_rank_checks(saved: dict[str, Any]) -> dict[str, tuple[bool, Any]]:
    return run_checks({
        "bad_inputs": bad_inputs_section,
        "toy": lambda: equivalence_section("toy"),
        "transformer": lambda: equivalence_section("transformer"),
        "balance": balance_section,
        "add_group": add_group_section,
        "checkpoint": checkpoint_section,
        "reload": lambda: reload_section(saved),
    })


def three_rank_checks(checkpoint: dict[str, Any] | Failure, saved: dict[str, Any]) -> dict[str, tuple[bool, Any]]:
    sub = dist.new_group(SUBGROUP)  # every rank calls new_group, members or not
    return run_checks({
        "transformer": lambda: equivalence_section("transformer"),
        "balance": balance_section,
        "resume": lambda: resume_section(checkpoint),
        "subgroup": lambda: subgroup_section(sub),
        "subgroup_reload": lambda: reload_section(saved, sub, SUBGROUP),
    })


def ddp_checks() -> dict[str, tuple[bool, Any]]:
    """Stage 4's DDP averages the gradients of each rank's half of the batch; ZeRO shards the state."""

    def run(cls_name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        impl = kit.impl.load()
        model = make_model("transformer")
        ddp = getattr(impl.ddp, cls_name)(model, **kwargs)
        optimizer = impl.zero.ShardedOptimizer(param_groups(model), torch.optim.AdamW, **ADAMW)
        for step in range(STEPS):
            x, y = batch("transformer", step)
            rows = half_batch(x)
            optimizer.zero_grad(set_to_none=True)
            ddp.on_train_batch_start()
            loss_fn(ddp, "transformer", x[rows], y[rows]).backward()
            ddp.finish_gradient_synchronization()
            optimizer.step()
        names = {p: n for n, p in model.named_parameters()}
        return {"params": snapshot(model), "state_names": sorted(names[p] for p in optimizer.state)}

    return run_checks({
        "bucketed": lambda: run("DDPBucketed", {"bucket_size_mb": 0.01}),  # several buckets
        "individual": lambda: run("DDPIndividualParameters", {}),
    })


# ----------------------------------------------------------------------------------------------------
# What runs in the single-process worker: calls that need no process group
# ----------------------------------------------------------------------------------------------------


def constructor_outcomes() -> dict[str, Any]:
    """What the constructor does with bad input: the given checks, before any communication."""
    ShardedOptimizer = kit.impl.load().zero.ShardedOptimizer
    model = make_model("toy")
    weight = model[0].weight
    adamw = torch.optim.AdamW
    return {
        "not_optimizer": outcome_of(ShardedOptimizer, model.parameters(), nn.Linear, lr=1e-3),
        "instance": outcome_of(ShardedOptimizer, model.parameters(), adamw(model.parameters()), lr=1e-3),
        "empty": outcome_of(ShardedOptimizer, [], adamw, lr=1e-3),
        "repeat": outcome_of(ShardedOptimizer, [weight, model[0].bias, weight], adamw, lr=1e-3),
        "two_groups": outcome_of(ShardedOptimizer, [{"params": [weight]}, {"params": [weight], "lr": 1.0}], adamw,
                                 lr=1e-3),
    }


def partition_calls(calls: list[tuple[tuple, dict]], bad: list[dict[str, Any]]) -> dict[str, Any]:
    """``partition_by_size`` on each call, and what it does with each bad one."""
    partition = kit.impl.load().zero.partition_by_size
    return {"results": [partition(*args, **kwargs) for args, kwargs in calls],
            "bad": [outcome_of(partition, **kwargs) for kwargs in bad]}


ACCOUNTING_FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "total_bytes", "comm_bytes_per_step")


def accounting_calls(calls: list[tuple[tuple, dict]], bad: list[tuple[tuple, dict]] = ()) -> dict[str, Any]:
    """``zero_memory_accounting`` on each call (its fields), and what it does with each bad one."""
    account = kit.impl.load().zero.zero_memory_accounting
    results = []
    for args, kwargs in calls:
        got = account(*args, **kwargs)
        results.append({field: getattr(got, field) for field in ACCOUNTING_FIELDS})
    return {"results": results, "bad": [outcome_of(account, *args, **kwargs) for args, kwargs in bad]}


# ----------------------------------------------------------------------------------------------------
# The references, in the kit's own ranks (they cannot load the implementation)
# ----------------------------------------------------------------------------------------------------


def torch_zero_ranks(kinds: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """torch's ZeroRedundancyOptimizer, trained as ShardedOptimizer is: its parameters after STEPS steps."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    out = {}
    for kind in kinds:
        model = make_model(kind)
        zero = ZeroRedundancyOptimizer(param_groups(model), optimizer_class=torch.optim.AdamW, **ADAMW)
        train(model, zero, kind, range(STEPS))
        out[kind] = snapshot(model)
    return out


def ddp_average_ranks() -> dict[str, torch.Tensor]:
    """DDP's arithmetic with the unsharded AdamW: each rank's half-batch gradients all-reduced (summed) and
    divided by the world size, as Stage 4's DDP does it, then AdamW on every rank."""
    model = make_model("transformer")
    optimizer = torch.optim.AdamW(param_groups(model), **ADAMW)
    for step in range(STEPS):
        x, y = batch("transformer", step)
        rows = half_batch(x)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, "transformer", x[rows], y[rows]).backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad.div_(dist.get_world_size())
        optimizer.step()
    return snapshot(model)


# ----------------------------------------------------------------------------------------------------
# The judge's references, each computed once
# ----------------------------------------------------------------------------------------------------


@functools.cache
def single_process(kind: str, steps: int) -> dict[str, Any]:
    """Single-process AdamW after ``steps`` steps: parameters, model and optimizer state dicts."""
    model, optimizer = reference_run(kind, steps)
    return {"params": snapshot(model), "model": model.state_dict(), "optimizer": optimizer.state_dict()}


@functools.cache
def torch_zero(world_size: int) -> list[dict[str, dict[str, torch.Tensor]]]:
    """torch's ZeroRedundancyOptimizer at ``world_size`` ranks, by rank: {kind: parameters}."""
    kinds = ("toy", "transformer") if world_size == 2 else ("transformer",)
    return reference_ranks(torch_zero_ranks, world_size, args=(kinds,), timeout=TIMEOUT)


@functools.cache
def ddp_average() -> list[dict[str, torch.Tensor]]:
    """DDP's gradient average + unsharded AdamW at 2 ranks, by rank: the parameters after STEPS steps."""
    return reference_ranks(ddp_average_ranks, 2, timeout=TIMEOUT)


@functools.cache
def whole_batch_drift() -> dict[str, torch.Tensor]:
    """Per element, how far DDP's AdamW (2 half-batch gradients summed, then / 2) may end from AdamW on the whole
    batch after STEPS steps, four times :class:`tests.support.fsdp.DriftBound` (Stage 5b's bound, with this test's
    two param groups).

    The two gradients differ by rounding only: the whole batch sums each weight gradient's K = B·T token rows in
    another order and the halves' average rounds once more, ≲ (K + 2 + 4)·u·mean|g_rank| per element (u = 2⁻²⁴;
    ``support.fsdp.whole_batch_rounding``, the error model of Stage 5b's ``reference_run``). AdamW divides each
    element by its own running scale √v̂, so where a gradient nearly cancels (|g| ≲ that error) one step may move by
    up to lr either way, however small the rounding was: a flat tolerance is either too tight there on some CPU's
    summation order, or too loose everywhere else. DriftBound carries each step's error through m, v and the update;
    ×4 covers what the first-order analysis leaves out (compare() in tests/support/fsdp.py uses the same factor)."""
    from tests.support.fsdp import DriftBound, whole_batch_rounding

    model = make_model("transformer")
    optimizer = torch.optim.AdamW(param_groups(model), **ADAMW)
    names = {p: n for n, p in model.named_parameters()}
    drift = {names[p]: DriftBound("adamw", p.shape, {k: group[k] for k in ("lr", "betas", "eps")})
             for group in optimizer.param_groups for p in group["params"]}
    for step in range(STEPS):
        x, y = batch("transformer", step)
        halves = []
        for rows in (slice(0, len(x) // 2), slice(len(x) // 2, len(x))):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, "transformer", x[rows], y[rows]).backward()
            halves.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        errors = {}
        for n, p in model.named_parameters():
            if n not in halves[0]:
                continue  # frozen: no gradient, never moves
            p.grad = (halves[0][n] + halves[1][n]) / 2
            abs_mean = (halves[0][n].abs() + halves[1][n].abs()) / 2
            errors[n] = (p.grad.clone(), whole_batch_rounding(abs_mean, x.numel(), world=2))
        optimizer.step()
        for n, p in model.named_parameters():
            if n in errors:
                drift[n].add(errors[n][0], errors[n][1], p)
    return {n: 4 * b.bound.float() for n, b in drift.items()}


def adamw_checkpoint() -> dict[str, Any]:
    """What the reload sections load: single-process AdamW's model and optimizer after SAVE_AT steps."""
    saved = single_process("transformer", SAVE_AT)
    return {"model": saved["model"], "optimizer": saved["optimizer"]}


def trainable(kind: str) -> list[str]:
    return sorted(n for n, p in make_model(kind).named_parameters() if p.requires_grad)


# ----------------------------------------------------------------------------------------------------
# The spawns: module-scoped fixtures, each run once, in the setup of the first test that uses it
# ----------------------------------------------------------------------------------------------------

two_ranks = spawned_checks(two_rank_checks, 2, timeout=TIMEOUT, args=lambda: (adamw_checkpoint(),))
# The 3-rank run resumes from the 2-rank run's checkpoint (rank 0's), or explains why it could not.
three_ranks = spawned_checks(three_rank_checks, 3, timeout=TIMEOUT,
                             args=lambda two_ranks: (two_ranks.value_or_failure("checkpoint", rank=0),
                                                     adamw_checkpoint()))
ddp_ranks = spawned_checks(ddp_checks, 2, timeout=TIMEOUT)


def assert_params_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str,
                        section_ref: str, allowance: dict[str, torch.Tensor] | None = None, **tol: float) -> None:
    """Each parameter within ``tol`` (default :data:`TOL`), plus ``allowance[name]`` element by element if given
    (:func:`whole_batch_drift`: how far AdamW may carry a gradient's rounding)."""
    assert_equal(sorted(actual), sorted(expected), name=f"{what}: parameter names", section=section_ref)
    for name in expected:
        extra = {} if allowance is None else {"allowance": allowance[name],
                                              "allowance_why": "AdamW's reach from rounded gradients"}
        assert_close(actual[name], expected[name], name=f"{what}: {name}", section=section_ref, **(tol or TOL),
                     **extra)


# ----------------------------------------------------------------------------------------------------
# Ownership: greedy partition (no ranks needed)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.points(2)
def test_partition_by_size(worker) -> None:
    # Balance property on random sizes: 40 items per world size, drawn here and handed to the worker.
    g = torch.Generator().manual_seed(0)
    random_sizes = {world_size: [int(n) for n in torch.randint(1, 1000, (40,), generator=g)]
                    for world_size in (2, 3, 5)}
    calls = [(([3, 5, 1, 4, 3], 2), {}), (([2, 2, 2, 2], 3), {}), (([6, 1], 2), {"loads": [0, 10]})]
    calls += [((numels, world_size), {}) for world_size, numels in random_sizes.items()]
    bads = [{"numels": [1], "world_size": 0}, {"numels": [-1], "world_size": 2},
            {"numels": [1], "world_size": 2, "loads": [0]}]
    got = worker.call(partition_calls, calls, bads)
    results = iter(got["results"])
    # Worked by hand, largest first, each to the least-loaded rank, ties to the lower rank:
    # 5→r0 (0,0), 4→r1 (5,0), 3→r1 (5,4), 3→r0 (5,7), 1→r1 (8,7) → loads (8, 8).
    owners, loads = next(results)
    assert_equal(owners, [1, 0, 1, 1, 0], name="owners of sizes [3, 5, 1, 4, 3] on 2 ranks", section="handout 05 §2")
    assert_equal(loads, [8, 8], name="loads", section="handout 05 §2")
    # Equal sizes keep their order and fill ranks 0, 1, 2, then again from the least loaded.
    owners, loads = next(results)
    assert_equal(owners, [0, 1, 2, 0], name="owners of four equal items on 3 ranks", section="handout 05 §2")
    # Continuing from earlier loads (a new param group): the light rank gets the big item.
    owners, loads = next(results)
    assert_equal((owners, loads), ([0, 0], [7, 10]), name="owners/loads continuing from loads [0, 10]",
                 section="handout 05 §2")
    # Every item placed once, loads differ by at most the largest item.
    for world_size, numels in random_sizes.items():
        owners, loads = next(results)
        assert len(owners) == len(numels) and all(0 <= r < world_size for r in owners), "one valid owner per item"
        recount = [sum(n for n, r in zip(numels, owners) if r == rank) for rank in range(world_size)]
        assert_equal(loads, recount, name=f"loads at world size {world_size}", section="handout 05 §2")
        assert max(loads) - min(loads) <= max(numels), (
            f"loads {loads} differ by more than the largest item {max(numels)}: not balanced. See handout 05 §2."
        )
    for bad, outcome in zip(bads, got["bad"], strict=True):
        assert_raised(outcome, ValueError, what=f"partition_by_size({', '.join(f'{k}={v}' for k, v in bad.items())})",
                      section="handout 05 §2")


# ----------------------------------------------------------------------------------------------------
# Memory accounting: the ZeRO paper (Rajbhandari et al., arXiv 1910.02054)
# ----------------------------------------------------------------------------------------------------


def _mixed_precision_adam(psi: float, n: int, stage: int) -> tuple[tuple, dict]:
    return (int(psi), n, stage), {"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes_per_param": 12}


@pytest.mark.points(2)
def test_memory_accounting_matches_paper(worker) -> None:
    """The paper's Table 1: per-device GB (1e9 bytes) of model states, mixed-precision Adam (K = 12).

    Figure 1 quotes the N = 64 row of the 7.5 B model: 120 GB, 31.4 GB, 16.6 GB and 1.9 GB.
    """
    # (Ψ, N): (stage 1 = P_os, stage 2 = P_os+g, stage 3 = P_os+g+p), rounded to 3 digits as in the paper.
    table = {
        (7.5e9, 1): (120, 120, 120),
        (7.5e9, 4): (52.5, 41.3, 30),
        (7.5e9, 16): (35.6, 21.6, 7.5),
        (7.5e9, 64): (31.4, 16.6, 1.88),
        (7.5e9, 1024): (30.1, 15.1, 0.12),
        (128e9, 1024): (513, 258, 2),
        (1e12, 1024): (4011, 2013, 15.6),
    }
    calls = [_mixed_precision_adam(psi, n, stage) for psi, n in table for stage in range(4)]
    results = iter(worker.call(accounting_calls, calls)["results"])
    for (psi, n), per_stage in table.items():
        baseline = next(results)
        # Both sides become fp32 tensors (one rounding each, u = 6e-8): rtol 1e-6; 12Ψ or 18Ψ is ≥ 10 % off.
        assert_close(torch.tensor(baseline["total_bytes"] / 1e9), torch.tensor(16 * psi / 1e9),
                     name=f"stage 0 GB for Ψ={psi:g}, N={n} (16Ψ)", section="handout 05 §5", rtol=1e-6, atol=0)
        for stage, printed in zip((1, 2, 3), per_stage):
            got = next(results)
            # The table rounds to 3 significant digits: allow half a unit in the last printed digit.
            assert_close(torch.tensor(got["total_bytes"] / 1e9), torch.tensor(float(printed)),
                         name=f"ZeRO-{stage} GB per device for Ψ={psi:g}, N={n} (paper Table 1)",
                         section="handout 05 §5", rtol=6e-3, atol=0.006)


@pytest.mark.points(2)
def test_memory_accounting_formulas_and_communication(worker) -> None:
    """Each component and the communication volume, from the paper's formulas worked out independently."""
    psi, n = 1_000_003, 8  # not divisible by N: a shard is Ψ/N up to one element (padding)
    p_b, g_b, k = 4, 4, 8  # fp32 training with Adam: no master copy, momentum + variance
    full = {"param_bytes": psi * p_b, "grad_bytes": psi * g_b, "optimizer_bytes": psi * k}
    shard = {"param_bytes": psi / n * p_b, "grad_bytes": psi / n * g_b, "optimizer_bytes": psi / n * k}
    expected = {
        0: full,
        1: {**full, "optimizer_bytes": shard["optimizer_bytes"]},
        2: {**full, "grad_bytes": shard["grad_bytes"], "optimizer_bytes": shard["optimizer_bytes"]},
        3: shard,
    }
    # Per step, per rank, ring collectives: all-reduce = reduce-scatter + all-gather, each moving (N-1)/N of
    # the data. DP and ZeRO-1/2 move 2Ψ in all, ZeRO-3 3Ψ (parameters gathered in forward and backward).
    moved = psi * (n - 1) / n
    comm = {0: 2 * moved * g_b, 1: moved * (g_b + p_b), 2: moved * (g_b + p_b), 3: moved * (g_b + 2 * p_b)}
    calls = [((psi, n, stage), {"param_bytes": p_b, "grad_bytes": g_b, "optimizer_bytes_per_param": k})
             for stage in range(4)]
    # One rank: nothing to shard, nothing to communicate.
    calls.append(((psi, 1, 3), {"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes_per_param": 12}))
    bads = [{"stage": 4}, {"world_size": 0}, {"num_params": 0}, {"param_bytes": -2}]
    bad_calls = []
    for bad in bads:
        args = {"num_params": psi, "world_size": n, "stage": 1, "param_bytes": 2, "grad_bytes": 2,
                "optimizer_bytes_per_param": 12, **bad}
        bad_calls.append(((args.pop("num_params"), args.pop("world_size"), args.pop("stage")), args))
    answer = worker.call(accounting_calls, calls, bad_calls)
    results = answer["results"]
    for stage in range(4):
        got = results[stage]
        # One padding element per shard is allowed: that is at most (bytes per element) × N.
        for field, value in expected[stage].items():
            assert_close(torch.tensor(float(got[field])), torch.tensor(float(value)),
                         name=f"ZeRO-{stage} {field}", section="handout 05 §5", rtol=0, atol=k * n)
        # The total adds the three fields, each off by at most k·N. Padding Ψ up to a multiple of N adds < N
        # elements of ≤ g_b + 2·p_b = 12 bytes to the traffic, < 12·N; 12·N² also admits counting it once per rank.
        assert_close(torch.tensor(float(got["total_bytes"])), torch.tensor(float(sum(expected[stage].values()))),
                     name=f"ZeRO-{stage} total_bytes", section="handout 05 §5", rtol=0, atol=3 * k * n)
        assert_close(torch.tensor(float(got["comm_bytes_per_step"])), torch.tensor(comm[stage]),
                     name=f"ZeRO-{stage} comm_bytes_per_step", section="handout 05 §5", rtol=0, atol=12 * n * n)
    single = results[4]
    assert_equal((single["total_bytes"], single["comm_bytes_per_step"]), (16 * psi, 0), name="N = 1",
                 section="handout 05 §5")
    for bad, outcome in zip(bads, answer["bad"], strict=True):
        assert_raised(outcome, ValueError, next(iter(bad)), what=f"zero_memory_accounting with {bad}",
                      section="handout 05 §5")


# ----------------------------------------------------------------------------------------------------
# Bad input: the given checks before any communication, and the refusals of a constructed optimizer
# ----------------------------------------------------------------------------------------------------


@pytest.mark.builds("torch-zero")
@pytest.mark.points(1)
def test_bad_inputs_raise_clear_errors(worker, two_ranks) -> None:
    # Refusals of a constructed optimizer, in the ranks: each call's outcome, judged here in order.
    for rank, got in enumerate(two_ranks.values("bad_inputs")):
        s = "handout 05 §2"
        assert_raised(got["repeat"], ValueError, what="add_param_group({'params': [w]}) with w already in the "
                      "optimizer", section=s)
        assert_raised(got["twice"], ValueError, what="add_param_group({'params': [w, w]}) (a new parameter twice in "
                      "the group)", section=s)
        valid = got["valid"]
        assert "raised" not in valid, (
            f"rank {rank}: add_param_group({{'params': [w, b], 'lr': 3e-2}}) with two new parameters raised "
            f"{valid.get('raised')}: {valid.get('message')}; a valid group is accepted. See {s}.")
        assert_equal(got["groups"], [2, 2], name="parameters per group after two refused add_param_group calls "
                     "and one accepted", section=s)
        assert_raised(got["one_group"], ValueError, what="load_state_dict with one param group where the optimizer "
                      "has two", section="handout 05 §4")
        assert_raised(got["short_group"], ValueError, what="load_state_dict whose second group has 1 parameter where "
                      "the optimizer's has 2", section="handout 05 §4")
    got = worker.call(constructor_outcomes)
    s = "handout 05 §2"
    assert_raised(got["not_optimizer"], TypeError, "optimizer_cls", what="ShardedOptimizer(params, nn.Linear)",
                  section=s)
    assert_raised(got["instance"], TypeError, "optimizer_cls", what="ShardedOptimizer(params, AdamW(...)) (an "
                  "instance, not the class)", section=s)
    assert_raised(got["empty"], ValueError, "params", what="ShardedOptimizer([], AdamW) (no parameters)", section=s)
    assert_raised(got["repeat"], ValueError, "twice", what="ShardedOptimizer([w, b, w], AdamW) (a parameter twice)",
                  section=s)
    assert_raised(got["two_groups"], ValueError, "twice", what="ShardedOptimizer with the same parameter in two "
                  "groups", section=s)


# ----------------------------------------------------------------------------------------------------
# Training equals the unsharded optimizer
# ----------------------------------------------------------------------------------------------------


@pytest.mark.builds("torch-zero")
@pytest.mark.points(3)
def test_toy_model_matches_single_process_adamw(two_ranks) -> None:
    results = two_ranks.values("toy")
    reference = single_process("toy", STEPS)["params"]
    for rank, result in enumerate(results):
        assert_params_equal(result["params"], reference, f"rank {rank} of 2, toy model after {STEPS} "
                            "AdamW steps vs single-process AdamW", "handout 05 §3")
        assert result["grads_cleared"], "zero_grad() must clear the gradients of every parameter, owned or not"


@pytest.mark.builds("torch-zero")
@pytest.mark.points(3)
def test_transformer_matches_single_process_adamw(two_ranks, three_ranks) -> None:
    reference = single_process("transformer", STEPS)["params"]
    for world_size, results in ((2, two_ranks), (3, three_ranks)):
        for rank, result in enumerate(results.values("transformer")):
            assert_params_equal(result["params"], reference, f"rank {rank} of {world_size}, Transformer "
                                f"after {STEPS} AdamW steps vs single-process AdamW", "handout 05 §3")
    subgroup = three_ranks.values("subgroup")
    for rank in SUBGROUP:
        assert_params_equal(subgroup[rank]["params"], reference, f"global rank {rank} of "
                            f"process_group={SUBGROUP} (group rank {SUBGROUP.index(rank)}), Transformer after {STEPS} "
                            "AdamW steps vs single-process AdamW — broadcast's src is a global rank",
                            "handout 05 §3")


@pytest.mark.builds("torch-zero")
@pytest.mark.points(3)
def test_state_only_for_owned_parameters(two_ranks, three_ranks) -> None:
    numel = {n: p.numel() for n, p in make_model("transformer", frozen=False).named_parameters()}
    for world_size, results in ((2, two_ranks), (3, three_ranks)):
        for kind in ("transformer", "balance"):
            per_rank = [set(r["state_names"]) for r in results.values(kind)]
            trainable_names = set(trainable("transformer")) if kind == "transformer" else set(numel)
            for a in range(world_size):
                for b in range(a + 1, world_size):
                    both = per_rank[a] & per_rank[b]
                    assert not both, (f"{kind}: ranks {a} and {b} both hold optimizer state for {sorted(both)}; "
                                      "each parameter's state must live on its owner only. See handout 05 §2.")
            union = set().union(*per_rank)
            assert_equal(sorted(union), sorted(trainable_names), name=f"{kind} at {world_size} ranks: parameters "
                         "with optimizer state on some rank (all trainable ones, nothing else)",
                         section="handout 05 §2")
        loads = [sum(numel[n] for n in names) for names in per_rank]
        assert max(loads) - min(loads) <= max(numel.values()), (
            f"elements per rank {loads} at {world_size} ranks differ by more than the largest parameter "
            f"({max(numel.values())}): assign largest first to the least-loaded rank. See handout 05 §2."
        )
        matrices, vectors = param_groups(make_model("transformer"))
        expected_groups = [(len(matrices["params"]), ADAMW["lr"], ADAMW["weight_decay"]),
                           (len(vectors["params"]), 3e-2, 0.0)]
        for rank, result in enumerate(results.values("transformer")):
            assert_equal(result["groups"], expected_groups, name=f"rank {rank} of {world_size}: (number of "
                         "parameters, lr, weight_decay) of each param group — all parameters, not just the "
                         "owned ones", section="handout 05 §2")
    subgroup = three_ranks.values("subgroup")
    trainable_names = set(trainable("transformer"))
    for rank in SUBGROUP:
        group_rank, result = SUBGROUP.index(rank), subgroup[rank]
        owners = result["owners"]
        assert set(owners.values()) <= {0, 1}, (
            f"global rank {rank} of process_group={SUBGROUP}: owner_of returned ranks {sorted(set(owners.values()))}; "
            "owners are ranks *within* the group (0 and 1 here), not global ranks. See handout 05 §2.")
        owned = sorted(n for n in trainable_names if owners[n] == group_rank)
        assert_equal(result["state_names"], owned, name=f"global rank {rank} (group rank {group_rank} of "
                     f"{SUBGROUP}): parameters with optimizer state = the trainable ones it owns",
                     section="handout 05 §2")


@pytest.mark.builds("torch-zero")
@pytest.mark.points(2)
def test_add_param_group_after_steps(two_ranks) -> None:
    results = two_ranks.values("add_group")
    reference = snapshot(add_group_run(lambda groups: torch.optim.AdamW(groups, **ADAMW))[0])
    n_matrices, n_vectors = (len(g["params"]) for g in param_groups(make_model("toy")))
    for rank, result in enumerate(results):
        assert_params_equal(result["params"], reference, f"rank {rank}: toy model, second group added "
                            "after 3 steps, vs AdamW doing the same", "handout 05 §2")
        assert_equal(result["groups"], [n_matrices, n_vectors], name=f"rank {rank}: parameters per group",
                     section="handout 05 §2")
        repeat = result["repeat"]
        assert "ValueError" in repeat.get("mro", ()), (
            "add_param_group with a parameter already in the optimizer must raise ValueError. See handout 05 §2."
        )


def assert_state_dict_equal(got: dict[str, Any], expected: dict[str, Any], where: str = "") -> None:
    """A consolidated state dict's indices with state, and each state's tensors, vs single-process AdamW's."""
    assert_equal(sorted(got["state"]), sorted(expected["state"]),
                 name=f"{where}indices with state" + ("" if where else " (all trainable)"), section="handout 05 §4")
    for index, state in expected["state"].items():
        for key, value in state.items():
            assert_close(got["state"][index][key], value, name=f"{where}state[{index}][{key!r}]",
                         section="handout 05 §4", **TOL)


@pytest.mark.builds("torch-zero")
@pytest.mark.points(2)
def test_state_dict_consolidated_on_rank0(two_ranks, three_ranks) -> None:
    checkpoints = two_ranks.values("checkpoint")
    assert checkpoints[1]["optimizer"] is None, (
        "state_dict() must return None on ranks other than 0 (it is consolidated on rank 0)")
    results = two_ranks.values("transformer")
    expected = single_process("transformer", STEPS)["optimizer"]
    assert results[1]["state_dict"] is None, "state_dict() returns None on ranks other than 0. See handout 05 §4."
    got = results[0]["state_dict"]
    assert got is not None, "state_dict() on rank 0 returned None: consolidate the shards there. See handout 05 §4."
    assert_equal([g["params"] for g in got["param_groups"]], [g["params"] for g in expected["param_groups"]],
                 name="param_groups[i]['params'] (global indices, as the unsharded AdamW numbers them)",
                 section="handout 05 §4")
    assert_equal([{k: v for k, v in g.items() if k != "params"} for g in got["param_groups"]],
                 [{k: v for k, v in g.items() if k != "params"} for g in expected["param_groups"]],
                 name="param_groups options", section="handout 05 §4")
    assert_state_dict_equal(got, expected)
    subgroup = three_ranks.values("subgroup")
    assert subgroup[SUBGROUP[1]]["state_dict"] is None, (
        f"process_group={SUBGROUP}: state_dict() must return None on global rank {SUBGROUP[1]} (group rank 1). "
        "See handout 05 §4.")
    got = subgroup[SUBGROUP[0]]["state_dict"]
    assert got is not None, (f"process_group={SUBGROUP}: state_dict() returned None on global rank {SUBGROUP[0]}, "
                             "the group's rank 0: gather_object's dst is a global rank. See handout 05 §4.")
    assert_state_dict_equal(got, expected, where=f"process_group={SUBGROUP}: ")


def assert_reloaded(results: list[dict[str, Any] | None], ranks: list[int], where: str) -> None:
    """After stepping, then loading another run's checkpoint: each rank holds exactly its share of it."""
    per_rank = {rank: set(results[rank]["loaded"]) for rank in ranks}
    # The checkpoint the ranks loaded (the judge's own AdamW after SAVE_AT steps), by parameter name.
    checkpoint = adamw_checkpoint()["optimizer"]
    index = {n: i for i, n in enumerate(param_names_in_order(make_model("transformer")))}
    saved = {n: checkpoint["state"][i] for n, i in index.items() if i in checkpoint["state"]}
    reference = single_process("transformer", STEPS)["params"]
    for rank in ranks:
        result = results[rank]
        for name, state in result["loaded"].items():
            if name not in saved:
                raise AssertionError(f"{where}, global rank {rank}: optimizer.state holds {name}, which the loaded "
                                     "checkpoint has no state for: stale state from before load_state_dict. "
                                     "See handout 05 §4.")
            for key, value in saved[name].items():  # a load copies the checkpoint's tensors: exact
                assert_close(torch.as_tensor(state[key]).float(), torch.as_tensor(value).float(),
                             name=f"{where}, global rank {rank}: optimizer.state[{name}][{key!r}] right after "
                             "load_state_dict vs the loaded checkpoint (stale if it still shows the state from "
                             "before the load: point self.state at the local optimizer's new state)",
                             section="handout 05 §4", rtol=0, atol=0)
    for a in ranks:
        for b in ranks:
            both = per_rank[a] & per_rank[b] if a < b else set()
            assert not both, (f"{where}: after load_state_dict global ranks {a} and {b} both hold state for "
                              f"{sorted(both)}; keep only the owned ones. See handout 05 §4.")
    assert_equal(sorted(set().union(*per_rank.values())), sorted(saved), name=f"{where}: parameters with state "
                 "after load_state_dict, over all ranks (every one the checkpoint has)", section="handout 05 §4")
    for rank in ranks:
        assert_params_equal(results[rank]["params"], reference, f"{where}, global rank {rank}: "
                            f"stepped twice, loaded AdamW's step-{SAVE_AT} checkpoint, trained to step {STEPS}, vs "
                            f"AdamW for {STEPS} steps", "handout 05 §4")


@pytest.mark.builds("torch-zero")
@pytest.mark.points(3)
def test_resume_at_three_ranks_from_two(two_ranks, three_ranks) -> None:
    resumed = three_ranks.values("resume")
    reference = single_process("transformer", STEPS)["params"]
    for rank, result in enumerate(resumed):
        assert_params_equal(result["params"], reference, f"rank {rank} of 3: saved at step {SAVE_AT} "
                            f"with 2 ranks, resumed to step {STEPS}, vs AdamW for {STEPS} steps", "handout 05 §4")
    loaded = [set(r["loaded_state_names"]) for r in resumed]
    assert all(not (loaded[a] & loaded[b]) for a in range(3) for b in range(a + 1, 3)), (
        "after load_state_dict two ranks hold state for the same parameter: keep only the owned ones. "
        "See handout 05 §4."
    )
    assert_reloaded(two_ranks.values("reload"), [0, 1], "2 ranks")
    assert_reloaded(three_ranks.values("subgroup_reload"), SUBGROUP, f"process_group={SUBGROUP} of 3 ranks")


@pytest.mark.builds("torch-zero")
@pytest.mark.points(2)
def test_matches_torch_zero_redundancy_optimizer(two_ranks, three_ranks) -> None:
    for world_size, results in ((2, two_ranks), (3, three_ranks)):
        per_rank = results.values("transformer")
        expected = torch_zero(world_size)  # torch's ZeroRedundancyOptimizer in the kit's own ranks
        for rank, result in enumerate(per_rank):
            assert_params_equal(result["params"], expected[rank]["transformer"], f"rank {rank} of {world_size}: "
                                "ShardedOptimizer vs torch ZeroRedundancyOptimizer", "handout 05 §3")
    per_rank = two_ranks.values("toy")
    expected = torch_zero(2)
    for rank, result in enumerate(per_rank):
        assert_params_equal(result["params"], expected[rank]["toy"], f"rank {rank} of 2, toy model: "
                            "ShardedOptimizer vs torch ZeroRedundancyOptimizer", "handout 05 §3")


@pytest.mark.builds("torch-zero")
@pytest.mark.points(3)
def test_combined_with_ddp(ddp_ranks) -> None:
    for cls in ("bucketed", "individual"):
        per_rank = ddp_ranks.values(cls)
        # DDP's arithmetic with the unsharded AdamW, in the kit's own ranks: each rank's half-batch gradients
        # summed by all-reduce and divided by 2, as Stage 4's DDP does, so the comparison stays tight.
        ddp_adamw = ddp_average()
        reference = single_process("transformer", STEPS)["params"]
        for rank, result in enumerate(per_rank):
            assert_params_equal(result["params"], ddp_adamw[rank], f"rank {rank} of 2, DDP ({cls}) + "
                                "ShardedOptimizer vs half-batch gradients averaged over the 2 ranks + unsharded AdamW",
                                "handout 05 §3")
            # Half-batch gradients averaged differ from whole-batch ones by rounding, and AdamW carries that
            # difference into the parameters by up to lr per step where a gradient is near its rounding
            # (whole_batch_drift). So: TOL for the parameters' own arithmetic, plus that element-wise allowance —
            # ~0 where the gradient is far above its rounding, while a lost half of the batch moves ~lr per step.
            # Measured (Xeon, 2 cores): ≤ 0.10 of this bound on its own, AVX2 (MKL_CBWR=AVX2) and scalar
            # (COMPATIBLE) paths; training on one half only puts 99.8 % of the elements outside it.
            assert_params_equal(result["params"], reference, f"rank {rank} of 2, DDP ({cls}) + "
                                "ShardedOptimizer, half the batch each, vs AdamW on the whole batch",
                                "handout 05 §3", allowance=whole_batch_drift())
        assert not (set(per_rank[0]["state_names"]) & set(per_rank[1]["state_names"])), (
            f"DDP ({cls}) + ShardedOptimizer: both ranks hold optimizer state for the same parameter"
        )
