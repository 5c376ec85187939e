"""Stage 5, part two — fully sharded data parallel (FSDP, ZeRO stage 3) from scratch (handout/05b-fsdp.md).

ZeRO-1 (``zero.py``) shards the optimizer state; every rank still holds every weight and every
gradient. FSDP shards those too. Between steps each rank keeps 1/N of every large weight. A layer's
full weight exists only while that layer computes: it is all-gathered just before, and dropped just
after. Its gradient is reduce-scattered straight back to the shards.

    model = FSDP(TransformerLM(cfg), compute_dtype=torch.bfloat16, prefetch=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # sees the fp32 shards only
    for x, y in my_part_of_the_data:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()            # all-gather, compute, free; reduce-scatter the grads
        model.finish_gradient_synchronization()    # every .grad is the average over the ranks, sharded
        optimizer.step()                           # updates the shards in place

Sharding is per parameter along dim 0, as in PyTorch's FSDP2 (``fully_shard``): parameter ``p`` of shape
``(rows, *rest)`` is padded with zero rows to a multiple of N and rank r keeps rows ``[r·R, (r+1)·R)``,
``R = ⌈rows/N⌉``. FSDP1 flattened a whole unit into one padded 1-D buffer instead (handout 05b §1).

A *unit* is the group of parameters gathered together: by default every module that directly owns a
parameter of two or more dimensions (``nn.Linear``, ``nn.Embedding``, a course's own Linear). The
parameters of no unit (norm gains, say) stay replicated, and their gradients are all-reduced, as DDP
does. :func:`fsdp_accounting` does the bookkeeping: bytes per rank and bytes per collective per step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kit import validate

__all__ = ["FSDP", "FSDPAccounting", "fsdp_accounting", "take_shard"]

COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# torch 2.13 renamed the tensor forms of the two collectives; older builds (a CUDA install) have only the
# old names. Both take (output, input, ...) and do the same thing.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ----------------------------------------------------------------------------------------------------
# The shard of one parameter
# ----------------------------------------------------------------------------------------------------


def take_shard(full: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s dim-0 shard of ``full``: a new contiguous tensor of ``R = ⌈rows/N⌉`` rows.

    ``full`` (shape ``(rows, *rest)``, any dtype) is padded with zero rows to ``N·R`` rows and cut into N
    equal pieces; rank r gets rows ``[r·R, (r+1)·R)``. The last ranks' pieces hold the padding (at 3 ranks
    a 64-row weight gives R = 22: rows 0–21, 22–43, and 44–63 plus two zero rows). Concatenating the N
    shards along dim 0 and keeping the first ``rows`` rows gives ``full`` back.

    Raises:
        TypeError: ``full`` is not a tensor, or ``world_size``/``rank`` is not an int.
        ValueError: a 0-d ``full``, ``world_size < 1`` or ``rank`` outside ``[0, world_size)``.
    """
    validate.instance("full", full, torch.Tensor, "a tensor")
    if full.dim() < 1:
        raise ValueError("full must have at least one dimension (dim 0 is split), got a 0-d tensor")
    validate.positive_int("world_size", world_size)
    validate.index("rank", rank, world_size)
    # BEGIN SOLUTION pad dim 0 to N·⌈rows/N⌉ with zeros, keep rows [r·R, (r+1)·R) (handout 05b §1)
    rows = full.shape[0]
    per_rank = math.ceil(rows / world_size)
    shard = full.new_zeros((per_rank, *full.shape[1:]))
    start, stop = rank * per_rank, min((rank + 1) * per_rank, rows)
    if start < stop:
        shard[: stop - start] = full[start:stop]
    return shard
    # END SOLUTION


# ----------------------------------------------------------------------------------------------------
# Given: the argument checks, and the default choice of units
# ----------------------------------------------------------------------------------------------------


def _default_unit(module: nn.Module) -> bool:
    """The default rule: a module that directly owns a parameter of two or more dimensions."""
    return any(p.dim() >= 2 for p in module.parameters(recurse=False))


def _unit_rule(units: Any) -> Callable[[nn.Module], bool]:
    """``units`` (None, a module class, a tuple or list of classes, or a predicate) as a predicate."""
    if units is None:
        return _default_unit
    if isinstance(units, type):
        units = (units,)
    if isinstance(units, (tuple, list)):
        if not units or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in units):
            raise TypeError(f"units must be nn.Module classes (a class, a non-empty tuple or list), got {units!r}")
        classes = tuple(units)
        return lambda m: isinstance(m, classes)
    if callable(units):
        return units
    raise TypeError(
        f"units must be None, an nn.Module class, a tuple of classes or a predicate module -> bool, got {units!r}"
    )


