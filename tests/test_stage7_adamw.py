"""Stage 7 — the fused AdamW (handout/07b-whole-step.md §4).

The implementation runs in the worker (``worker.call``): the module-level functions below build the same seeded
parameters and gradients as the tests, step ``FusedAdamW`` and return what it computed — the parameters after
every step, the state dict, the operators a step dispatched, what a bad call raised — as data. The judge (this
process) computes the expected values itself: ``torch.optim.AdamW`` in **float64** on the same gradients (torch's
own implementation, in a dtype whose rounding is negligible here), and a small float64 AdamW of its own
(:func:`_adamw64`) whose variants are the classic mistakes, so that a failure can say which one it looks like.

Tolerance (fp32 against float64). One AdamW step rounds the weight decay ``p·(1 − lr·λ)`` and the subtraction
of the update once each (≤ 2u·|p|, u = 2⁻²⁴), and the update ``lr·m̂/(√v̂ + ε)`` about 6 times (lerp, mul,
addcmul, sqrt, div, add; the addcdiv's division) on top of the error m and v carry from the earlier steps
(≤ 3u relative per step). Over T steps that is at most ``2T·u·|p| + (6T + 1.5T²)·u·lr·R`` with R the largest
``|m̂/(√v̂ + ε)|`` of the float64 run; the tests allow twice that. ``torch.optim.AdamW`` in fp32 meets it (the
reference ``FusedAdamW`` performs torch's operations in torch's order and equals it bit for bit); so does any
other correct order of the same operations.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kit.impl
from kit.checks import outcome_of
from kit.testing import assert_close, assert_equal, assert_raised

# Every test here grades FusedAdamW: torch's AdamW behind it loses them all (tests/test_stage7_rules.py).
pytestmark = [pytest.mark.stage7, pytest.mark.builds("torch-adamw")]

SEC = "handout 07b §4"
U32 = 2.0**-24
# Two groups with different options. Group "b" has a tiny-gradient tensor (g ~ 1e-4) and eps = 1e-3, so where ε sits
# matters; "late" gets no gradient for the first two steps, "frozen" never gets one.
SHAPES = {"w1": (6, 5), "late": (5,), "w2": (4, 6), "tiny": (7,), "frozen": (3,)}
GROUPS = [
    {"names": ["w1", "late"], "lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
    {"names": ["w2", "tiny", "frozen"], "lr": 3e-2, "betas": (0.8, 0.99), "eps": 1e-3, "weight_decay": 0.05},
]
STEPS = 6


def _module():
    """The implementation's ``whole_step.fused_adamw`` (in the worker)."""
    return importlib.import_module(f"{kit.impl.load().package}.whole_step.fused_adamw")


