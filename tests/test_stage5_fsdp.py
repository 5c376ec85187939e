"""Stage 5, part two — FSDP (ZeRO-3): sharded weights gathered just in time (handout/05b-fsdp.md).

Independent references, all computed inside the ranks (one thread each, so the kernels are the same):

* **single-process training with the same arithmetic**: the model unsharded, each rank's part of the
  batch run separately, the gradients averaged in rank order in fp32, then the same optimizer. With the
  weights cast to ``compute_dtype`` for the mixed-precision runs (the parameters of the units only, as
  FSDP does). FSDP must match it bit for bit at 2 ranks, and within a bound derived from fp32 rounding,
  element by element, at 3;
* **single-process training on the whole batch**: the ground truth, matched within a derived bound;
* the memory FSDP really holds, traced storage by storage with a dispatch mode (:class:`GatheredTracker`);
* the collectives it really issues, recorded by ``kit.comm_log`` during a real step.

One 3-rank spawn runs every check (``kit.checks``): the 2-rank ones on the group of ranks 0 and 1, the
3-rank ones on all three. Each test reads its own.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import kit.impl
from kit.checks import run_checks, spawned_checks
from kit.comm_log import CommLog, Event, format_events
from kit.model import ModelConfig, RMSNorm, TransformerLM, cross_entropy
from kit.testing import assert_close, assert_equal

pytestmark = pytest.mark.stage5

# Vocabulary 61 and the toy's 37-row embedding and 5-row head do not divide by 2 or 3: every run pads.
TINY = ModelConfig(vocab_size=61, context_length=8, d_model=32, d_ff=64, num_layers=2, num_heads=2)
BATCH = 6  # rows per step: 3 per rank at 2 ranks, 2 at 3
STEPS = 3
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "plain_sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.0}),  # no state: a checkpoint of the weights resumes it
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}),
}
U32 = 2.0**-24  # unit roundoff of fp32
PAIR = [0, 1]  # the 2-rank checks run on this group of the 3 ranks
SUBGROUP = [1, 2]  # of the 3 ranks: a group that does not start at global rank 0
TIMEOUT = 180.0  # seconds for the one spawn, start-up included: ~30 s on a loaded 2-core machine (load 11)


# ----------------------------------------------------------------------------------------------------
# Models, data and the single-process references (module level: the ranks import them by name)
# ----------------------------------------------------------------------------------------------------


class Toy(nn.Module):
    """embedding → norm → linear: two units (one with a bias) and a replicated norm gain."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 12)
        self.norm = RMSNorm(12)
        self.head = nn.Linear(12, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens)))


def make_model(kind: str, seed: int = 1234) -> nn.Module:
    torch.manual_seed(seed)
    return Toy() if kind == "toy" else TransformerLM(TINY)


def batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step`` (the same on every rank; each rank takes its rows)."""
    g = torch.Generator().manual_seed(100 + step)
    if kind == "toy":
        return torch.randint(0, 37, (BATCH, 4), generator=g), torch.randn(BATCH, 4, 5, generator=g)
    tokens = torch.randint(0, TINY.vocab_size, (BATCH, TINY.context_length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def rows_of(rank: int, world: int) -> slice:
    per = BATCH // world
    return slice(rank * per, (rank + 1) * per)


def loss_of(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y) if kind == "toy" else cross_entropy(out, y)


def default_units(model: nn.Module) -> tuple[list[str], list[str]]:
    """The spec's default, worked out here: (unit module names, parameter names of no unit)."""
    units = [n for n, m in model.named_modules() if any(p.dim() >= 2 for p in m.parameters(recurse=False))]
    in_units = {f"{u}.{n}" for u in units for n, _ in model.get_submodule(u).named_parameters()}
    return units, [n for n, _ in model.named_parameters() if n not in in_units]


def forward_cast(model: nn.Module, x: torch.Tensor, compute_dtype: torch.dtype | None) -> torch.Tensor:
    """The model with its units' parameters cast to ``compute_dtype`` (the others stay fp32), as FSDP computes."""
    if compute_dtype is None:
        return model(x)
    _, replicated = default_units(model)
    params = {n: p if n in replicated else p.to(compute_dtype) for n, p in model.named_parameters()}
    return torch.func.functional_call(model, params, (x,))


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    cls, options = OPTIMIZERS[name]
    return cls(params, **options)


class DriftBound:
    """How far two runs of an optimizer can drift apart when each step's gradient may differ by ``eps``.

    ``add(grad, eps, param)`` after each step, with the step's gradient, a per-element bound on its
    error and the parameter after the step; ``bound`` is then a per-element bound on the parameter
    difference, to first order. The tests allow four times the bound: the analysis leaves out how a
    difference changes the later gradients, and a reduction in another valid order (pre-divided, an
    all-reduce then a slice, another ring) rounds differently from the one measured here.

    * SGD with momentum β: the buffer's error is ``δb_t = β·δb_{t−1} + ε_t``; the parameter's grows by
      ``lr·δb_t``.
    * AdamW: ``δm_t = β₁·δm_{t−1} + (1−β₁)·ε_t``, ``δv_t = β₂·δv_{t−1} + (1−β₂)·2|g_t|·ε_t``; the update
      ``lr·m̂/(√v̂ + eps)`` then moves by at most ``lr·(δm̂/(√v̂+eps) + |m̂|·δv̂ / (2√v̂·(√v̂+eps)²))``. Where
      a gradient nearly cancels (|g| ≪ its error), ``√v̂`` is small and the bound grows, as it must:
      Adam divides by the gradient's own size.
    * Wherever the two runs already differ, each stored result (buffer, moment, parameter) may also
      round to a neighbouring float: one ulp, at most ``2u·|x|``, per rounding.
    """

    def __init__(self, optimizer: str, shape: torch.Size) -> None:
        self.name, (_, self.options) = optimizer, OPTIMIZERS[optimizer]
        zeros = torch.zeros(shape, dtype=torch.float64)
        self.bound, self.b, self.db, self.m, self.dm, self.v, self.dv, self.t = (zeros,) * 7 + (0,)

    def add(self, grad: torch.Tensor, eps: torch.Tensor, param: torch.Tensor) -> None:
        g, e, p, o = grad.double(), eps.double(), param.detach().double(), self.options
        differs = ((e > 0) | (self.bound > 0)).double()
        ulp = 2 * U32 * differs  # one rounding to a neighbouring float, relative, where the runs differ
        self.t += 1
        if "sgd" in self.name:
            self.b = o["momentum"] * self.b + g if self.t > 1 else g
            self.db = o["momentum"] * self.db + e + 2 * ulp * self.b.abs()  # two roundings: mul_, add_
            self.bound = self.bound + o["lr"] * self.db + 2 * ulp * p.abs()
            return
        b1, b2 = o["betas"]
        self.m, self.v = b1 * self.m + (1 - b1) * g, b2 * self.v + (1 - b2) * g * g
        self.dm = b1 * self.dm + (1 - b1) * e + 2 * ulp * self.m.abs()
        self.dv = b2 * self.dv + (1 - b2) * 2 * g.abs() * e + 3 * ulp * self.v
        m_hat, v_hat = self.m / (1 - b1**self.t), self.v / (1 - b2**self.t)
        dm_hat, dv_hat = self.dm / (1 - b1**self.t), self.dv / (1 - b2**self.t)
        root = v_hat.sqrt()
        update = m_hat.abs() / (root + o["eps"])
        step = (dm_hat / (root + o["eps"]) + m_hat.abs() * dv_hat / (2 * root.clamp_min(1e-30) * (root + o["eps"]) ** 2)
                + 4 * ulp * update)  # and the roundings of sqrt, add, div, bias corrections
        self.bound = self.bound + o["lr"] * step * differs + 3 * ulp * p.abs()  # decay, then the update


