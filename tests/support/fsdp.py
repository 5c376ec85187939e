"""Stage 5, part two — FSDP: the harness the public and the hidden FSDP tests share (handout/05b-fsdp.md).

Both sides use it. The ranks build the models, draw the batches and train FSDP (:func:`fsdp_train`, with
the implementation they loaded), observe it (:class:`GatheredTracker`) and return data; the judge builds
the same models from the same seeds and computes what that data must be: :func:`reference_run` (single-process
training doing FSDP's arithmetic, and on the whole batch, with per-element drift bounds from
:class:`DriftBound`), then compares with :func:`compare`. Nothing here imports the implementation.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from kit.model import ModelConfig, RMSNorm, TransformerLM, cross_entropy
from kit.testing import assert_close, assert_equal

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


# ----------------------------------------------------------------------------------------------------
# Models, data and the single-process references
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

    def __init__(self, optimizer: str, shape: torch.Size, options: dict[str, Any] | None = None) -> None:
        """``options``: the parameter's group options (lr, betas, eps; momentum for SGD) where they are not
        ``OPTIMIZERS[optimizer]``'s (Stage 5's ShardedOptimizer tests give vectors their own lr)."""
        self.name, (_, self.options) = optimizer, OPTIMIZERS[optimizer]
        self.options = {**self.options, **(options or {})}
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


def whole_batch_rounding(abs_mean: torch.Tensor, tokens: int, world: int, u_compute: float = U32) -> torch.Tensor:
    """Per element, how far the average of ``world`` ranks' gradients may be from the whole batch's gradient.

    The whole batch sums the K = ``tokens`` rows of each weight gradient in another order (K·u, at the per-rank
    gradients' scale ``abs_mean`` = mean over ranks of |g_r|), the average rounds ``world`` more times, and the
    whole batch rounds to the compute dtype once instead of once per rank: 4·u_c·mean|g_r| covers both roundings
    and the short low-precision sums inside (an embedding row's gradient adds a token's few occurrences)."""
    return (4 * u_compute + (tokens + world) * U32) * abs_mean


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
            # one of the division, each at most u times the sum of magnitudes. The whole batch: see
            # whole_batch_rounding.
            errors[n] = (p.grad.clone(), world * U32 * abs_mean,
                         whole_batch_rounding(abs_mean, x.numel(), world, u_compute))
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


@functools.cache
def reference_of(kind: str, optimizer: str, world: int | tuple[int, ...], compute_dtype: torch.dtype | None = None,
                 steps: int = STEPS) -> dict[str, Any]:
    """In the judge: :func:`reference_run`, computed once per run (every rank of a run is compared with the
    same one; ``world`` a tuple for a run resumed at another world size). Read it, never change it."""
    return reference_run(kind, optimizer, list(world) if isinstance(world, tuple) else world,
                         compute_dtype=compute_dtype, steps=steps)


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
# Memory: which storages hold gathered weights or full gradients, and how many units' are alive at once
# ----------------------------------------------------------------------------------------------------

_GATHERS = {"allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_coalesced_"}
_REDUCE_SCATTERS = {"reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"}
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


class SourceTracker(TorchDispatchMode):
    """Counts the *sources* whose storages are alive, at every op, whoever allocates them.

    A source is one collective's tensors of interest (:meth:`new_source` says which, for which ops): every
    storage among them is tagged with that source, and with :attr:`follow_copies` a storage an op copies
    tagged data into inherits the tags. At every op, a tagged storage still alive and not resized to zero
    holds its sources' data; ``peak`` is the most distinct sources alive at once. Storages are held weakly,
    so dropping a tensor or freeing its storage (``untyped_storage().resize_(0)``) both count.

    A backend may hold a collective's tensors for a moment after ``wait()`` returns (gloo's worker thread
    drops them once it gets the GIL). So a count above ``limit`` is only believed if it persists while
    this thread sleeps for up to 0.25 s; after one such confirmed excess, no more waiting.
    """

    follow_copies = False

    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        self.limit, self.confirmed = limit, False
        from torch.multiprocessing.reductions import StorageWeakRef

        self._weak = StorageWeakRef
        self.tags: dict[int, tuple[Any, set[int]]] = {}  # storage id → (weak ref, sources)
        self.sources = 0
        self.peak = 0
        self.counting = True

    def new_source(self, func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensors that make up a new source if ``func`` starts one (else ``[]``)."""
        raise NotImplementedError

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
                sources.clear()  # freed: what is copied in later is a new source
            else:
                alive |= sources
        return alive

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
        tensors = self.new_source(func, args, kwargs)
        if tensors:
            self.sources += 1
            for t in tensors:
                self._tag(t, {self.sources})
        elif self.follow_copies and name in _COPIES:
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