def initial(shapes: dict = SHAPES, seed: int = 0, low: float = 0.0) -> dict[str, torch.Tensor]:
    """The initial weights, fp32; with ``low`` > 0 their magnitudes lie in [low, 1]."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        x = torch.randn(shape, generator=g)
        out[name] = x if low == 0 else x.sign() * (low + (1 - low) * torch.rand(shape, generator=g))
    return out


def gradient(name: str, shape: tuple, step: int, seed: int = 0) -> torch.Tensor | None:
    """The fp32 gradient of ``name`` at ``step`` (0-based), or None where it gets none."""
    if name == "frozen" or (name == "late" and step < 2):
        return None
    g = torch.Generator().manual_seed(seed * 1000 + 17 * step + len(name))
    scale = 1e-4 if name == "tiny" else 1.0
    return scale * torch.randn(shape, generator=g)


def groups_of(params: dict[str, torch.Tensor], groups: list[dict] = GROUPS) -> list[dict[str, Any]]:
    return [{"params": [params[n] for n in g["names"]], **{k: v for k, v in g.items() if k != "names"}}
            for g in groups]


def scheduled(groups: list[dict], step: int) -> list[dict[str, float]]:
    """Each group's lr and weight decay at ``step`` (0-based) of the schedule test, as a scheduler sets them in
    ``optimizer.param_groups`` before the step: lr × 0.6 every step, the weight decay doubled from step 3 on."""
    return [{"lr": g["lr"] * 0.6**step, "weight_decay": g["weight_decay"] * (2 if step >= 3 else 1)} for g in groups]


# ----------------------------------------------------------------------------------------------------
# In the worker: FusedAdamW steps, the parameters come back
# ----------------------------------------------------------------------------------------------------


def _trajectory(steps: int, dtype: str = "float32", master: bool = False, low: float = 0.0,
                shapes: dict = SHAPES, groups: list[dict] = GROUPS, schedule: bool = False) -> dict[str, Any]:
    """The parameters after each step (as fp32), and the final state dict. ``schedule``: each group's lr and
    weight decay are set before every step (:func:`scheduled`)."""
    params = {n: p.to(getattr(torch, dtype)).requires_grad_() for n, p in initial(shapes, low=low).items()}
    optimizer = _module().FusedAdamW(groups_of(params, groups), master_weights=master)
    after = []
    for step in range(steps):
        if schedule:
            for group, options in zip(optimizer.param_groups, scheduled(groups, step)):
                group.update(options)
        for name, p in params.items():
            g = gradient(name, p.shape, step)
            p.grad = None if g is None else g.to(p.dtype)
        optimizer.step()
        after.append({n: p.detach().clone() for n, p in params.items()})
    return {"after": after, "state_dict": optimizer.state_dict()}


def _zero_gradient_decay(steps: int) -> list[torch.Tensor]:
    """A parameter whose gradient is exactly zero, weight decay 0.1, lr 1e-2: its value after each step."""
    p = initial({"p": (8,)})["p"].requires_grad_()
    optimizer = _module().FusedAdamW([p], lr=1e-2, weight_decay=0.1)
    out = []
    for _ in range(steps):
        p.grad = torch.zeros_like(p)
        optimizer.step()
        out.append(p.detach().clone())
    return out


def _resumed(master: bool) -> dict[str, Any]:
    """3 steps, state dict, a fresh optimizer on copies of the parameters loads it, 3 more steps; against 6 steps
    straight. Also: torch.optim.AdamW's state dict after 3 steps, loaded into FusedAdamW, then 3 steps."""
    dtype = torch.bfloat16 if master else torch.float32
    fused = _module().FusedAdamW

    def run(params, optimizer, steps):
        for step in steps:
            for name, p in params.items():
                g = gradient(name, p.shape, step)
                p.grad = None if g is None else g.to(p.dtype)
            optimizer.step()

    straight = {n: p.to(dtype).requires_grad_() for n, p in initial().items()}
    run(straight, fused(groups_of(straight), master_weights=master), range(6))
    first = {n: p.to(dtype).requires_grad_() for n, p in initial().items()}
    opt = fused(groups_of(first), master_weights=master)
    run(first, opt, range(3))
    saved = opt.state_dict()
    second = {n: p.detach().clone().requires_grad_() for n, p in first.items()}
    opt2 = fused(groups_of(second), master_weights=master)
    opt2.load_state_dict(saved)
    loaded_dtypes = {n: {k: str(v.dtype) for k, v in opt2.state[p].items() if isinstance(v, torch.Tensor)}
                     for n, p in second.items()}
    run(second, opt2, range(3, 6))
    out = {"straight": {n: p.detach() for n, p in straight.items()},
           "resumed": {n: p.detach() for n, p in second.items()}, "loaded_dtypes": loaded_dtypes}
    if not master:  # torch's state dict into FusedAdamW
        torch_params = {n: p.clone().requires_grad_() for n, p in initial().items()}
        topt = torch.optim.AdamW(groups_of(torch_params))
        run(torch_params, topt, range(3))
        into = {n: p.detach().clone().requires_grad_() for n, p in torch_params.items()}
        fopt = fused(groups_of(into))
        fopt.load_state_dict(topt.state_dict())
        run(into, fopt, range(3, 6))
        out["from_torch"] = {n: p.detach() for n, p in into.items()}
    return out