def reference_run(kind: str, optimizer: str, world: int | list[int], *, compute_dtype: torch.dtype | None = None,
                  steps: int = STEPS) -> dict[str, Any]:
    """Single-process training that does FSDP's arithmetic, and single-process training on the whole batch.

    ``world`` may be a list: the number of ranks of each step (a run resumed at another world size).
    Returns ``same`` (parameters after ``steps`` steps, each rank's rows run separately and the gradients
    averaged in rank order), ``whole`` (the whole batch at once) and ``whole_first`` (after its first step),
    and per-element drift bounds: ``order_bound`` for a different order of the average's fp32 sum,
    ``whole_bound`` and ``whole_first_bound`` for the whole batch.
    """
    unit_dtype = compute_dtype or torch.float32
    u_compute = {torch.float32: U32, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[unit_dtype]
    same, whole = make_model(kind), make_model(kind)
    opt_same, opt_whole = make_optimizer(optimizer, same.parameters()), make_optimizer(optimizer, whole.parameters())
    order = {n: DriftBound(optimizer, p.shape) for n, p in same.named_parameters()}
    to_whole = {n: DriftBound(optimizer, p.shape) for n, p in same.named_parameters()}
    worlds = world if isinstance(world, list) else [world] * steps
    for step, world in enumerate(worlds):
        x, y = batch(kind, step)
        per_rank = []
        for r in range(world):
            same.zero_grad(set_to_none=True)
            loss_of(kind, forward_cast(same, x[rows_of(r, world)], compute_dtype), y[rows_of(r, world)]).backward()
            per_rank.append({n: p.grad.clone() for n, p in same.named_parameters()})
        errors = {}
        for n, p in same.named_parameters():
            total = per_rank[0][n]
            for grads in per_rank[1:]:
                total = total + grads[n]
            p.grad = total / world
            abs_mean = sum(g[n].abs() for g in per_rank) / world
            # The average of N fp32 numbers, summed in another order: N−1 roundings of partial sums and
            # one of the division, each at most u times the sum of magnitudes.
            # The whole batch sums the K rows (tokens) of each weight gradient in another order (K·u, at
            # the per-rank gradients' scale), and rounds it to the compute dtype once instead of once per
            # rank: 4u_c·mean|g_r| covers both roundings and the short low-precision sums inside (an
            # embedding row's gradient adds a token's few occurrences).
            errors[n] = (p.grad.clone(), world * U32 * abs_mean, (4 * u_compute + (x.numel() + world) * U32) * abs_mean)
        opt_same.step()
        for n, p in same.named_parameters():
            grad, to_order, to_batch = errors[n]
            order[n].add(grad, to_order, p)
            to_whole[n].add(grad, to_batch, p)
        opt_whole.zero_grad(set_to_none=True)
        loss_of(kind, forward_cast(whole, x, compute_dtype), y).backward()
        opt_whole.step()
        if step == 0:
            first = {"whole_first": snapshot(whole),
                     "whole_first_bound": {n: b.bound.float() for n, b in to_whole.items()}}
    return {"same": snapshot(same), "whole": snapshot(whole), **first,
            "order_bound": {n: b.bound.float() for n, b in order.items()},
            "whole_bound": {n: b.bound.float() for n, b in to_whole.items()}}


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def fsdp_train(impl: Any, kind: str, optimizer: str, *, steps: int = STEPS, group: Any = None,
               seed: int = 1234, first: dict | None = None, calib: float | None = None,
               **fsdp_options: Any) -> tuple[Any, torch.optim.Optimizer]:
    """FSDP on this rank's rows of each step's batch; ranks of ``group`` only. ``first`` receives the full
    parameters after the first step, if given; ``calib`` fills an extra (unused) buffer, if given."""
    model = make_model(kind, seed)
    if calib is not None:
        model.register_buffer("calib", torch.full((3,), calib))
    fsdp = impl.fsdp.FSDP(model, process_group=group, **fsdp_options)
    opt = make_optimizer(optimizer, fsdp.parameters())
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for step in range(steps):
        x, y = batch(kind, step)
        opt.zero_grad(set_to_none=True)
        loss_of(kind, fsdp(x[rows_of(rank, world)]), y[rows_of(rank, world)]).backward()
        fsdp.finish_gradient_synchronization()
        opt.step()
        if step == 0 and first is not None:
            first.update(fsdp.gather_full_params())
    return fsdp, opt


# ----------------------------------------------------------------------------------------------------
# Memory: which storages hold gathered weights, and how many units are alive at once
# ----------------------------------------------------------------------------------------------------

_GATHERS = {"allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_coalesced_"}
# Ops that move data from one tensor into another without computing with it: a copy of a gathered
# weight is a gathered weight. (Views share the storage and need no rule.)
_COPIES = {"copy_", "copy", "_to_copy", "clone", "cat", "stack", "narrow_copy", "slice_copy", "split_with_sizes_copy",
           "_foreach_copy_", "_unsafe_view", "view_copy", "reshape", "contiguous", "index_copy_", "as_strided_copy"}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class GatheredTracker(TorchDispatchMode):
    """Counts the units whose gathered weights are alive, at every op, whoever allocates them.

    Every storage an all-gather writes is tagged with that all-gather (a *source*); a storage an op
    copies tagged data into inherits the tags. At every op, a tagged storage still alive and not
    resized to zero holds its sources' weights; ``peak`` is the most distinct sources alive at once
    (the units being gathered or gathered, a unit's all-gather being one source). Storages are held
    weakly, so dropping a tensor or freeing its storage (``untyped_storage().resize_(0)``) both count.

    A backend may hold a collective's output for a moment after ``wait()`` returns (gloo's worker thread
    drops it once it gets the GIL). So a count above ``limit`` is only believed if it persists while
    this thread sleeps for up to 0.25 s; after one such confirmed excess, no more waiting.
    """

    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        self.limit, self.confirmed = limit, False
        from torch.multiprocessing.reductions import StorageWeakRef

        self._weak = StorageWeakRef
        self.tags: dict[int, tuple[Any, set[int]]] = {}  # storage id → (weak ref, sources)
        self.sources = 0
        self.peak = 0
        self.counting = True

    def _key(self, t: torch.Tensor) -> int | None:
        try:
            return t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return None

    def _tag(self, t: torch.Tensor, sources: set[int]) -> None:
        key = self._key(t)
        if key is not None:
            self.tags[key] = (self._weak(t.untyped_storage()), set(sources))

    def live(self) -> set[int]:
        """Sources with an allocated storage now; forgets storages that died or were freed."""
        alive: set[int] = set()
        for key, (ref, sources) in list(self.tags.items()):
            if ref.expired():
                del self.tags[key]
                continue
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is None or storage.nbytes() == 0:
                sources.clear()  # freed: what is copied in later is a new gather
            else:
                alive |= sources
        return alive

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
        if func.namespace == "c10d" and func._opname in _GATHERS:
            self.sources += 1
            for t in _tensors(args[0]):
                self._tag(t, {self.sources})
        elif name in _COPIES:
            inputs = _tensors(list(args[1:]) if name.endswith("_") else list(args)) + _tensors(list(kwargs.values()))
            sources = set().union(*(self.tags.get(self._key(t), (None, set()))[1] for t in inputs)) if inputs else set()
            if sources:
                for t in _tensors(args[0] if name.endswith("_") else out):
                    self._tag(t, sources)
        if self.counting:
            count = len(self.live())
            pause = 0.002
            while self.limit is not None and count > self.limit and not self.confirmed and pause < 0.3:
                time.sleep(pause)
                count, pause = len(self.live()), 2 * pause
            self.confirmed |= self.limit is not None and count > self.limit
            self.peak = max(self.peak, count)
        return out


def memory_check(kind: str, prefetches: tuple[int, ...], group: Any = None) -> dict[str, Any]:
    """One traced step (after a first one that records the order) for each prefetch, plus bytes held."""
    impl = kit.impl.load()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out: dict[str, Any] = {"peak": {}, "after_step": {}}
    for prefetch in prefetches:
        fsdp, opt = fsdp_train(impl, kind, "adamw", steps=1, group=group, prefetch=prefetch)
        x, y = batch(kind, 1)
        tracker = GatheredTracker(limit=prefetch + 1)
        with tracker:
            opt.zero_grad(set_to_none=True)
            loss_of(kind, fsdp(x[rows_of(rank, world)]), y[rows_of(rank, world)]).backward()
            fsdp.finish_gradient_synchronization()
            opt.step()
            tracker.counting = False
            out["after_step"][prefetch] = len(tracker.live())
        out["peak"][prefetch] = tracker.peak
        out["units"] = len(fsdp.unit_names)
    out["params"] = {n: (tuple(p.shape), p.dtype) for n, p in fsdp.module.named_parameters()}
    out["grads"] = {n: (tuple(p.grad.shape), p.grad.dtype) for n, p in fsdp.module.named_parameters()
                    if p.grad is not None}
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in fsdp.parameters())
    out["optimizer_bytes"] = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                                 if isinstance(v, torch.Tensor))
    out["unit_names"], out["replicated_names"] = fsdp.unit_names, fsdp.replicated_names
    out["unit_shapes"], out["replicated_shapes"] = fsdp.unit_shapes, fsdp.replicated_shapes
    return out