def _check_arguments(module: Any, compute_dtype: Any, prefetch: Any, reshard_after_forward: Any) -> None:
    validate.instance("module", module, nn.Module, "a torch.nn.Module")
    if not any(True for _ in module.parameters()):
        raise ValueError(f"module must have parameters to shard; this {type(module).__name__} has none")
    if compute_dtype is not None:
        validate.instance("compute_dtype", compute_dtype, torch.dtype, "a torch.dtype or None")
        validate.choice("compute_dtype", compute_dtype, COMPUTE_DTYPES)
    validate.non_negative_int("prefetch", prefetch)
    validate.instance("reshard_after_forward", reshard_after_forward, bool, "a bool")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("FSDP needs an initialised process group (dist.init_process_group, or run inside "
                           "kit.spawn.run_on_ranks)")


# ----------------------------------------------------------------------------------------------------
# Given helpers: what FSDP remembers about each sharded parameter and each unit, and small tools
# ----------------------------------------------------------------------------------------------------

# BEGIN SCAFFOLD


@dataclass(eq=False)
class _Param:
    """One sharded parameter.

    ``param`` is the registered ``nn.Parameter``; between steps its ``.data`` is this rank's shard,
    ``(R, *rest)`` in its own dtype (fp32). ``full`` is the padded full weight ``(N·R, *rest)`` in the
    compute dtype: a leaf tensor (``requires_grad`` like ``param``) whose storage is allocated only while
    the unit is gathered; the module computes with its first ``rows`` rows. ``offset`` is where the shard
    starts in the unit's flat layout (the shards of a unit's parameters, one after the other).
    """

    name: str                           # its name in the unwrapped model (the first, if tied)
    param: nn.Parameter
    slots: list[tuple[nn.Module, str]]  # every (module, attribute name) that holds it
    slot_names: list[str]               # the same, as state_dict keys
    full_shape: torch.Size
    shard_numel: int                    # R·prod(rest): elements of this rank's shard
    full: torch.Tensor
    offset: int

    @property
    def rows(self) -> int:
        return self.full_shape[0]


@dataclass(eq=False)
class _Unit:
    """A group of parameters gathered and freed together: the parameters of one module (and its children)."""

    index: int
    name: str                           # the module's name in the unwrapped model
    module: nn.Module
    params: list[_Param]
    shard_numel: int                    # S: elements of this rank's shards, all parameters together
    state: str = "sharded"              # "sharded" → "in_flight" (all-gather issued) → "gathered"
    gather_work: Any = None             # the all-gather's work handle while in flight
    gather_output: torch.Tensor | None = None  # (N·S,) in the compute dtype while in flight
    grad_input: torch.Tensor | None = None     # (N, S) fp32: this rank's full gradient, laid out by rank
    grads_ready: int = 0                # trainable parameters whose gradient arrived in this backward
    trainable: int = field(default=0)

    def __post_init__(self) -> None:
        self.trainable = sum(p.param.requires_grad for p in self.params)