class _PerTensorWork(TorchDispatchMode):
    """Records the operators dispatched on tensors with more than one element that are neither ``_foreach`` ops,
    nor allocations, nor views (a view launches no kernel): the work a Python loop over the parameters would launch
    once per tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)]
        free = name.startswith("empty") or name in ("new_empty", "new_empty_strided") or func.is_view
        if not name.startswith("_foreach") and not free and any(t.numel() > 1 for t in tensors):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops_per_step(count: int, master: bool) -> list[str]:
    """The per-tensor operators of FusedAdamW's second step (the first creates the state) over ``count``
    parameters of 16 elements (bf16 with master weights, else fp32)."""
    dtype = torch.bfloat16 if master else torch.float32
    g = torch.Generator().manual_seed(count)
    params = [torch.randn(16, generator=g).to(dtype).requires_grad_() for _ in range(count)]
    optimizer = _module().FusedAdamW(params, lr=1e-2, master_weights=master)
    for step in range(2):
        for p in params:
            p.grad = torch.randn(16, generator=g).to(dtype)
        if step == 1:
            with _PerTensorWork() as mode:
                optimizer.step()
            return mode.ops
        optimizer.step()
    return []


def _bad_calls() -> dict[str, dict]:
    fused = _module().FusedAdamW
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.ones(3)
    fused([p]).step()  # a valid step first: a stub fails here, not as a missing error below
    out = {
        "lr=-1": outcome_of(fused, [p], lr=-1.0),
        "betas=(0.9,)": outcome_of(fused, [p], betas=(0.9,)),
        "betas=(1.0, 0.999)": outcome_of(fused, [p], betas=(1.0, 0.999)),
        "eps='tiny'": outcome_of(fused, [p], eps="tiny"),
        "weight_decay=-0.1": outcome_of(fused, [p], weight_decay=-0.1),
        "master_weights=1": outcome_of(fused, [p], master_weights=1),
        "params=[]": outcome_of(fused, []),
    }
    optimizer = fused([p])
    out["add_param_group(lr=-1)"] = outcome_of(optimizer.add_param_group,
                                               {"params": [torch.zeros(2, requires_grad=True)], "lr": -1.0})
    q = torch.zeros(4, 3, requires_grad=True)
    q.grad = torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.tensor([1.0]), (4, 3))
    out["sparse gradient"] = outcome_of(fused([q]).step)
    return out


# ----------------------------------------------------------------------------------------------------
# In the judge: float64 references, the classic mistakes, tolerances
# ----------------------------------------------------------------------------------------------------


def torch_reference(steps: int, dtype: torch.dtype = torch.float64, low: float = 0.0, cast: torch.dtype | None = None,
                    shapes: dict = SHAPES, groups: list[dict] = GROUPS,
                    schedule: bool = False) -> list[dict[str, torch.Tensor]]:
    """torch.optim.AdamW in ``dtype`` on the same gradients; ``cast`` rounds the initial weights and the gradients
    to that dtype first (what a bf16 parameter and its bf16 gradient hold); ``schedule`` as :func:`_trajectory`."""
    start = initial(shapes, low=low)
    params = {n: (p.to(cast) if cast else p).to(dtype).requires_grad_() for n, p in start.items()}
    optimizer = torch.optim.AdamW(groups_of(params, groups))
    after = []
    for step in range(steps):
        if schedule:
            for group, options in zip(optimizer.param_groups, scheduled(groups, step)):
                group.update(options)
        for name, p in params.items():
            g = gradient(name, p.shape, step)
            p.grad = None if g is None else (g.to(cast) if cast else g).to(dtype)
        optimizer.step()
        after.append({n: p.detach().clone() for n, p in params.items()})
    return after


MISTAKES = {
    "bias correction off by one step (t + 1 where the step count after its increment, t, belongs)": {"offset": 1},
    "no bias correction": {"no_bias_correction": True},
    "weight decay coupled into the gradient (Adam with L2: g + λ·p goes through m̂/√v̂; AdamW decays p directly)":
        {"coupled": True},
    "ε inside the square root (√(v̂ + ε) instead of √v̂ + ε)": {"eps_inside": True},
}


def _adamw64(p: torch.Tensor, grads: list[torch.Tensor | None], lr: float, betas: tuple[float, float], eps: float,
             weight_decay: float, *, offset: int = 0, no_bias_correction: bool = False, coupled: bool = False,
             eps_inside: bool = False) -> list[torch.Tensor]:
    """AdamW (or one of its classic mistakes) in float64, one tensor: the value after each step."""
    p, m, v, t, out = p.double().clone(), None, None, 0, []
    b1, b2 = betas
    for g in grads:
        if g is None:
            out.append(p.clone())
            continue
        g = g.double()
        t += 1
        m = torch.zeros_like(p) if m is None else m
        v = torch.zeros_like(p) if v is None else v
        if coupled:
            g = g + weight_decay * p
        else:
            p = p * (1 - lr * weight_decay)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        bc1 = 1.0 if no_bias_correction else 1 - b1 ** (t + offset)
        bc2 = 1.0 if no_bias_correction else 1 - b2 ** (t + offset)
        denom = (v / bc2 + eps).sqrt() if eps_inside else (v / bc2).sqrt() + eps
        p = p - lr * (m / bc1) / denom
        out.append(p.clone())
    return out


def _group_of(name: str, groups: list[dict] = GROUPS) -> dict:
    return next(g for g in groups if name in g["names"])


def fp32_atol_rtol(name: str, steps: int, reference: list[dict[str, torch.Tensor]], start: torch.Tensor | None = None,
                   groups: list[dict] = GROUPS, schedule: bool = False) -> tuple[float, float]:
    """The module docstring's bound for ``name`` after ``steps`` steps of the float64 ``reference`` (which started
    from ``start``, default ``initial()[name]``): (atol, rtol). ``schedule``: the group's lr and weight decay of
    each step are :func:`scheduled`'s, and the bound takes the largest lr (each step's terms are at most that)."""
    index = next(i for i, g in enumerate(groups) if name in g["names"])
    options = [scheduled(groups, step)[index] if schedule else groups[index] for step in range(steps)]
    previous = (initial()[name] if start is None else start).double()
    largest = 0.0
    for after, group in zip(reference[:steps], options):
        decayed = previous * (1 - group["lr"] * group["weight_decay"])
        largest = max(largest, float((after[name] - decayed).abs().max()) / group["lr"])
        previous = after[name]
    t = steps
    atol = 2 * (6 * t + 1.5 * t * t) * U32 * max(group["lr"] for group in options) * max(largest, 1.0)
    return atol, 2 * 2 * t * U32


def _diagnose(name: str, got: list[torch.Tensor], steps: int, low: float = 0.0) -> str:
    """Which classic mistake ``got`` (the parameter after each step) matches, as a sentence; '' if none does."""
    group = _group_of(name)
    grads = [gradient(name, SHAPES[name], s) for s in range(steps)]
    start = initial(low=low)[name]
    for mistake, flags in MISTAKES.items():
        wrong = _adamw64(start, grads, group["lr"], group["betas"], group["eps"], group["weight_decay"], **flags)
        scale = max(float((wrong[-1] - start.double()).abs().max()), 1e-12)
        # A hint, not a grade: within 0.1 % of how far the mistake moves the weights, far above fp32 rounding
        # (≲ 1e-5 relative, the module docstring) and far below the gap between two different mistakes.
        if all(float((g.double() - w).abs().max()) <= 1e-3 * scale for g, w in zip(got, wrong)):
            return f" It matches AdamW with the mistake: {mistake}."
    return ""


def check_trajectory(got: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]], names: list[str],
                     what: str) -> None:
    """Each step's parameters against the float64 reference, within the module docstring's fp32 bound."""
    for step, (g, e) in enumerate(zip(got, expected)):
        for name in names:
            atol, rtol = fp32_atol_rtol(name, step + 1, expected)
            try:
                assert_close(g[name], e[name], name=f"{what}: parameter {name!r} after step {step + 1}", section=SEC,
                             rtol=rtol, atol=atol)
            except AssertionError as exc:
                hint = _diagnose(name, [x[name] for x in got[: step + 1]], step + 1)
                raise AssertionError(f"{exc}{hint}") from None


# ----------------------------------------------------------------------------------------------------
# The tests
# ----------------------------------------------------------------------------------------------------


@pytest.mark.points(4)
def test_adamw_matches_torch_adamw_over_steps(worker):
    """Two groups (different lr, betas, eps, weight decay), 6 steps, a parameter without a gradient for two steps
    and one that never gets any: FusedAdamW against torch.optim.AdamW in float64."""
    got = worker.call(_trajectory, STEPS)
    expected = torch_reference(STEPS)
    check_trajectory(got["after"], expected, ["w1", "w2", "late", "tiny"], "FusedAdamW")
    # Never a gradient: AdamW neither decays nor updates it, so it stays bit for bit its initial value.
    assert_close(got["after"][-1]["frozen"], initial()["frozen"], name="parameter 'frozen' (never has a gradient)",
                 section=SEC, rtol=0, atol=0)
    frozen_index = [n for g in GROUPS for n in g["names"]].index("frozen")
    assert_equal(frozen_index in got["state_dict"]["state"], False,
                 name="optimizer state for 'frozen', a parameter that never had a gradient (AdamW skips it: no "
                      "state, no weight decay)", section=SEC)


@pytest.mark.points(2)
def test_adamw_first_step_is_bias_corrected(worker):
    """After one step m̂ = g and √v̂ = |g|: every element moves by lr·g/(|g| + ε) after the decay."""
    got = worker.call(_trajectory, 1)["after"][0]["w1"].double()
    group = _group_of("w1")
    start, g = initial()["w1"].double(), gradient("w1", SHAPES["w1"], 0).double()
    decayed = start * (1 - group["lr"] * group["weight_decay"])
    moved = (decayed - got) / group["lr"]  # in units of lr: ±1 where |g| ≫ ε
    expected = g / (g.abs() + group["eps"])
    b1, b2 = group["betas"]
    if not torch.isfinite(moved).all():
        raise AssertionError(
            "first step: parameter 'w1' holds inf/nan. A bias correction computed with the step count before its "
            f"increment (t = 0) divides by 1 − β⁰ = 0: increment the step, then use it. See {SEC}.")
    ratio = float((moved / expected).median())
    off_by_one = (1 - b1) / (1 - b1**2) / math.sqrt((1 - b2) / (1 - b2**2))
    hint = (f" Every element moved by {ratio:.3g}·lr where AdamW's first step moves it by 1·lr (m̂ = m/(1 − β₁¹) = g, "
            f"√v̂ = √(v/(1 − β₂¹)) = |g|).")
    # Hints only: the median step in units of lr against what two known mistakes give (0.73 and 0.45 for w1's betas,
    # against 1); its fp32 rounding is ~u·|p|/lr ≈ 6e-6, so 1e-3 is far above that and far below those gaps.
    if abs(ratio - off_by_one) < 1e-3:
        hint += f" {off_by_one:.3g}·lr is what a bias correction with t + 1 gives: the step count is off by one."
    elif abs(ratio - (1 - b1) / math.sqrt(1 - b2)) < 1e-3:
        hint += " That is what no bias correction at all gives: (1 − β₁)/√(1 − β₂)."
    atol, rtol = fp32_atol_rtol("w1", 1, torch_reference(1))
    try:
        assert_close(got, start * (1 - group["lr"] * group["weight_decay"]) - group["lr"] * expected,
                     name="parameter 'w1' after the first step", section=SEC, rtol=rtol, atol=atol)
    except AssertionError as exc:
        raise AssertionError(f"{exc}{hint}") from None


@pytest.mark.points(2)
def test_adamw_weight_decay_is_decoupled(worker):
    """A zero gradient with weight decay: AdamW only shrinks the weights, p·(1 − lr·λ)ᵗ; Adam with L2 would put
    λ·p through m̂/√v̂ and move each weight by about lr."""
    got = worker.call(_zero_gradient_decay, 3)
    start = initial({"p": (8,)})["p"].double()
    for t, value in enumerate(got, start=1):
        expected = start * (1 - 1e-2 * 0.1) ** t
        moved = float(((start - value.double()).abs() / start.abs()).median())
        # Each step rounds the decay factor 1 − lr·λ and the product p·(1 − lr·λ) (≤ u each, u = 2⁻²⁴), and perhaps
        # a zero update added: ≤ 4u per step, so 8·t·u after t steps is twice that; coupled (L2) decay moves each
        # weight by ~lr = 1e-2.
        try:
            assert_close(value, expected, name=f"zero-gradient parameter after step {t} (lr 1e-2, weight decay 0.1)",
                         section=SEC, rtol=8 * t * U32, atol=0)
        except AssertionError as exc:
            raise AssertionError(
                f"{exc} It moved by {moved:.3g}·|p| where decoupled weight decay moves it by {1 - 0.999**t:.3g}·|p|: "
                "the weight decay must multiply the weights (p ← p·(1 − lr·λ)), not be added to the gradient "
                "(coupled, L2: Adam's normalisation then turns λ·p into a step of about lr).") from None


@pytest.mark.points(1)
def test_adamw_eps_outside_the_square_root(worker):
    """Group b's 'tiny' tensor has gradients of ~1e-4 and ε = 1e-3: √v̂ + ε and √(v̂ + ε) differ by 30×."""
    got = worker.call(_trajectory, 3)["after"]
    check_trajectory(got, torch_reference(3), ["tiny"], "FusedAdamW, gradients ~1e-4 with eps 1e-3")