# ----------------------------------------------------------------------------------------------------
# The checks each rank runs
# ----------------------------------------------------------------------------------------------------


def training_check(runs: list[tuple[str, str, torch.dtype | None]], group: Any = None) -> dict[str, Any]:
    """FSDP and the references for each (model, optimizer, compute dtype)."""
    impl = kit.impl.load()
    world = dist.get_world_size(group)
    out = {}
    for kind, optimizer, dtype in runs:
        first: dict[str, torch.Tensor] = {}
        fsdp, opt = fsdp_train(impl, kind, optimizer, compute_dtype=dtype, first=first, group=group)
        result = reference_run(kind, optimizer, world, compute_dtype=dtype)
        result["fsdp"], result["fsdp_first"] = fsdp.gather_full_params(), first
        result["dtypes"] = sorted({str(p.dtype) for p in fsdp.parameters()} | {str(p.grad.dtype) for p in
                                  fsdp.parameters() if p.grad is not None} | {str(v.dtype) for s in opt.state.values()
                                  for k, v in s.items() if isinstance(v, torch.Tensor) and k != "step"})
        out[f"{kind}/{optimizer}/{str(dtype).removeprefix('torch.')}"] = result
    return out


def construction_check(group: Any = None) -> dict[str, Any]:
    """Ranks start from different weights; afterwards all hold rank 0's, sharded. And bad input."""
    impl = kit.impl.load()
    model = make_model("toy", seed=10 + dist.get_rank(group))
    model.register_buffer("calib", torch.full((3,), float(dist.get_rank())))  # a buffer that differs by rank
    fsdp = impl.fsdp.FSDP(model, process_group=group, prefetch=0)
    out = {"gathered": fsdp.gather_full_params(), "state_dict": fsdp.state_dict(),
           "shards": {n: (tuple(p.shape), p.dtype) for n, p in fsdp.module.named_parameters()},
           "unit_names": fsdp.unit_names, "replicated_names": fsdp.replicated_names}
    bad = {
        "module without parameters": lambda: impl.fsdp.FSDP(nn.Sequential(nn.ReLU())),
        "module not a Module": lambda: impl.fsdp.FSDP("model"),
        "prefetch=-1": lambda: impl.fsdp.FSDP(make_model("toy"), prefetch=-1),
        "prefetch=1.5": lambda: impl.fsdp.FSDP(make_model("toy"), prefetch=1.5),
        "compute_dtype=float8": lambda: impl.fsdp.FSDP(make_model("toy"), compute_dtype=torch.float8_e4m3fn),
        "compute_dtype=int32": lambda: impl.fsdp.FSDP(make_model("toy"), compute_dtype=torch.int32),
        "compute_dtype='bf16'": lambda: impl.fsdp.FSDP(make_model("toy"), compute_dtype="bf16"),
        "units=42": lambda: impl.fsdp.FSDP(make_model("toy"), units=42),
    }
    out["bad"] = {}
    for what, build in bad.items():
        try:
            build()
            out["bad"][what] = None
        except Exception as exc:  # noqa: BLE001 — the test judges the type and the message
            out["bad"][what] = (type(exc).__name__, str(exc))
    return out


