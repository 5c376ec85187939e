"""Stage 5 — ZeRO stage 1: shard the optimizer state over the data-parallel ranks (handout/05-zero.md).

Data parallelism keeps a full copy of everything on every rank: parameters, gradients and the optimizer
state. For Adam the state (two moments per parameter, plus an fp32 master copy under mixed precision)
is the biggest of the three, and every rank holds an identical copy of it. ZeRO stage 1 removes that
redundancy: every parameter gets one *owner* rank, only the owner keeps its optimizer state and applies
its update, and then the owner sends the updated parameter to everybody else.

    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    loss.backward()            # gradients must already agree across ranks (e.g. averaged by Stage 4's DDP)
    optimizer.step()           # owners update their parameters, then broadcast them
    optimizer.zero_grad()

This is the teaching form used by ``torch.distributed.optim.ZeroRedundancyOptimizer``: whole parameters,
assigned sorted-greedily by size, one broadcast per parameter from its owner. DeepSpeed and Megatron
shard a flat, padded buffer instead (handout 05 §6).

:func:`zero_memory_accounting` does the ZeRO paper's bookkeeping for stages 0–3: bytes per device for
parameters, gradients and optimizer state, and the bytes each rank communicates per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from kit.data import random_batch
from kit.model import ModelConfig, TransformerLM, cross_entropy
from kit.spawn import rank_device
from kit.validate import choice, integer, non_negative_int, positive_int

__all__ = [
    "ZERO_STAGES",
    "ShardedOptimizer",
    "ZeroMemory",
    "optimizer_state_bytes",
    "partition_by_size",
    "zero_memory_accounting",
]

# Keys of a param group that are not optimizer options.
_NOT_OPTIONS = ("params", "param_names")


# ----------------------------------------------------------------------------------------------------
# Who owns which parameter
# ----------------------------------------------------------------------------------------------------


def partition_by_size(
    numels: Sequence[int], world_size: int, loads: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """Assign items to ranks sorted-greedily: largest item first, each to the least-loaded rank.

    This is the "longest processing time first" rule: after it, the loads (elements per rank) differ
    by at most the largest single item. Ties go to the lowest rank, and equal items keep their input
    order, so every rank computes the same assignment without talking to the others.

    Args:
        numels: the size (number of elements) of each item, e.g. ``[p.numel() for p in params]``.
        world_size: the number of ranks, at least 1.
        loads: elements each rank already owns (default all zero); pass the loads returned by an
            earlier call to keep balancing when a new parameter group arrives.

    Returns:
        ``(owners, loads)``: ``owners[i]`` is the rank of item ``i``; ``loads[r]`` the elements rank ``r``
        owns afterwards (a new list).

    Raises:
        TypeError: a size, ``world_size`` or load that is not an int.
        ValueError: a negative size or load, ``world_size < 1``, or ``loads`` of the wrong length.
    """
    positive_int("world_size", world_size)
    numels = [non_negative_int(f"numels[{i}]", n) for i, n in enumerate(numels)]
    loads = [0] * world_size if loads is None else [non_negative_int(f"loads[{r}]", x) for r, x in enumerate(loads)]
    if len(loads) != world_size:
        raise ValueError(f"loads must hold {world_size} ints ≥ 0 (one per rank), got {loads!r}")
    # BEGIN SOLUTION largest item first (stable), each to the least-loaded rank (handout 05 §2)
    owners = [0] * len(numels)
    # sorted() is stable: equal sizes keep their input order, so every rank agrees on the result.
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        rank = min(range(world_size), key=lambda r: loads[r])  # first minimum: ties go to the lowest rank
        owners[i] = rank
        loads[rank] += numels[i]
    return owners, loads
    # END SOLUTION


# ----------------------------------------------------------------------------------------------------
# The sharded optimizer
# ----------------------------------------------------------------------------------------------------


class ShardedOptimizer(Optimizer):
    """ZeRO-1: wrap any ``torch.optim.Optimizer`` so each rank keeps optimizer state for its own parameters only.

    Args:
        params: an iterable of tensors, or of param-group dicts (``{"params": [...], "lr": ...}``) with
            per-group options. Every rank must pass the same parameters in the same order.
        optimizer_cls: the optimizer class to shard, e.g. ``torch.optim.AdamW`` (the class, not an instance).
        process_group: the ranks to shard over (``None`` = the default group). Stage 6 passes the
            data-parallel group of its mesh. Owner ranks are ranks *within* this group.
        **kwargs: the optimizer's defaults (``lr``, ``betas``, ``weight_decay`` …), as for ``optimizer_cls``.

    After construction:

    * ``param_groups`` lists every parameter (all ranks), with the full set of options;
    * ``local_optimizer`` is the ``optimizer_cls`` instance over the parameters this rank owns, with one
      param group per group of ``param_groups`` (possibly empty);
    * ``state`` is ``local_optimizer.state``: it only ever holds this rank's parameters;
    * ``owner_of(p)`` is the rank (within ``process_group``) that owns parameter ``p``.

    Every method that talks to other ranks (``step``, ``add_param_group``, ``state_dict``,
    ``load_state_dict``) must be called on every rank of the group, in the same order.

    Raises:
        TypeError: ``optimizer_cls`` is not an Optimizer subclass (an instance, say), or ``params`` is a single
            tensor.
        ValueError: no parameters, or a parameter listed twice.
        RuntimeError: no process group is initialised.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[Optimizer],
        *,
        process_group: Any = None,
        **kwargs: Any,
    ):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Optimizer)):
            hint = " (pass the class, e.g. torch.optim.AdamW, not an instance)" if isinstance(
                optimizer_cls, Optimizer) else ""
            raise TypeError(
                f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}{hint}"
            )
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors or of param-group dicts, got a single tensor")
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        tensors = [t for g in groups for t in _tensors_in(g)]
        if not tensors:
            raise ValueError("params is empty: ShardedOptimizer needs at least one parameter to optimize")
        _reject_repeats(tensors)  # before any communication: bad input fails fast, on every rank alike
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ShardedOptimizer needs an initialised process group (dist.init_process_group, or run "
                "inside kit.spawn.run_on_ranks)"
            )
        # BEGIN SOLUTION Optimizer.__init__ adds the groups via add_param_group; build local_optimizer (handout 05 §2)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._optimizer_cls = optimizer_cls
        self._owner: dict[torch.Tensor, int] = {}  # tensors hash by identity
        self._loads = [0] * self.world_size  # elements owned by each rank so far
        self.local_optimizer: Optimizer | None = None
        # Optimizer.__init__ fills self.param_groups through our add_param_group, which assigns owners;
        # the local optimizer does not exist yet, so add_param_group leaves it alone.
        super().__init__(params, kwargs)
        self.local_optimizer = optimizer_cls([self._local_group(g) for g in self.param_groups], **kwargs)
        # The local optimizer knows its class's defaults (amsgrad, foreach, …): copy them back so that
        # param_groups shows the complete options, as the unsharded optimizer's would.
        self._copy_options(self.local_optimizer.param_groups, self.param_groups)
        # Optimizer state lives in the local optimizer only; expose it, so `state` is this rank's shard.
        self.state = self.local_optimizer.state
        # END SOLUTION

    def owner_of(self, param: torch.Tensor) -> int:
        """The rank (within ``process_group``) that owns ``param``, keeps its state and broadcasts it."""
        # BEGIN SCAFFOLD the owner's rank within process_group; ValueError for a tensor that is not a parameter
        try:
            return self._owner[param]
        except KeyError:
            raise ValueError("owner_of: this tensor is not a parameter of the optimizer") from None
        # END SCAFFOLD

    # BEGIN SCAFFOLD
    # -- Given helpers ------------------------------------------------------------------------------------
    # They read what __init__ sets up: self.process_group, self.rank and self.world_size (of that group),
    # self._owner (parameter -> owner rank; tensors hash by identity), self._loads (elements owned per
    # rank so far) and self.local_optimizer (None until it is built).

    def _local_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """The part of ``group`` this rank owns: the same options, only the owned parameters."""
        local = {k: v for k, v in group.items() if k not in _NOT_OPTIONS}
        owned = [i for i, p in enumerate(group["params"]) if self._owner[p] == self.rank]
        local["params"] = [group["params"][i] for i in owned]
        if "param_names" in group:
            local["param_names"] = [group["param_names"][i] for i in owned]
        return local

    @staticmethod
    def _copy_options(src_groups: list[dict[str, Any]], dst_groups: list[dict[str, Any]]) -> None:
        """Copy every option (lr, betas, …) group by group; leave the parameter lists alone."""
        for src, dst in zip(src_groups, dst_groups, strict=True):
            for key, value in src.items():
                if key not in _NOT_OPTIONS:
                    dst[key] = value

    def _global_indices(self) -> dict[torch.Tensor, int]:
        """Each parameter's index in an unsharded optimizer's ``state_dict`` (groups concatenated)."""
        params = [p for g in self.param_groups for p in g["params"]]
        return {p: i for i, p in enumerate(params)}
    # END SCAFFOLD

    # -- the optimizer interface ------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group on every rank: its parameters get owners, this rank's share joins the local optimizer.

        Parameters of the earlier groups keep their owners (and their state); the new ones are balanced
        on top of the current loads. Raises ``ValueError`` if a parameter is already in the optimizer or
        appears twice in the group.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict with a 'params' entry, got {type(param_group).__name__}")
        if "params" not in param_group:
            raise ValueError("param_group must have a 'params' entry (a tensor or a list of tensors)")
        # BEGIN SOLUTION reject repeats, register the group, assign owners, extend the local optimizer (handout 05 §2)
        _reject_repeats(_tensors_in(param_group), already=self._owner)
        super().add_param_group(dict(param_group))  # fills defaults, checks types, appends to self.param_groups
        group = self.param_groups[-1]
        owners, self._loads = partition_by_size([p.numel() for p in group["params"]], self.world_size, self._loads)
        for p, rank in zip(group["params"], owners):
            self._owner[p] = rank
        if self.local_optimizer is not None:
            self.local_optimizer.add_param_group(self._local_group(group))
            self._copy_options(self.local_optimizer.param_groups[-1:], self.param_groups[-1:])
        # END SOLUTION

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update the parameters this rank owns, then broadcast every parameter from its owner.

        Gradients must already be the same on every rank (averaged by DDP, or computed on the same
        batch). Options changed in ``param_groups`` (an LR scheduler) reach the local optimizer first.
        Returns the closure's loss, if a closure was given.
        """
        # BEGIN SOLUTION sync options, step the local optimizer, broadcast each parameter from its owner (handout 05 §3)
        self._copy_options(self.param_groups, self.local_optimizer.param_groups)
        if closure is None:
            loss = self.local_optimizer.step()
        else:
            with torch.enable_grad():
                loss = self.local_optimizer.step(closure)
        self._copy_options(self.local_optimizer.param_groups, self.param_groups)
        # One broadcast per parameter, straight into its storage: no flat buffer, no extra memory. They
        # are issued asynchronously so the transfers pipeline; every rank issues them in the same order.
        handles = []
        for group in self.param_groups:
            for p in group["params"]:
                src = _global_rank(self.process_group, self._owner[p])  # broadcast's src is a global rank
                handles.append(dist.broadcast(p.data, src=src, group=self.process_group, async_op=True))
        for handle in handles:
            handle.wait()
        return loss
        # END SOLUTION

    def state_dict(self) -> dict[str, Any] | None:  # type: ignore[override]
        """The whole optimizer's state, consolidated on rank 0 of the group (``None`` on the other ranks).

        The format is exactly an unsharded ``optimizer_cls``'s ``state_dict()``: ``"state"`` maps each
        parameter's global index (groups concatenated, in order) to its state, with tensors on the CPU;
        ``"param_groups"`` lists the options and the indices of each group. So a checkpoint does not
        depend on the world size, and loads into another world size, or into the plain optimizer.
        Collective: call it on every rank.
        """
        # BEGIN SOLUTION renumber local states globally, gather on rank 0, build the unsharded format (handout 05 §4)
        index = self._global_indices()
        local_params = [p for g in self.local_optimizer.param_groups for p in g["params"]]
        local_sd = self.local_optimizer.state_dict()
        mine = {
            index[local_params[i]]: _to_cpu(state) for i, state in local_sd["state"].items()
        }
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=_global_rank(self.process_group, 0), group=self.process_group)
        if self.rank != 0:
            return None
        state = {}
        for part in gathered:
            state.update(part)
        param_groups = []
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = [index[p] for p in group["params"]]
            param_groups.append(saved)
        return {"state": dict(sorted(state.items())), "param_groups": param_groups}
        # END SOLUTION

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (any world size) or from the unsharded optimizer.

        Every rank passes the same full dict; each keeps the state of the parameters it owns, and the
        options (lr, betas, …) of every group are restored.
        """
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise TypeError("state_dict must be a dict with 'state' and 'param_groups' (from state_dict())")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} param groups but this optimizer has {len(self.param_groups)}"
            )
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"state_dict param group {i} has {len(saved['params'])} parameters, this optimizer's "
                    f"has {len(group['params'])}"
                )
        # BEGIN SOLUTION keep owned states, renumber them, load the local optimizer, restore options (handout 05 §4)
        local_state: dict[int, Any] = {}
        local_groups = []
        next_local = 0
        for saved, group in zip(saved_groups, self.param_groups):
            local_indices = []
            for saved_index, p in zip(saved["params"], group["params"]):
                if self._owner[p] != self.rank:
                    continue
                if saved_index in state_dict["state"]:
                    local_state[next_local] = state_dict["state"][saved_index]
                local_indices.append(next_local)
                next_local += 1
            options = {k: v for k, v in saved.items() if k not in _NOT_OPTIONS}
            local_groups.append({**options, "params": local_indices})
        # The local optimizer's own load_state_dict copies the tensors and casts them to each
        # parameter's device and dtype (keeping Adam's `step` counter as it is).
        self.local_optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})
        # Optimizer.load_state_dict builds a *new* state dict: point `state` at it again, or it stays stale.
        self.state = self.local_optimizer.state
        self._copy_options(self.local_optimizer.param_groups, self.param_groups)
        # END SOLUTION