# The 16-bit dtypes with master weights: (short name, bits after the leading one — the ulp at |x| ∈ [2ᵉ, 2ᵉ⁺¹) is
# 2^(e − bits) —, what the base lr is divided by). lr 1e-3/3e-3 in bf16, 1e-4/3e-4 in fp16: most updates are below
# half an ulp at |p| ≥ 0.5 (2⁻⁹ ≈ 2.0e-3 in bf16, 2⁻¹² ≈ 2.4e-4 in fp16) and vanish without a master copy.
MASTER_DTYPES = {"bfloat16": ("bf16", 7, 10), "float16": ("fp16", 10, 100)}


@pytest.mark.points(4)
def test_adamw_master_weights_follow_an_fp32_reference(worker):
    """bf16 and fp16 parameters with master_weights=True, 12 steps at lr 1e-3/3e-3 (bf16) and 1e-4/3e-4 (fp16),
    weights of magnitude [0.5, 1]: the fp32 master copy follows float64 AdamW from the same (16-bit) start on the
    same (16-bit) gradients, within the fp32 bound; each 16-bit parameter is its master rounded (within one ulp of
    the float64 value). Without a master copy, an update smaller than half an ulp at |p| ≥ 0.5 would be lost."""
    steps = 12
    for dtype, (short, bits, divisor) in MASTER_DTYPES.items():
        groups = [{**g, "lr": g["lr"] / divisor} for g in GROUPS]
        got = worker.call(_trajectory, steps, dtype, True, 0.5, SHAPES, groups)
        expected = torch_reference(steps, low=0.5, cast=getattr(torch, dtype), groups=groups)
        order = [n for g in groups for n in g["names"]]
        state = got["state_dict"]["state"]
        for name in ("w1", "w2", "late", "tiny"):
            entry = state.get(order.index(name), {})
            if not isinstance(entry.get("master"), torch.Tensor):
                raise AssertionError(
                    f"optimizer state of {short} parameter {name!r}: no 'master' tensor (keys {sorted(entry)}). With "
                    "master_weights=True each 16-bit parameter (bf16 and fp16 alike: every dtype but fp32) keeps an "
                    "fp32 copy, state['master'], that the update is applied to; the parameter is rounded from it. "
                    f"See {SEC}.")
            for key in ("master", "exp_avg", "exp_avg_sq"):
                assert_equal(str(entry[key].dtype), "torch.float32",
                             name=f"dtype of state[{key!r}] of {short} parameter {name!r} with master_weights=True "
                                  "(the master copy and the moments m, v are kept in fp32)", section=SEC)
            start = initial(low=0.5)[name].to(getattr(torch, dtype))
            atol, rtol = fp32_atol_rtol(name, steps, expected, start, groups)
            assert_close(entry["master"], expected[-1][name], section=SEC, rtol=rtol, atol=atol,
                         name=f"fp32 master copy of {short} parameter {name!r} after {steps} steps")
            # The parameter is the master rounded (≤ half an ulp away) and the master is within the fp32 bound
            # above (≪ an ulp): one ulp in all. A parameter updated in 16 bits instead stays where it was.
            ulp = 2.0 ** (torch.floor(torch.log2(expected[-1][name].abs())) - bits)
            final = got["after"][-1][name].double()
            err = (final - expected[-1][name]).abs()
            if (err > ulp).any():
                i = int((err / ulp).flatten().argmax())
                moved = float((final - start.double()).abs().flatten()[i])
                raise AssertionError(
                    f"{short} parameter {name!r} after {steps} steps is {float(final.flatten()[i]):.6g} at flat index "
                    f"{i} (it moved by {moved:.3g} from its start), the float64 reference "
                    f"{float(expected[-1][name].flatten()[i]):.6g}: more than one {short} ulp "
                    f"({float(ulp.flatten()[i]):.3g}) apart. Each step must update the fp32 master and round the "
                    f"parameter from it; an update applied in {short} loses every step smaller than half an ulp. "
                    f"See {SEC}.")