def subgroup_check(group: Any) -> dict[str, Any] | None:
    """FSDP over ranks [1, 2] of 3, starting from different weights: global rank 1's win."""
    if dist.get_rank() not in SUBGROUP:
        return None
    impl = kit.impl.load()
    fsdp, _ = fsdp_train(impl, "transformer", "sgd", group=group, seed=1234 + 7 * (dist.get_rank() - 1),
                         calib=float(dist.get_rank()))
    return {"fsdp": fsdp.gather_full_params(), "reference": reference_run("transformer", "sgd", 2)["same"],
            "calib": fsdp.state_dict()["calib"]}


COMM_CONFIGS = {  # name → FSDP options for a counted step of the Transformer
    "reshard/fp32/prefetch1": {"prefetch": 1},
    "keep/fp32/prefetch1": {"prefetch": 1, "reshard_after_forward": False},
    "reshard/bf16/prefetch1": {"prefetch": 1, "compute_dtype": torch.bfloat16},
    "reshard/fp32/prefetch0": {"prefetch": 0},
}


def counted_step(fsdp: Any, opt: torch.optim.Optimizer, step: int, group: Any = None, micro_batches: int = 1,
                 no_sync_first: bool = False) -> CommLog:
    """One training step under a CommLog, with a mark at the start and end of every unit's forward.

    The marks come from hooks registered after FSDP's own, so "fwd start" follows FSDP's pre-forward
    work and "fwd end" follows its post-forward work: between them the unit computes.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    x, y = batch("transformer", step)
    mine = list(range(BATCH))[rows_of(rank, world)]
    parts = [mine[: len(mine) - 1], mine[len(mine) - 1 :]] if micro_batches == 2 else [mine]
    log = CommLog()
    handles = []
    for name in fsdp.unit_names:
        module = fsdp.module.get_submodule(name)
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: log.mark(f"fwd start {n}")))
        handles.append(module.register_forward_hook(lambda m, a, o, n=name: log.mark(f"fwd end {n}")))
    with log:
        opt.zero_grad(set_to_none=True)
        for i, rows in enumerate(parts):
            deferred = no_sync_first and i == 0
            with fsdp.no_sync() if deferred else _nothing():
                log.mark(f"micro-batch {i}{' (no_sync)' if deferred else ''}")
                loss_of("transformer", fsdp(x[rows]), y[rows]).backward()
                log.mark("backward returned")
        fsdp.finish_gradient_synchronization()
        log.mark("finish returned")
        opt.step()
    for h in handles:
        h.remove()
    return log


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def comm_check(group: Any = None) -> dict[str, Any]:
    """Step 1 records the order; step 2 is counted, for each configuration."""
    impl = kit.impl.load()
    out: dict[str, Any] = {}
    for name, options in COMM_CONFIGS.items():
        fsdp, opt = fsdp_train(impl, "transformer", "adamw", steps=1, group=group, **options)
        log = counted_step(fsdp, opt, 1, group)
        out[name] = {"events": log.events,
                     "replicated_grads": {n: p.grad.clone() for n, p in fsdp.module.named_parameters()
                                          if n in fsdp.replicated_names}}
    return out


def no_sync_check(group: Any = None) -> dict[str, Any]:
    """Two micro-batches per step, the first inside no_sync, against the same accumulation in one process."""
    impl = kit.impl.load()
    fsdp, opt = fsdp_train(impl, "transformer", "sgd", steps=1, group=group)
    log = counted_step(fsdp, opt, 1, group, micro_batches=2, no_sync_first=True)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    model = make_model("transformer")
    ref_opt = make_optimizer("sgd", model.parameters())
    for step in range(2):
        x, y = batch("transformer", step)
        grads = []
        for r in range(world):
            rows = list(range(BATCH))[rows_of(r, world)]
            parts = [rows[: len(rows) - 1], rows[len(rows) - 1 :]] if step == 1 else [rows]
            model.zero_grad(set_to_none=True)
            for part in parts:  # autograd adds the micro-batches' gradients, as FSDP must
                loss_of("transformer", model(x[part]), y[part]).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for n, p in model.named_parameters():
            total = grads[0][n]
            for g in grads[1:]:
                total = total + g[n]
            p.grad = total / world
        ref_opt.step()
    return {"events": log.events, "fsdp": fsdp.gather_full_params(), "reference": snapshot(model), "rank": rank}


def rank_checks() -> dict:
    """Every check, in one 3-rank spawn (starting ranks costs seconds each). The 2-rank checks run on the
    group of ranks 0 and 1 while rank 2 waits; the 3-rank checks on all three."""
    pair, sub = dist.new_group(PAIR), dist.new_group(SUBGROUP)  # every rank creates every group, in order
    member = dist.get_rank() in PAIR

    def on_pair(check: Any) -> Any:
        return lambda: check(pair) if member else None

    return run_checks({
        "two/construction": on_pair(construction_check),
        "two/train_fp32": on_pair(lambda g: training_check([("toy", "sgd", None), ("toy", "adamw", None),
                                                            ("transformer", "sgd", None),
                                                            ("transformer", "adamw", None)], g)),
        "two/train_mixed": on_pair(lambda g: training_check([("transformer", "sgd", torch.bfloat16),
                                                             ("transformer", "adamw", torch.bfloat16),
                                                             ("toy", "sgd", torch.float16),
                                                             ("transformer", "adamw", torch.float16)], g)),
        "two/memory": on_pair(lambda g: memory_check("transformer", (0, 1, 2), g)),
        "two/comm": on_pair(comm_check),
        "two/no_sync": on_pair(no_sync_check),
        "three/train_fp32": lambda: training_check([("toy", "sgd", None), ("transformer", "sgd", None),
                                                    ("transformer", "adamw", None)]),
        "three/memory": lambda: memory_check("toy", (1,)),
        "three/subgroup": lambda: subgroup_check(sub),
    })


class Members:
    """The values of one group's checks in the spawn: ``values(name)`` reads ``<prefix>/<name>`` on its ranks."""

    def __init__(self, checks: Any, prefix: str, ranks: list[int]) -> None:
        self.checks, self.prefix, self.ranks = checks, prefix, ranks

    def values(self, name: str) -> list[Any]:
        values = self.checks.values(f"{self.prefix}/{name}")
        return [values[r] for r in self.ranks]