def _free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory but keep the tensor (autograd may hold it); :func:`_alloc_storage` brings it back."""
    t.untyped_storage().resize_(0)


def _alloc_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def _copy_out(unit: _Unit, gathered: torch.Tensor, world_size: int) -> None:
    """Copy an all-gathered unit ``(N·S,)`` (rank r's shards at ``[r·S, (r+1)·S)``) into each ``full``.

    Writes go through ``.data``: autograd saved these tensors in the last forward, and an in-place write
    that it can see would bump their version counter and fail the backward ("modified by an inplace
    operation"). Re-filling the same storage is exactly what FSDP means to do.
    """
    by_rank = gathered.view(world_size, unit.shard_numel)
    for p in unit.params:
        _alloc_storage(p.full)
        p.full.data.view(world_size, p.shard_numel).copy_(by_rank[:, p.offset : p.offset + p.shard_numel])


def _add_grad(unit: _Unit, p: _Param, grad: torch.Tensor, world_size: int) -> None:
    """Add ``grad`` (the padded full gradient ``(N·R, *rest)``, any float dtype) into ``unit.grad_input``.

    Row r of ``grad_input`` is what rank r's shards receive from this rank, so ``grad_input`` is exactly
    the input a reduce-scatter wants, **flattened**: hand ``grad_input.view(-1)``, shape ``(N·S,)``, to
    ``dist.reduce_scatter_tensor`` — gloo rejects the 2-D ``(N, S)`` tensor (NCCL takes either). It is
    allocated (zeros, fp32) on first use.
    """
    if unit.grad_input is None:
        unit.grad_input = torch.zeros(world_size, unit.shard_numel, dtype=torch.float32, device=grad.device)
    unit.grad_input[:, p.offset : p.offset + p.shard_numel].add_(grad.reshape(world_size, p.shard_numel))


def _install(unit: _Unit) -> None:
    """Make the unit's modules compute with the full weights: ``module.weight`` is ``full[:rows]`` now.

    The full tensor goes into the module's instance ``__dict__``, which Python looks up before
    ``nn.Module.__getattr__`` reads ``_parameters``. So ``module.weight`` is the full weight while the unit
    runs, and ``named_parameters()`` keeps returning the shard (handout 05b §2).
    """
    for p in unit.params:
        view = p.full[: p.rows]  # a view of the leaf: its gradient arrives on `full`, padding rows zero
        for module, attr in p.slots:
            module.__dict__[attr] = view


def _uninstall(unit: _Unit) -> None:
    """Undo :func:`_install`: ``module.weight`` is the registered (sharded) parameter again."""
    for p in unit.params:
        for module, attr in p.slots:
            module.__dict__.pop(attr, None)


def _cast_floats(value: Any, dtype: torch.dtype | None) -> Any:
    """``value`` with every floating-point tensor (in tuples, lists, dicts) cast to ``dtype``."""
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value`` (a tensor, or tuples, lists and dicts of them), e.g. a module's output."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    return []


def _broadcast_from_first_rank(module: nn.Module, group: Any) -> None:
    """Every parameter and buffer from the group's first rank to the others (in place, one per tensor)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=src, group=group)


# END SCAFFOLD


# ----------------------------------------------------------------------------------------------------
# The wrapper
# ----------------------------------------------------------------------------------------------------


class FSDP(nn.Module):
    """Fully sharded data parallel: shard every unit's weights, gather each unit just in time.

    Args:
        module: the model (the same architecture on every rank; the group's first rank's weights win).
        compute_dtype: ``None`` (compute in the parameters' dtype), ``torch.float32``, ``torch.float16`` or
            ``torch.bfloat16``. The shards are cast before the all-gather, so the wire carries 2 bytes per
            element in 16-bit modes; the master shards, the gradients the optimizer sees and the update
            stay fp32. Floating-point inputs of each unit are cast too.
        process_group: the ranks to shard over (``None`` = the default group).
        units: which modules are units: ``None`` (every module directly owning a parameter of ≥ 2 dims),
            an ``nn.Module`` class or tuple of classes, or a predicate ``module -> bool``. A unit takes all
            parameters under it; a module inside a unit is never a unit itself.
        prefetch: how many units ahead (in the execution order recorded in the first forward) to issue
            the all-gather before the current unit computes; in the backward, in reverse order.
        reshard_after_forward: free each unit's full weights after its forward (and gather them again in
            the backward); ``False`` keeps them from the forward to the unit's backward.

    Attributes:
        module: the wrapped model, module types and parameter names unchanged; between steps its
            sharded parameters hold this rank's shard.
        unit_names: each unit's module name in the wrapped model, in construction (pre-order) order.
        unit_param_names: each unit's parameter names, in the same order.
        unit_shapes: each unit's parameters' full (unsharded) shapes, in the same order.
        replicated_names, replicated_shapes: the parameters of no unit, kept whole on every rank.
        world_size, rank: of the process group.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, ``compute_dtype`` not a dtype, ``prefetch`` not an int or
            ``reshard_after_forward`` not a bool.
        ValueError: a module without parameters, an unsupported ``compute_dtype`` or ``prefetch`` < 0.
        RuntimeError: no process group is initialised.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        compute_dtype: torch.dtype | None = None,
        process_group: Any = None,
        units: Any = None,
        prefetch: int = 1,
        reshard_after_forward: bool = True,
    ):
        _check_arguments(module, compute_dtype, prefetch, reshard_after_forward)  # and that dist is initialised
        is_unit = _unit_rule(units)
        # BEGIN SCAFFOLD keep the options, broadcast from the first rank, find the units (handout 05b §2)
        super().__init__()
        self.module, self.process_group = module, process_group
        self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.compute_dtype, self.prefetch, self.reshard_after_forward = compute_dtype, prefetch, reshard_after_forward
        self.require_backward_grad_sync = True
        self._sync_this_step = True  # decided at forward time, as in Stage 4's DDP
        self._order: list[_Unit] = []  # units in the order the first forward ran them
        self._order_recorded = False
        self._reduce_scatters: list[tuple[_Unit, Any, torch.Tensor]] = []  # (unit, work, output) in flight
        self._all_reduces: list[tuple[nn.Parameter, Any]] = []  # replicated grads in flight

        _broadcast_from_first_rank(module, process_group)
        self._units = self._build_units(is_unit)
        in_unit = {id(p.param) for u in self._units for p in u.params}
        self._replicated = [(n, p) for n, p in module.named_parameters() if id(p) not in in_unit]
        self.unit_names = [u.name for u in self._units]
        self.unit_param_names = [[p.name for p in u.params] for u in self._units]
        self.unit_shapes = [[tuple(p.full_shape) for p in u.params] for u in self._units]
        self.replicated_names = [n for n, _ in self._replicated]
        self.replicated_shapes = [tuple(p.shape) for _, p in self._replicated]
        # END SCAFFOLD
        # BEGIN SOLUTION replace each unit parameter's data by this rank's shard; register the hooks (handout 05b §2)
        with torch.no_grad():
            for unit in self._units:
                for p in unit.params:
                    p.param.data = take_shard(p.param.data, self.world_size, self.rank)
                    if p.param.requires_grad:
                        p.full.register_post_accumulate_grad_hook(self._grad_hook(unit, p))
        for unit in self._units:
            unit.module.register_forward_pre_hook(self._pre_forward_hook(unit))
            unit.module.register_forward_hook(self._post_forward_hook(unit))
        for _, param in self._replicated:
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._on_replicated_grad)
        # END SOLUTION

    # -- Given helpers: finding the units --------------------------------------------------------------

    # BEGIN SCAFFOLD
    def _build_units(self, is_unit: Callable[[nn.Module], bool]) -> list[_Unit]:
        """Walk the modules in pre-order; a module matching ``is_unit`` (and inside no unit) is a unit.

        Each unit gets every parameter under it (0-dim parameters excepted: they stay replicated). A
        parameter reachable from two units (tied weights across units) is refused: put the modules
        that share it in one unit.
        """
        names = {id(p): n for n, p in self.module.named_parameters()}  # first name of each parameter
        slots: dict[int, list[tuple[nn.Module, str, str]]] = {}
        for mod_name, mod in self.module.named_modules(remove_duplicate=False):
            for attr, p in mod.named_parameters(recurse=False):
                slots.setdefault(id(p), []).append((mod, attr, f"{mod_name}.{attr}" if mod_name else attr))
        units: list[_Unit] = []
        owner: dict[int, str] = {}
        inside: set[int] = set()
        for mod_name, mod in self.module.named_modules():
            if id(mod) in inside or not is_unit(mod):
                continue
            inside.update(id(m) for m in mod.modules())
            params: list[_Param] = []
            offset = 0
            for _, p in mod.named_parameters():
                if p.dim() == 0:
                    continue
                if id(p) in owner:
                    raise ValueError(
                        f"units: parameter {names[id(p)]} is used by units {owner[id(p)]!r} and {mod_name!r}; "
                        "tied weights must live in one unit (choose units= so that one module holds both)"
                    )
                owner[id(p)] = mod_name
                per_rank = math.ceil(p.shape[0] / self.world_size)
                full = torch.empty((per_rank * self.world_size, *p.shape[1:]), device=p.device,
                                   dtype=self.compute_dtype or p.dtype).requires_grad_(p.requires_grad)
                _free_storage(full)
                shard_numel = per_rank * math.prod(p.shape[1:])
                params.append(_Param(name=names[id(p)], param=p, slots=[(m, a) for m, a, _ in slots[id(p)]],
                                     slot_names=[s for _, _, s in slots[id(p)]], full_shape=p.shape,
                                     shard_numel=shard_numel, full=full, offset=offset))
                offset += shard_numel
            if params:
                units.append(_Unit(index=len(units), name=mod_name, module=mod, params=params, shard_numel=offset))
        # A parameter shared between a unit and a module outside every unit would be sharded under the
        # other module's feet: refuse it as well.
        for unit in units:
            for p in unit.params:
                outside = [s for (m, _), s in zip(p.slots, p.slot_names) if id(m) not in inside]
                if outside:
                    raise ValueError(f"units: parameter {p.name} of unit {unit.name!r} is also used outside every "
                                     f"unit (as {outside[0]}); tied weights must live in one unit")
        return units
    # END SCAFFOLD

    # -- the forward -------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; remembers whether this step's backward should communicate."""
        # BEGIN SCAFFOLD decide whether this step synchronises; run; the order is now known (handout 05b §4)
        self._sync_this_step = self.require_backward_grad_sync
        out = self.module(*args, **kwargs)
        self._order_recorded = True
        return out
        # END SCAFFOLD

    def _unshard(self, unit: _Unit) -> None:
        """Issue the unit's all-gather asynchronously (nothing to do if it is in flight or gathered)."""
        # BEGIN SOLUTION cast the shards to the compute dtype, then one async all-gather for the unit (handout 05b §3)
        if unit.state != "sharded":
            return
        dtype = self.compute_dtype or unit.params[0].param.dtype
        flat = torch.cat([p.param.detach().reshape(-1) for p in unit.params]).to(dtype)  # cast BEFORE the wire
        unit.gather_output = torch.empty(self.world_size * unit.shard_numel, dtype=dtype, device=flat.device)
        unit.gather_work = _all_gather_tensor(unit.gather_output, flat, group=self.process_group, async_op=True)
        unit.state = "in_flight"
        # END SOLUTION

    def _wait_unshard(self, unit: _Unit) -> None:
        """Make sure the unit is gathered: issue its all-gather if needed, wait, copy into the full weights."""
        # BEGIN SOLUTION unshard if sharded, wait on the handle, copy out, drop the buffer (handout 05b §3)
        if unit.state == "gathered":
            return
        self._unshard(unit)
        unit.gather_work.wait()
        _copy_out(unit, unit.gather_output, self.world_size)
        unit.gather_work, unit.gather_output = None, None
        unit.state = "gathered"
        # END SOLUTION

    def _reshard(self, unit: _Unit) -> None:
        """Free the unit's full weights (their storage; the tensors stay, autograd may hold them)."""
        # BEGIN SOLUTION free every full weight's storage; mark the unit sharded (handout 05b §3)
        if unit.state == "in_flight":  # a prefetch nobody used: finish it so the collective completes
            self._wait_unshard(unit)
        for p in unit.params:
            _free_storage(p.full)
        unit.state = "sharded"
        # END SOLUTION

    def _prefetch(self, unit: _Unit, *, reverse: bool) -> None:
        """Issue the all-gathers of the ``prefetch`` units after ``unit`` in the recorded order (reversed in
        the backward). Before the order is recorded (the first forward) there is nothing to prefetch."""
        if not self.prefetch or not self._order_recorded or unit not in self._order:
            return
        # BEGIN SOLUTION the next `prefetch` units in (reverse) execution order: unshard each (handout 05b §4)
        order = self._order[::-1] if reverse else self._order
        i = order.index(unit)
        for nxt in order[i + 1 : i + 1 + self.prefetch]:
            self._unshard(nxt)
        # END SOLUTION

    def _pre_forward_hook(self, unit: _Unit) -> Callable:
        def hook(module: nn.Module, args: tuple) -> tuple:
            if not self._order_recorded and unit not in self._order:
                self._order.append(unit)
            # BEGIN SOLUTION gather this unit, prefetch the next ones, wait, install the full weights (handout 05b §3–4)
            self._unshard(unit)  # first, so it is issued before the prefetches
            self._prefetch(unit, reverse=False)
            self._wait_unshard(unit)
            _install(unit)
            # END SOLUTION
            return _cast_floats(args, self.compute_dtype)

        return hook

    def _post_forward_hook(self, unit: _Unit) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            # BEGIN SOLUTION uninstall, free if resharding, hook the pre-backward on the outputs (handout 05b §3)
            _uninstall(unit)
            if self.reshard_after_forward:
                self._reshard(unit)
            outputs = [t for t in _tensors_in(output) if t.requires_grad]
            if outputs:  # fires once, as soon as the gradient of any output is being computed
                torch.autograd.graph.register_multi_grad_hook(outputs, self._pre_backward_hook(unit), mode="any")
            # END SOLUTION

        return hook

    # -- the backward ------------------------------------------------------------------------------

    def _pre_backward_hook(self, unit: _Unit) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            # BEGIN SOLUTION gather this unit again, prefetch in reverse order, wait (handout 05b §3–4)
            self._unshard(unit)
            self._prefetch(unit, reverse=True)
            self._wait_unshard(unit)
            # END SOLUTION

        return hook

    def _grad_hook(self, unit: _Unit, p: _Param) -> Callable:
        def hook(full: torch.Tensor) -> None:
            # BEGIN SOLUTION full.grad into grad_input; unit complete: reduce-scatter, free (handout 05b §5)
            _add_grad(unit, p, full.grad, self.world_size)
            full.grad = None
            unit.grads_ready += 1
            if unit.grads_ready == unit.trainable:
                unit.grads_ready = 0
                if self._sync_this_step:  # under no_sync the full gradient stays in grad_input, summed
                    self._reduce_scatter(unit)
                self._reshard(unit)
            # END SOLUTION

        return hook

    def _reduce_scatter(self, unit: _Unit) -> None:
        """Reduce-scatter the unit's ``grad_input`` (fp32) asynchronously; keep at most two in flight."""
        # BEGIN SOLUTION async reduce-scatter (sum) to a shard; finish the oldest beyond two (handout 05b §5)
        output = torch.empty(unit.shard_numel, dtype=torch.float32, device=unit.grad_input.device)
        work = _reduce_scatter_tensor(output, unit.grad_input.view(-1), op=dist.ReduceOp.SUM,
                                      group=self.process_group, async_op=True)
        self._reduce_scatters.append((unit, work, output))
        while len(self._reduce_scatters) > 2:  # bounds the fp32 full gradients alive during the backward
            self._finish_reduce_scatter(*self._reduce_scatters.pop(0))
        # END SOLUTION

    def _finish_reduce_scatter(self, unit: _Unit, work: Any, output: torch.Tensor) -> None:
        """Wait for a unit's reduce-scatter, average, and give each sharded parameter its ``.grad``."""
        # BEGIN SOLUTION wait, divide by N, split into each parameter's shard .grad (handout 05b §5)
        work.wait()
        unit.grad_input = None
        output.div_(self.world_size)
        for p in unit.params:
            if not p.param.requires_grad:
                continue
            grad = output[p.offset : p.offset + p.shard_numel].view_as(p.param).to(p.param.dtype)
            p.param.grad = grad if p.param.grad is None else p.param.grad + grad
        # END SOLUTION

    def _on_replicated_grad(self, param: torch.Tensor) -> None:
        """Hook: a replicated parameter's gradient is ready; all-reduce it asynchronously (unless no_sync)."""
        # BEGIN SOLUTION unless in no_sync, async all-reduce (sum) of param.grad; keep it (handout 05b §5)
        if not self._sync_this_step:
            return
        work = dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
        self._all_reduces.append((param, work))
        # END SOLUTION

    def finish_gradient_synchronization(self) -> None:
        """Call after ``loss.backward()``, before ``optimizer.step()``: waits for every collective.

        Afterwards every sharded parameter's ``.grad`` is the average over the group of its shard of
        the gradient (shard shape, fp32), every replicated parameter's ``.grad`` the average of its
        gradient, and no unit is gathered. Inside :meth:`no_sync` it only frees the units.
        """
        # BEGIN SOLUTION launch leftovers, wait for all, average the replicated, free (handout 05b §5)
        if self._sync_this_step:
            # A unit some of whose parameters got no gradient never completed; every rank has the same
            # ones, in the same (construction) order.
            for unit in self._units:
                if unit.grad_input is not None and all(u is not unit for u, _, _ in self._reduce_scatters):
                    unit.grads_ready = 0
                    self._reduce_scatter(unit)
            while self._reduce_scatters:
                self._finish_reduce_scatter(*self._reduce_scatters.pop(0))
            for param, work in self._all_reduces:
                work.wait()
                param.grad.div_(self.world_size)
            self._all_reduces = []
        for unit in self._units:
            if unit.state != "sharded":
                _uninstall(unit)
                self._reshard(unit)
        # END SOLUTION

    def on_train_batch_start(self) -> None:
        """Call before a step's forward to forget the collectives of an aborted step (optional)."""
        # BEGIN SCAFFOLD forget the collectives and gradient counts of an aborted step (handout 05b §5)
        self._reduce_scatters, self._all_reduces = [], []
        for unit in self._units:
            unit.grads_ready = 0
        # END SCAFFOLD

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: inside, backward passes add into local full-size fp32 gradients.

        Deferred: the reduce-scatters and the replicated all-reduces. Not deferred: the all-gathers
        (every micro-batch still gathers each unit, twice with ``reshard_after_forward``). The price is
        memory: each unit's full fp32 gradient stays allocated until the synchronising micro-batch.
        """
        # BEGIN SOLUTION turn require_backward_grad_sync off, restore it on exit (handout 04 §5, 05b §6)
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous
        # END SOLUTION

    # -- full parameters and checkpoints -------------------------------------------------------------

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Full fp32 copies of every parameter, keyed by the unwrapped model's names, on every rank.

        Collective: one all-gather per unit (in the parameters' own dtype, not the compute dtype).
        """
        # BEGIN SOLUTION all-gather each unit in fp32, cut the padding; copy the replicated (handout 05b §6)
        out: dict[str, torch.Tensor] = {}
        for unit in self._units:
            flat = torch.cat([p.param.detach().reshape(-1) for p in unit.params])
            gathered = flat.new_empty(self.world_size * unit.shard_numel)
            _all_gather_tensor(gathered, flat, group=self.process_group)
            by_rank = gathered.view(self.world_size, unit.shard_numel)
            for p in unit.params:
                padded = by_rank[:, p.offset : p.offset + p.shard_numel].reshape(-1, *p.full_shape[1:])
                out[p.name] = padded[: p.rows].clone()
        for name, param in self._replicated:
            out[name] = param.detach().clone()
        return {name: out[name] for name, _ in self.module.named_parameters()}
        # END SOLUTION

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The unwrapped model's ``state_dict()`` with full tensors, on every rank (collective).

        Keys are the wrapped model's own (no ``module.`` prefix), so it loads into the plain model, or
        into an FSDP of any world size through :meth:`load_state_dict`.
        """
        full = self.gather_full_params()
        names = {id(p): n for n, p in self.module.named_parameters()}  # a tied parameter: its first name
        return {k: full[names[id(v)]] if id(v) in names else v.detach().clone()
                for k, v in self.module.state_dict(keep_vars=True).items()}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> Any:  # type: ignore[override]
        """Load a full state dict (from :meth:`state_dict` at any world size, or a plain model's): each rank
        keeps its own shard of every sharded parameter. No communication."""
        validate.instance("state_dict", state_dict, dict, "a dict of full tensors (from state_dict())")
        # BEGIN SOLUTION take_shard of each sharded full tensor, then module.load_state_dict (handout 05b §6)
        local = dict(state_dict)
        for unit in self._units:
            for p in unit.params:
                for key in p.slot_names:
                    if key not in state_dict:
                        continue
                    if tuple(state_dict[key].shape) != tuple(p.full_shape):
                        raise ValueError(f"state_dict[{key!r}] has shape {tuple(state_dict[key].shape)}, expected "
                                         f"the full shape {tuple(p.full_shape)}")
                    local[key] = take_shard(state_dict[key], self.world_size, self.rank)
        return self.module.load_state_dict(local, strict=strict)
        # END SOLUTION


# ----------------------------------------------------------------------------------------------------
# The accounting
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FSDPAccounting:
    """Per-rank bytes and per-step communication of one :class:`FSDP` configuration.

    Memory between steps (bytes on each rank): ``param_bytes`` (shards with their padding, plus the
    replicated parameters), ``grad_bytes`` (the same elements), ``optimizer_bytes``. ``peak_gathered_bytes``
    is the most full (padded) weight bytes, in the compute dtype, alive at once: ``prefetch + 1``
    consecutive units when resharding after forward, every unit when not.

    Communication in one synchronising step, per collective: how many are issued and the bytes this rank
    hands in, summed (the kit's convention, what ``kit.comm_log`` records): an all-gather's input (this
    rank's shards), a reduce-scatter's input (the full padded gradient), an all-reduce's tensor. With ring
    algorithms a rank *sends* ``(N−1)×`` an all-gather's input, ``(N−1)/N`` of a reduce-scatter's and
    ``2(N−1)/N`` of an all-reduce's: :attr:`sent_bytes`. (NCCL's. gloo runs ``reduce_scatter_tensor`` as an
    all-reduce of the whole buffer, so there a reduce-scatter sends ``2(N−1)/N`` of its input.)
    """

    world_size: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    peak_gathered_bytes: int
    all_gathers: int
    all_gather_bytes: int
    reduce_scatters: int
    reduce_scatter_bytes: int
    all_reduces: int
    all_reduce_bytes: int

    @property
    def total_bytes(self) -> int:
        """Parameters + gradients + optimizer state on one rank between steps."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def sent_bytes(self) -> float:
        """Bytes each rank sends per step with ring algorithms."""
        n = self.world_size
        return (n - 1) * (self.all_gather_bytes + (self.reduce_scatter_bytes + 2 * self.all_reduce_bytes) / n)

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total_bytes": self.total_bytes, "sent_bytes": self.sent_bytes}


def fsdp_accounting(
    unit_shapes: Sequence[Sequence[Sequence[int]]],
    replicated_shapes: Sequence[Sequence[int]],
    world_size: int,
    *,
    prefetch: int = 1,
    reshard_after_forward: bool = True,
    compute_bytes: int = 4,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer_bytes_per_param: int = 8,
) -> FSDPAccounting:
    """The bytes of :class:`FSDP` on one rank, and its collectives in one synchronising step.

    Args:
        unit_shapes: the full shape of each parameter of each unit, units in execution order (e.g.
            ``fsdp.unit_shapes`` when construction order is execution order).
        replicated_shapes: the shapes of the replicated parameters (all trainable).
        world_size: N, the ranks of the group.
        prefetch, reshard_after_forward: as for :class:`FSDP`.
        compute_bytes: bytes per element on the wire and in the gathered weights (2 for fp16/bf16).
        param_bytes, grad_bytes: bytes per element of the master parameters and of their gradients, which
            are also the reduced ones (fp32: 4).
        optimizer_bytes_per_param: optimizer state per element held (AdamW in fp32: 8; SGD: 0).

    A parameter of shape ``(rows, *rest)`` has a shard of ``⌈rows/N⌉·prod(rest)`` elements per rank and a
    padded full size N times that.

    Raises:
        TypeError: a count or byte size that is not an int, or ``reshard_after_forward`` not a bool.
        ValueError: a count or byte size out of range, or a sharded parameter with no dimension.
    """
    for name, value in (("world_size", world_size), ("compute_bytes", compute_bytes), ("param_bytes", param_bytes),
                        ("grad_bytes", grad_bytes)):
        validate.positive_int(name, value)
    validate.non_negative_int("prefetch", prefetch)
    validate.non_negative_int("optimizer_bytes_per_param", optimizer_bytes_per_param)
    validate.instance("reshard_after_forward", reshard_after_forward, bool, "a bool")
    shapes = [[tuple(s) for s in unit] for unit in unit_shapes]
    replicated = [tuple(s) for s in replicated_shapes]
    if any(len(s) == 0 for unit in shapes for s in unit):
        raise ValueError("unit_shapes: sharded parameters need at least one dimension (dim 0 is split)")
    # BEGIN SOLUTION shards of ⌈rows/N⌉·rest; count collectives and bytes handed in (handout 05b §7)
    n = world_size
    shard = [sum(math.ceil(s[0] / n) * math.prod(s[1:]) for s in unit) for unit in shapes]  # per unit, per rank
    held = sum(shard) + sum(math.prod(s) for s in replicated)
    window = len(shard) if not reshard_after_forward else min(prefetch + 1, len(shard))
    peak = max((sum(shard[i : i + window]) for i in range(len(shard) - window + 1)), default=0) * n
    per_unit = 2 if reshard_after_forward else 1  # the backward gathers each unit again after resharding
    return FSDPAccounting(
        world_size=n,
        param_bytes=held * param_bytes,
        grad_bytes=held * grad_bytes,
        optimizer_bytes=held * optimizer_bytes_per_param,
        peak_gathered_bytes=peak * compute_bytes,
        all_gathers=per_unit * len(shard),
        all_gather_bytes=per_unit * sum(shard) * compute_bytes,
        reduce_scatters=len(shard),
        reduce_scatter_bytes=n * sum(shard) * grad_bytes,
        all_reduces=len(replicated),
        all_reduce_bytes=sum(math.prod(s) for s in replicated) * grad_bytes,
    )
    # END SOLUTION