@pytest.mark.points(2)
def test_adamw_follows_a_learning_rate_schedule(worker):
    """A scheduler changes group["lr"] before every step (× 0.6) and the weight decay doubles from step 4 on:
    FusedAdamW over 6 steps against torch.optim.AdamW in float64 under the same schedule — every option is read
    from its group at every step, nothing derived from them cached."""
    got = worker.call(_trajectory, STEPS, schedule=True)["after"]
    expected = torch_reference(STEPS, schedule=True)
    for step, (g, e) in enumerate(zip(got, expected)):
        for name in ("w1", "w2", "late", "tiny"):
            atol, rtol = fp32_atol_rtol(name, step + 1, expected, schedule=True)
            try:
                assert_close(g[name], e[name], section=SEC, rtol=rtol, atol=atol,
                             name=f"FusedAdamW under a schedule (lr × 0.6 a step, weight decay doubled from step 4): "
                                  f"parameter {name!r} after step {step + 1}")
            except AssertionError as exc:
                raise AssertionError(
                    f"{exc} Before each step a learning-rate scheduler writes group['lr'] (here also "
                    "group['weight_decay']): read lr, betas, eps and weight_decay from the group at every step(), "
                    "and derive the decay factor 1 − lr·λ and the step size from them there, not once.") from None