spawn = spawned_checks(rank_checks, 3, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def two_ranks(spawn: Any) -> Members:
    return Members(spawn, "two", PAIR)


@pytest.fixture(scope="module")
def three_ranks(spawn: Any) -> Members:
    return Members(spawn, "three", [0, 1, 2])


# ----------------------------------------------------------------------------------------------------
# Helpers of the tests
# ----------------------------------------------------------------------------------------------------


def compare(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str, section: str,
            bound: dict[str, torch.Tensor] | None = None) -> None:
    """Bit for bit when ``bound`` is None, else ``|actual − expected| ≤ 4·bound`` element by element."""
    assert_equal(sorted(actual), sorted(expected), name=f"{what}: parameter names", section=section)
    for name, value in expected.items():
        if bound is None:
            assert_close(actual[name], value, name=f"{what}: {name} (bit for bit)", section=section, rtol=0, atol=0)
            continue
        allowed = 4 * bound[name].double() + 1e-12
        err = (actual[name].double() - value.double()).abs()
        if (err > allowed).any():
            i = int((err - allowed).flatten().argmax())
            raise AssertionError(
                f"{what}: {name} differs from the reference by {err.flatten()[i]:.3g} at flat index {i}, more "
                f"than four times the rounding bound there ({allowed.flatten()[i]:.3g}); {int((err > allowed).sum())} "
                f"of {err.numel()} elements are outside. A rounding difference cannot explain that. See {section}.")


def expected_shard_shape(shape: tuple[int, ...], world: int) -> tuple[int, ...]:
    return (math.ceil(shape[0] / world), *shape[1:])


# ----------------------------------------------------------------------------------------------------
# Sharding and construction
# ----------------------------------------------------------------------------------------------------


@pytest.mark.points(1)
def test_take_shard_pads_the_last_ranks(impl) -> None:
    full = torch.arange(64 * 3, dtype=torch.float32).view(64, 3)
    shards = [impl.fsdp.take_shard(full, 3, r) for r in range(3)]
    for r, shard in enumerate(shards):
        assert_equal(tuple(shard.shape), (22, 3), name=f"take_shard of a (64, 3) tensor, rank {r} of 3: shape "
                     "(⌈64/3⌉ = 22 rows each)", section="handout 05b §1")
    assert_close(torch.cat(shards)[:64], full, name="the 3 shards concatenated, first 64 rows",
                 section="handout 05b §1", rtol=0, atol=0)
    assert_close(shards[2][20:], torch.zeros(2, 3), name="rank 2's last two rows (padding)", section="handout 05b §1",
                 rtol=0, atol=0)
    tiny = torch.ones(1, 5)  # fewer rows than ranks: rank 1's shard is all padding
    assert_close(impl.fsdp.take_shard(tiny, 2, 1), torch.zeros(1, 5), name="rank 1's shard of a 1-row tensor",
                 section="handout 05b §1", rtol=0, atol=0)
    assert impl.fsdp.take_shard(full, 3, 0).data_ptr() != full.data_ptr(), (
        "take_shard must return a new tensor, not a view: the full tensor has to be freeable. See handout 05b §1.")


@pytest.mark.points(3)
def test_construction_shards_and_agrees(two_ranks) -> None:
    results = two_ranks.values("construction")
    source = make_model("toy", seed=10)  # rank 0's initial weights: the group's first rank is the source
    units, replicated = default_units(source)
    for rank, r in enumerate(results):
        assert_equal(r["unit_names"], units, name=f"rank {rank}: unit_names (every module that directly owns a "
                     "parameter of 2+ dims, in module order)", section="handout 05b §2")
        assert_equal(r["replicated_names"], replicated, name=f"rank {rank}: replicated_names", section="handout 05b §2")
        for name, p in source.named_parameters():
            shape = tuple(p.shape) if name in replicated else expected_shard_shape(tuple(p.shape), 2)
            assert_equal(r["shards"][name], (shape, torch.float32), name=f"rank {rank}: (shape, dtype) of "
                         f"fsdp.module.{name} between steps", section="handout 05b §2")
        compare(r["gathered"], snapshot(source), f"rank {rank}: gather_full_params() after construction, ranks "
                "having started from different weights (rank 0's must win)", "handout 05b §2")
        compare(r["state_dict"], {**source.state_dict(), "calib": torch.zeros(3)}, f"rank {rank}: state_dict() "
                "after construction (buffer calib started as the rank's number: rank 0's must win too)",
                "handout 05b §2, §6")


@pytest.mark.points(1)
def test_fsdp_bad_inputs_raise_clear_errors(two_ranks) -> None:
    two_ranks.values("construction")  # FSDP must work before its errors are graded
    expected = {"module without parameters": ("ValueError", "module"), "module not a Module": ("TypeError", "module"),
                "prefetch=-1": ("ValueError", "prefetch"), "prefetch=1.5": ("TypeError", "prefetch"),
                "compute_dtype=float8": ("ValueError", "compute_dtype"),
                "compute_dtype=int32": ("ValueError", "compute_dtype"),
                "compute_dtype='bf16'": ("TypeError", "compute_dtype"), "units=42": ("TypeError", "units")}
    for what, (kind, argument) in expected.items():
        got = two_ranks.values("construction")[0]["bad"][what]
        assert got is not None, f"FSDP({what}) must raise {kind} naming {argument!r}; it raised nothing"
        assert got[0] == kind and argument in got[1], (
            f"FSDP({what}) must raise {kind} naming {argument!r}, got {got[0]}: {got[1]}")


# ----------------------------------------------------------------------------------------------------
# Training equals single-process training
# ----------------------------------------------------------------------------------------------------


@pytest.mark.points(5)
def test_fp32_matches_single_process_bit_for_bit_at_two_ranks(two_ranks) -> None:
    """Each rank's forward and backward are the single process's on the same rows, bit for bit; the
    average of two fp32 numbers is exact in either order (a+b = b+a, and /2 is exact)."""
    for key, runs in _per_run(two_ranks.values("train_fp32")):
        for rank, r in enumerate(runs):
            compare(r["fsdp"], r["same"], f"rank {rank} of the 2-rank group {PAIR} (of 3 ranks), {key}, {STEPS} "
                    "steps: gather_full_params() vs single-process training averaging the ranks' gradients",
                    "handout 05b §5")


@pytest.mark.points(3)
def test_fp32_matches_at_three_ranks_uneven_shards(three_ranks) -> None:
    """Three fp32 numbers can be summed in another order (the reduce-scatter's), so the bound of
    DriftBound with ε = N·u·mean|g_r| applies (four times it, for what first-order analysis leaves out)."""
    for key, runs in _per_run(three_ranks.values("train_fp32")):
        for rank, r in enumerate(runs):
            compare(r["fsdp"], r["same"], f"rank {rank} of 3, {key}: gather_full_params() vs single-process "
                    "training averaging the ranks' gradients", "handout 05b §5", bound=r["order_bound"])


@pytest.mark.points(2)
def test_sgd_matches_whole_batch_training(two_ranks, three_ranks) -> None:
    """Against the ground truth: one process, the whole batch. SGD only: its update is linear in the
    gradient, so rounding-sized gradient differences stay rounding-sized (Adam's need not, handout 05b §8)."""
    for world, checks in ((2, two_ranks), (3, three_ranks)):
        for key, runs in _per_run(checks.values("train_fp32")):
            if "/sgd/" in key:
                for rank, r in enumerate(runs):
                    compare(r["fsdp"], r["whole"], f"rank {rank} of {world}, {key}: FSDP vs single-process SGD on "
                            "the whole batch", "handout 05b §5", bound=r["whole_bound"])


@pytest.mark.points(4)
def test_mixed_precision_matches_the_same_casts(two_ranks) -> None:
    """compute_dtype bf16/fp16: the single process casts the units' weights the same way. Bit for bit
    (reductions in fp32 are exact at 2 ranks); parameters, gradients and optimizer state stay fp32. And
    after one step, within the compute dtype's rounding bound of the whole batch: from the second step
    on the master weights differ by a rounding, so their casts may land on neighbouring 16-bit values
    and the whole-batch run is no longer a rounding away (handout 05b §8)."""
    for key, runs in _per_run(two_ranks.values("train_mixed")):
        for rank, r in enumerate(runs):
            assert_equal(r["dtypes"], ["torch.float32"], name=f"rank {rank}, {key}: dtypes of the parameters, their "
                         "gradients and the optimizer state (master copies stay fp32)", section="handout 05b §8")
            where = f"rank {rank} of the 2-rank group {PAIR} (of 3 ranks), {key}"
            compare(r["fsdp"], r["same"], f"{where}: gather_full_params() vs the single process casting the units' "
                    "weights the same way", "handout 05b §8")
            compare(r["fsdp_first"], r["whole_first"], f"{where}, after one step: vs the same casts on the whole "
                    "batch", "handout 05b §8", bound=r["whole_first_bound"])


def _per_run(results: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    return [(key, [r[key] for r in results]) for key in results[0]]


# ----------------------------------------------------------------------------------------------------
# Memory, measured
# ----------------------------------------------------------------------------------------------------


@pytest.mark.points(3)
def test_gathered_units_never_exceed_prefetch_plus_one(two_ranks, three_ranks) -> None:
    for world, checks in ((2, two_ranks), (3, three_ranks)):
        for rank, r in enumerate(checks.values("memory")):
            for prefetch, peak in r["peak"].items():
                assert peak <= prefetch + 1, (
                    f"rank {rank} of {world}, prefetch={prefetch}: {peak} units' gathered weights were alive at once "
                    f"(of {r['units']}); at most prefetch + 1 = {prefetch + 1} may be. Free each unit's full weights "
                    "after its forward and after its backward (resize the storage to 0: autograd still holds the "
                    "tensor). See handout 05b §3–4.")
                assert r["after_step"][prefetch] == 0, (
                    f"rank {rank} of {world}, prefetch={prefetch}: {r['after_step'][prefetch]} units still gathered "
                    "after finish_gradient_synchronization() and the step; between steps only shards may be "
                    "alive. See handout 05b §3.")


@pytest.mark.points(2)
def test_bytes_held_between_steps_are_the_shards(two_ranks, three_ranks, impl) -> None:
    for world, checks, kind in ((2, two_ranks, "transformer"), (3, three_ranks, "toy")):
        model = make_model(kind)
        units, replicated = default_units(model)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        held = sum(math.prod(expected_shard_shape(s, world) if n not in replicated else s) for n, s in shapes.items())
        for rank, r in enumerate(checks.values("memory")):
            for name, shape in shapes.items():
                want = shape if name in replicated else expected_shard_shape(shape, world)
                assert_equal(r["params"][name], (want, torch.float32), name=f"rank {rank} of {world}: {name} (shape, "
                             "dtype) between steps", section="handout 05b §2")
                assert_equal(r["grads"].get(name), (want, torch.float32), name=f"rank {rank} of {world}: {name}.grad "
                             "(shape, dtype) after finish_gradient_synchronization()", section="handout 05b §5")
            assert_equal(r["param_bytes"], 4 * held, name=f"rank {rank} of {world}: parameter bytes between steps "
                         "(⌈rows/N⌉·rest per sharded parameter, replicated whole)", section="handout 05b §7")
            assert_equal(r["optimizer_bytes"] - 4 * len(shapes), 8 * held, name=f"rank {rank} of {world}: AdamW "
                         "state bytes besides the step counters (two fp32 moments per element held)",
                         section="handout 05b §7")
            unit_shapes = [[shapes[f"{u}.{n}"] for n, _ in model.get_submodule(u).named_parameters()] for u in units]
            acc = impl.fsdp.fsdp_accounting(unit_shapes, [shapes[n] for n in replicated], world)
            assert_equal((acc.param_bytes, acc.grad_bytes, acc.optimizer_bytes), (4 * held, 4 * held, 8 * held),
                         name=f"fsdp_accounting(...) at {world} ranks: (param, grad, optimizer) bytes",
                         section="handout 05b §7")


# ----------------------------------------------------------------------------------------------------
# Process groups
# ----------------------------------------------------------------------------------------------------


@pytest.mark.points(2)
def test_subgroup_not_starting_at_rank_zero(three_ranks) -> None:
    results = three_ranks.values("subgroup")
    assert results[0] is None
    for rank in SUBGROUP:
        compare(results[rank]["fsdp"], results[rank]["reference"], f"global rank {rank}, FSDP over group {SUBGROUP} "
                "(ranks started from different weights; group rank 0 = global rank 1 is the source) vs single-process "
                "training at 2 ranks", "handout 05b §2")
        assert_close(results[rank]["calib"], torch.full((3,), float(SUBGROUP[0])), name=f"global rank {rank}, FSDP "
                     f"over group {SUBGROUP}: buffer calib (started as each rank's global number; the group's first "
                     f"rank, global {SUBGROUP[0]}, must win)", section="handout 05b §2", rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------
# Communication, counted during a real step
# ----------------------------------------------------------------------------------------------------


def transformer_layout(world: int) -> tuple[list[str], dict[str, int], list[int], int]:
    """Worked out here from the spec: unit names (in module order), each unit's shard elements per rank,
    each replicated parameter's elements, and N."""
    model = make_model("transformer")
    units, replicated = default_units(model)
    shard = {u: sum(math.prod(expected_shard_shape(tuple(p.shape), world)) for p in model.get_submodule(u).parameters())
             for u in units}
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    return units, shard, [sizes[n] for n in replicated], world


def execution_order(events: list[Event]) -> list[str]:
    """The units in the order their forwards started (SwiGLU runs w1, w3, then w2: not module order)."""
    return [e.label.removeprefix("fwd start ") for e in events if e.kind == "mark" and e.label.startswith("fwd start ")]


def context(events: list[Event], lo: int, hi: int) -> str:
    """Events ``lo..hi`` for a failure message, collectives numbered by their index."""
    return ", ".join(f"#{i} {e}" if e.kind == "collective" else str(e)
                     for i, e in enumerate(events) if max(0, lo) <= i <= hi)


def _events_between(events: list[Event], start: str, end: str) -> list[tuple[int, Event]]:
    first = next(i for i, e in enumerate(events) if e.kind == "mark" and e.label == start)
    last = next(i for i, e in enumerate(events) if e.kind == "mark" and e.label == end and i > first)
    return [(i, e) for i, e in enumerate(events) if first < i < last]


@pytest.mark.points(3)
def test_collectives_per_step_match_the_accounting(two_ranks, impl) -> None:
    units, shard, replicated, world = transformer_layout(2)
    for name, options in COMM_CONFIGS.items():
        reshard = options.get("reshard_after_forward", True)
        c = 2 if options.get("compute_dtype") is torch.bfloat16 else 4
        gathers = 2 if reshard else 1
        # What the spec implies: each unit gathered once per forward, again per backward if resharded, its
        # shards in the compute dtype; one fp32 reduce-scatter of the full padded gradient per unit; one
        # all-reduce per replicated parameter.
        expected = {"all_gather": (gathers * len(units), gathers * sum(shard.values()) * c),
                    "reduce_scatter": (len(units), world * sum(shard.values()) * 4),
                    "all_reduce": (len(replicated), 4 * sum(replicated))}
        unit_shapes = [[tuple(p.shape) for p in make_model("transformer").get_submodule(u).parameters()] for u in units]
        acc = impl.fsdp.fsdp_accounting(unit_shapes, [(n,) for n in replicated], world, reshard_after_forward=reshard,
                                        compute_bytes=c)
        assert_equal({k: (getattr(acc, k + "s"), getattr(acc, k + "_bytes")) for k in expected}, expected,
                     name=f"{name}: fsdp_accounting's (count, bytes handed in) per collective",
                     section="handout 05b §7")
        for rank, result in enumerate(two_ranks.values("comm")):
            events = result[name]["events"]
            step = [e for _, e in _events_between(events, "micro-batch 0", "finish returned") if e.kind == "collective"]
            counted = {op: (sum(e.op == op for e in step), sum(e.nbytes for e in step if e.op == op))
                       for op in expected}
            others = sorted({e.op for e in step} - set(expected))
            assert not others, f"rank {rank}, {name}: unexpected collectives in a step: {others}. See handout 05b §7."
            assert_equal(counted, expected, name=f"rank {rank}, {name}: (count, bytes handed in) per collective in "
                         f"one step, counted: {format_events(step)}", section="handout 05b §7")
            groups = {e.group for e in step}
            assert_equal(groups, {(0, 1)}, name=f"rank {rank}, {name}: the groups the collectives ran on",
                         section="handout 05b §2")


def _forward_gathers(events: list[Event], units: list[str]) -> list[int]:
    """Indices of the all-gathers issued before the last unit's forward ended: unit j's is the j-th."""
    end = next(i for i, e in enumerate(events) if e.kind == "mark" and e.label == f"fwd end {units[-1]}")
    return [i for i, e in enumerate(events) if e.kind == "collective" and e.op == "all_gather" and i < end]


def _mark(events: list[Event], label: str) -> int:
    return next(i for i, e in enumerate(events) if e.kind == "mark" and e.label == label)


def _waits_of(events: list[Event], index: int) -> list[int]:
    return [i for i, e in enumerate(events) if e.kind == "wait" and e.target == index]


def prefetch_steps(two_ranks: Members) -> list[tuple[int, str, int, list[Event], list[str]]]:
    """(rank, configuration, prefetch, the counted step's events, the units in execution order) at prefetch 1 and 0."""
    out = []
    for rank, result in enumerate(two_ranks.values("comm")):
        for name, prefetch in (("reshard/fp32/prefetch1", 1), ("reshard/fp32/prefetch0", 0)):
            events = result[name]["events"]
            step = events[_mark(events, "micro-batch 0"):]
            out.append((rank, name, prefetch, step, execution_order(step)))
    return out


@pytest.mark.points(3)
def test_prefetch_overlaps_the_forward(two_ranks) -> None:
    _, shard, _, _ = transformer_layout(2)
    for rank, name, prefetch, step, units in prefetch_steps(two_ranks):
        gathers = _forward_gathers(step, units)
        assert_equal([step[i].nbytes // 4 for i in gathers], [shard[u] for u in units], name=f"rank {rank}, "
                     f"{name}: elements handed to each all-gather of the forward, in order (the j-th unit to run "
                     "is gathered j-th)", section="handout 05b §4")
        for j in range(len(units) - 1):
            here, nxt, ag = units[j], units[j + 1], gathers[j + 1]
            start, end = _mark(step, f"fwd start {here}"), _mark(step, f"fwd end {here}")
            waits = _waits_of(step, ag)
            seen = context(step, ag - 4, end + 1)
            if prefetch:
                assert step[ag].async_op and ag < end, (
                    f"rank {rank}, prefetch=1: the all-gather of unit {nxt} must be issued asynchronously before "
                    f"unit {here}'s forward finishes, so it overlaps that compute; events: {seen}. "
                    "See handout 05b §4.")
                assert waits and min(waits) > start, (
                    f"rank {rank}, prefetch=1: the all-gather of unit {nxt} (#{ag}) was waited on before unit "
                    f"{here} computed (or never): then nothing overlaps it; events: {seen}. See handout 05b §4.")
            else:
                assert ag > end, (
                    f"rank {rank}, prefetch=0: the all-gather of unit {nxt} must wait until unit {here}'s forward "
                    f"is done (no prefetch); events: {seen}. See handout 05b §4.")
        for j, ag in enumerate(gathers):
            before = _mark(step, f"fwd start {units[j]}")
            assert step[ag].async_op is False or any(w < before for w in _waits_of(step, ag)), (
                f"rank {rank}, {name}: the all-gather of unit {units[j]} (#{ag}) was not waited on before the unit "
                f"computed with its weights: {context(step, ag, before)}. See handout 05b §3.")


@pytest.mark.points(2)
def test_backward_prefetch_and_reduce_scatter_order(two_ranks) -> None:
    """In the backward the next unit's gather (reverse order) is issued before the current unit's
    reduce-scatter with prefetch ≥ 1, after it without; each reduce-scatter starts as soon as its unit's
    gradient is ready, i.e. before the backward returns, and is waited on."""
    _, shard, _, world = transformer_layout(2)
    for rank, name, prefetch, step, units in prefetch_steps(two_ranks):
        returned = _mark(step, "backward returned")
        backward = [i for i, e in enumerate(step) if e.kind == "collective" and e.op == "all_gather"
                    and i > _mark(step, f"fwd end {units[-1]}")]
        scatters = [i for i, e in enumerate(step) if e.kind == "collective" and e.op == "reduce_scatter"]
        assert_equal([step[i].nbytes // 4 // world for i in scatters], [shard[u] for u in units[::-1]],
                     name=f"rank {rank}, {name}: shard elements of each reduce-scatter, in order (the units in "
                     "reverse)", section="handout 05b §5")
        assert all(i < returned for i in scatters) and all(step[i].async_op for i in scatters), (
            f"rank {rank}, {name}: every reduce-scatter must be issued asynchronously during the backward, as soon "
            f"as its unit's gradient is ready: {context(step, 0, len(step))}. See handout 05b §5.")
        assert all(_waits_of(step, i) for i in scatters), (
            f"rank {rank}, {name}: every reduce-scatter must be waited on (finish_gradient_synchronization). "
            "See handout 05b §5.")
        for j in range(1, len(units)):
            ag, rs = backward[j], scatters[j - 1]
            assert (ag < rs) if prefetch else (ag > rs), (
                f"rank {rank}, {name}: in the backward, the all-gather of {units[-1 - j]} (#{ag}) must be issued "
                f"{'before' if prefetch else 'after'} the reduce-scatter of {units[-j]} (#{rs}): "
                f"{context(step, min(ag, rs) - 2, max(ag, rs) + 1)}. See handout 05b §4.")


@pytest.mark.points(1)
def test_replicated_gradients_identical_on_every_rank(two_ranks) -> None:
    results = two_ranks.values("comm")
    for name in COMM_CONFIGS:
        grads = [r[name]["replicated_grads"] for r in results]
        _, replicated = default_units(make_model("transformer"))
        assert_equal(sorted(grads[0]), sorted(replicated), name=f"{name}: replicated parameters with a gradient",
                     section="handout 05b §5")
        for n in replicated:
            assert_close(grads[1][n], grads[0][n], name=f"{name}: {n}.grad on rank 1 vs rank 0 (all-reduced and "
                         "averaged)", section="handout 05b §5", rtol=0, atol=0)


@pytest.mark.points(2)
def test_no_sync_defers_reduction(two_ranks) -> None:
    units, _, replicated, _ = transformer_layout(2)
    for rank, r in enumerate(two_ranks.values("no_sync")):
        events = r["events"]
        first = [e for _, e in _events_between(events, "micro-batch 0 (no_sync)", "micro-batch 1")
                 if e.kind == "collective"]
        assert_equal(sorted({e.op for e in first}), ["all_gather"], name=f"rank {rank}: collectives of the micro-batch "
                     "inside no_sync (the all-gathers still happen; reductions wait)", section="handout 05b §6")
        second = [e for _, e in _events_between(events, "micro-batch 1", "finish returned") if e.kind == "collective"]
        assert_equal((sum(e.op == "reduce_scatter" for e in second), sum(e.op == "all_reduce" for e in second)),
                     (len(units), len(replicated)), name=f"rank {rank}: (reduce-scatters, all-reduces) of the "
                     "synchronising micro-batch", section="handout 05b §6")
        compare(r["fsdp"], r["reference"], f"rank {rank}: after a step of two micro-batches (the first in no_sync) vs "
                "one process adding the micro-batches' gradients and averaging the ranks'", "handout 05b §6")