class GatheredTracker(SourceTracker):
    """Counts the units whose gathered weights are alive: a source is one all-gather's output, and a copy of
    a gathered weight is a gathered weight (the units being gathered or gathered, a unit's all-gather being
    one source)."""

    follow_copies = True

    def new_source(self, func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        if func.namespace == "c10d" and func._opname in _GATHERS:
            return _tensors(args[0])
        return []


class ReduceScatterTracker(SourceTracker):
    """Counts the full gradients handed to reduce-scatters that are still alive: a source is one
    reduce-scatter's input (the unit's whole padded gradient, fp32), alive until the collective is finished
    and the last reference to it dropped."""

    def new_source(self, func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        if func.namespace == "c10d" and func._opname in _REDUCE_SCATTERS:
            return _tensors(args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("inputs")))
        if func.namespace == "_c10d_functional" and func._opname.startswith("reduce_scatter_tensor"):
            return _tensors(args[0] if args else kwargs.get("input"))
        return []


def check_name(group: str, name: str) -> str:
    """The check ``name`` of the ranks of ``group`` (``"two"``, ``"three"``): the one place its name is built, by the
    ranks (``run_checks``' keys) and by the judge (:meth:`Members.values`) alike."""
    return f"{group}/{name}"


def comm_check_name(config: str) -> str:
    """The communication check of configuration ``config`` (``COMM_CONFIGS``), within its group."""
    return f"comm/{config}"


class Members:
    """The values of one group's checks in the spawn: ``values(name)`` reads :func:`check_name` on its ranks."""

    def __init__(self, checks: Any, prefix: str, ranks: list[int]) -> None:
        self.checks, self.prefix, self.ranks = checks, prefix, ranks

    def values(self, name: str) -> list[Any]:
        values = self.checks.values(check_name(self.prefix, name))
        return [values[r] for r in self.ranks]



# ----------------------------------------------------------------------------------------------------
# Judging
# ----------------------------------------------------------------------------------------------------


def compare(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str, section: str,
            bound: dict[str, torch.Tensor] | None = None) -> None:
    """Bit for bit when ``bound`` is None, else ``|actual − expected| ≤ 4·bound`` element by element."""
    assert_equal(sorted(actual), sorted(expected), name=f"{what}: parameter names", section=section)
    for name, value in expected.items():
        if bound is None:
            assert_close(actual[name], value, name=f"{what}: {name} (bit for bit)", section=section, rtol=0, atol=0)
            continue
        # + 1e-12: where the bound is 0 (the runs cannot differ) this is still exactness for |x| ≥ 2⁻¹⁶ ≈ 1.5e-5,
        # whose fp32 ulp (≥ 2⁻³⁹ ≈ 1.8e-12) exceeds it; it forgives only differences in elements that are nearly 0.
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



def shard_of(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """In the judge: rank ``rank``'s dim-0 shard of ``full``, worked out from the spec (handout 05b §1)."""
    rows = full.shape[0]
    per_rank = math.ceil(rows / world)
    padded = torch.cat([full, full.new_zeros((world * per_rank - rows, *full.shape[1:]))])
    return padded[rank * per_rank : (rank + 1) * per_rank].clone()