@pytest.mark.points(2)
def test_adamw_state_dict_round_trip(worker):
    """Resume after 3 of 6 steps from a state dict (fp32; bf16 with master weights, whose fp32 state stays fp32):
    the same parameters, bit for bit, as 6 steps straight. A torch.optim.AdamW state dict loads too (the same
    keys: step, exp_avg, exp_avg_sq) and continues torch's trajectory."""
    for master in (False, True):
        got = worker.call(_resumed, master)
        what = "bf16 with master weights" if master else "fp32"
        for name in SHAPES:  # the same operations on the same values, state restored exactly: bit for bit
            assert_close(got["resumed"][name], got["straight"][name], rtol=0, atol=0, section=SEC,
                         name=f"{what}: parameter {name!r} after 3 steps, a state_dict round trip, 3 more steps "
                              "(against 6 steps straight)")
        if master:
            for name, dtypes in got["loaded_dtypes"].items():
                for key in ("master", "exp_avg", "exp_avg_sq"):
                    if key in dtypes:
                        assert_equal(dtypes[key], "torch.float32", section=SEC,
                                     name=f"state[{key!r}] of {name!r} after load_state_dict (fp32 state stays fp32)")
        else:
            expected = torch_reference(6)[-1]
            for name in ("w1", "w2", "late", "tiny"):
                atol, rtol = fp32_atol_rtol(name, 6, torch_reference(6))
                assert_close(got["from_torch"][name], expected[name], rtol=rtol, atol=atol, section=SEC,
                             name=f"parameter {name!r}: 3 steps of torch.optim.AdamW, its state dict loaded into "
                                  "FusedAdamW, 3 more steps")