# ----------------------------------------------------------------------------------------------------
# Given helpers: used by the code above; read them, no need to change them
# ----------------------------------------------------------------------------------------------------


def _global_rank(group: Any, group_rank: int) -> int:
    """The global rank of rank ``group_rank`` of ``group`` (``None``: the default group).

    Collectives take ``src``/``dst`` as *global* ranks even when ``group=`` is a subgroup.
    """
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_rank)


def _tensors_in(group: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors of a param group: ``params`` may be a tensor, a list of tensors or of (name, tensor)."""
    if not isinstance(group, dict) or "params" not in group:
        raise TypeError(f"each param group must be a dict with a 'params' entry, got {type(group).__name__}")
    params = group["params"]
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, set):
        raise TypeError("params must be an ordered collection (list or tuple), not a set: every rank must "
                        "see the parameters in the same order")
    tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"params must hold tensors, got a {type(t).__name__}")
    return tensors


def _reject_repeats(tensors: list[torch.Tensor], already: Iterable[torch.Tensor] = ()) -> None:
    """Raise ``ValueError`` if a tensor appears twice in ``tensors`` or is one of ``already``."""
    seen = {id(t) for t in already}
    for t in tensors:
        if id(t) in seen:
            raise ValueError(
                f"params: a parameter of shape {tuple(t.shape)} appears twice; each parameter may be in the "
                "optimizer once (it has one owner and one optimizer state)"
            )
        seen.add(id(t))


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor inside (dicts, lists, tuples) copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` on this rank (the thing ZeRO-1 shards).

    Works for any optimizer: for a :class:`ShardedOptimizer` that is this rank's shard; for
    ``ZeroRedundancyOptimizer`` pass its ``.optim`` (the local optimizer).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def state_bytes_by_group_size(model_config: dict, group_sizes: Sequence[int]) -> list[dict]:
    """Per-rank bytes of a :class:`ShardedOptimizer` over the first N ranks, for each N in ``group_sizes``.

    Given code (notebook 05 §3); run it on every rank of one spawn, e.g.
    ``run_on_ranks(state_bytes_by_group_size, 4, args=(config, [1, 2, 3, 4]))``. For each N, ranks 0 … N−1
    build the kit Transformer ``ModelConfig(**model_config)`` (same seed), run one AdamW step on one batch
    and report ``{"world_size": N, "rank", "params", "state_bytes", "model_bytes"}``: the optimizer state
    this rank holds, and its parameters + gradients + optimizer state.
    """
    cfg = ModelConfig(**model_config)
    device = rank_device()
    x, y = random_batch(1, cfg.context_length, cfg.vocab_size, device=device, seed=0)
    rows = []
    for n in group_sizes:
        group = dist.new_group(list(range(n)))  # every rank calls new_group, members or not
        if dist.get_rank() >= n:
            continue
        torch.manual_seed(0)
        model = TransformerLM(cfg).to(device)
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, process_group=group, lr=1e-3)
        cross_entropy(model(x), y).backward()
        optimizer.step()
        state = optimizer_state_bytes(optimizer.local_optimizer)
        weights = sum(t.numel() * t.element_size() for p in model.parameters() for t in (p, p.grad) if t is not None)
        rows.append({"world_size": n, "rank": dist.get_rank(), "params": model.num_parameters(),
                     "state_bytes": state, "model_bytes": weights + state})
    return rows


# ----------------------------------------------------------------------------------------------------
# Memory accounting (the ZeRO paper, arXiv 1910.02054, §3 and §7)
# ----------------------------------------------------------------------------------------------------


#: ZeRO stages: 0 is plain data parallelism; 1 shards the optimizer state, 2 also the gradients, 3 also the weights.
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class ZeroMemory:
    """Per-device bytes at one ZeRO stage and world size, and the bytes each rank sends per step."""

    stage: int
    world_size: int
    num_params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    comm_bytes_per_step: int

    @property
    def total_bytes(self) -> int:
        """Parameters + gradients + optimizer state on one device (activations and buffers not included)."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total_bytes": self.total_bytes}