@pytest.mark.points(3)
def test_adamw_no_python_loop_over_parameters(worker):
    """One step over 3 and over 12 parameters dispatches the same per-tensor operators (none, for a foreach
    implementation): the work is one ``torch._foreach_*`` call per operation, whatever the number of tensors."""
    for master in (False, True):
        few, many = worker.call(_ops_per_step, 3, master), worker.call(_ops_per_step, 12, master)
        if len(many) > len(few):
            counts = {op: (few.count(op), many.count(op)) for op in sorted(set(many))}
            grew = {op: c for op, c in counts.items() if c[1] > c[0]}
            listed = ", ".join(f"{op} ×{a} → ×{b}" for op, (a, b) in list(grew.items())[:6])
            raise AssertionError(
                f"FusedAdamW.step ({'bf16 with master weights' if master else 'fp32'}) dispatches operators on single "
                f"tensors whose count grows with the number of parameters (3 → 12 parameters: {listed}): a Python "
                "loop over the tensors, one kernel launch each. Use torch._foreach_* (one call per operation for the "
                f"whole group; allocation with torch.empty_like in a loop is fine). See {SEC}.")


@pytest.mark.points(2)
def test_adamw_bad_inputs_raise_clear_errors(worker):
    outcomes = worker.call(_bad_calls)
    expected = {
        "lr=-1": (ValueError, "lr"), "betas=(0.9,)": (ValueError, "betas"),
        "betas=(1.0, 0.999)": (ValueError, "betas"), "eps='tiny'": (TypeError, "eps"),
        "weight_decay=-0.1": (ValueError, "weight_decay"), "master_weights=1": (TypeError, "master_weights"),
        "params=[]": (ValueError, "param"), "add_param_group(lr=-1)": (ValueError, "lr"),
        "sparse gradient": ((ValueError, RuntimeError), "sparse"),
    }
    for call, (error, match) in expected.items():
        assert_raised(outcomes[call], error, match, what=f"FusedAdamW {call}", section=SEC)