def zero_memory_accounting(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    param_bytes: int,
    grad_bytes: int,
    optimizer_bytes_per_param: int,
) -> ZeroMemory:
    """Model-state memory per device and communication per step for ZeRO stage 0 (plain DP) to 3.

    With Ψ = ``num_params``, N = ``world_size`` and a shard of S = ⌈Ψ/N⌉ elements (a flat buffer padded to
    a multiple of N, as DeepSpeed does), each device holds:

    ======  ==============  ==============  ======================
    stage   parameters      gradients       optimizer state
    ======  ==============  ==============  ======================
    0       Ψ·param_bytes   Ψ·grad_bytes    Ψ·optimizer_bytes
    1       Ψ·param_bytes   Ψ·grad_bytes    S·optimizer_bytes
    2       Ψ·param_bytes   S·grad_bytes    S·optimizer_bytes
    3       S·param_bytes   S·grad_bytes    S·optimizer_bytes
    ======  ==============  ==============  ======================

    Mixed-precision Adam is ``param_bytes=2, grad_bytes=2, optimizer_bytes_per_param=12`` (fp32 master
    weights, momentum and variance): 16Ψ at stage 0, 4Ψ + 12Ψ/N at stage 1, 2Ψ + 14Ψ/N at stage 2, 16Ψ/N
    at stage 3.

    Communication (bytes each rank sends per step, ring algorithms, which send N−1 chunks of S elements
    per reduce-scatter or all-gather): stage 0 all-reduces the gradients (a reduce-scatter plus an
    all-gather), 2(N−1)·S·grad_bytes; stages 1 and 2 reduce-scatter the gradients and all-gather the
    updated parameters, (N−1)·S·(grad_bytes + param_bytes); stage 3 also all-gathers the parameters
    again for the backward pass, (N−1)·S·(grad_bytes + 2·param_bytes). For large N and equal dtypes
    these are the paper's 2Ψ, 2Ψ and 3Ψ.

    Raises:
        TypeError: a count or byte size that is not an int.
        ValueError: ``num_params`` or ``world_size`` < 1, a negative byte size, or ``stage`` not in 0–3.
    """
    positive_int("num_params", num_params)
    positive_int("world_size", world_size)
    for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes),
                        ("optimizer_bytes_per_param", optimizer_bytes_per_param)):
        non_negative_int(name, value)
    choice("stage", integer("stage", stage), ZERO_STAGES)  # 0 is plain data parallelism
    # BEGIN SOLUTION full or sharded (⌈Ψ/N⌉) params, grads, optimizer state by stage; ring comm volume (handout 05 §5)
    full, shard, n = num_params, math.ceil(num_params / world_size), world_size
    params = (shard if stage >= 3 else full) * param_bytes
    grads = (shard if stage >= 2 else full) * grad_bytes
    optimizer = (shard if stage >= 1 else full) * optimizer_bytes_per_param
    if stage == 0:
        comm = 2 * (n - 1) * shard * grad_bytes  # all-reduce = reduce-scatter + all-gather of gradients
    elif stage in (1, 2):
        comm = (n - 1) * shard * (grad_bytes + param_bytes)  # reduce-scatter grads, all-gather params
    else:
        comm = (n - 1) * shard * (grad_bytes + 2 * param_bytes)  # params gathered for forward and backward
    return ZeroMemory(stage=stage, world_size=world_size, num_params=num_params, param_bytes=params,
                      grad_bytes=grads, optimizer_bytes=optimizer, comm_bytes_per_step=comm)
    # END SOLUTION
