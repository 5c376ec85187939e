"""Design override: ZeRO-1 with one coalesced all-gather per dtype of every rank's packed, padded share (no per-
parameter broadcasts), owners kept per group and a heap partition, and the local optimizer rebuilt on
add_param_group / load_state_dict.

Only what this design writes differently from reference/zero.py:
instructor/overrides.py builds the graded module from the reference and these definitions.
"""

from __future__ import annotations

import heapq
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

ADDS = ('ShardedOptimizer._mine', 'ShardedOptimizer._rebuild_local', 'ShardedOptimizer._flat_params')


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
    """
    positive_int("world_size", world_size)
    numels = [non_negative_int(f"numels[{i}]", n) for i, n in enumerate(numels)]
    loads = [0] * world_size if loads is None else [non_negative_int(f"loads[{r}]", x) for r, x in enumerate(loads)]
    if len(loads) != world_size:
        raise ValueError(f"loads must hold {world_size} ints ≥ 0 (one per rank), got {loads!r}")
    owners = [0] * len(numels)
    heap = [(load, rank) for rank, load in enumerate(loads)]  # (load, rank): ties pop the lowest rank
    heapq.heapify(heap)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        loads[rank] = load + numels[i]
        heapq.heappush(heap, (loads[rank], rank))
    return owners, loads


class ShardedOptimizer(Optimizer):
    """ZeRO-1 (design: coalesced all-gather). Same public API as the reference; after ``step`` every rank packs
    the parameters it owns into one flat buffer per dtype, padded to the largest rank's share, and a single
    ``all_gather_into_tensor`` per dtype replaces the per-parameter broadcasts.

    The owners live in ``self._owners_by_group`` (one list of group ranks per param group), and the local
    optimizer is rebuilt from scratch on ``add_param_group`` (its state carried over by parameter).
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
        _reject_repeats(tensors)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ShardedOptimizer needs an initialised process group")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._cls, self._kwargs = optimizer_cls, dict(kwargs)
        self._owners_by_group: list[list[int]] = []
        self._rank_loads = [0] * self.world_size
        self.local_optimizer: Optimizer | None = None
        super().__init__(params, kwargs)
        self._rebuild_local()

    def owner_of(self, param: torch.Tensor) -> int:
        """The rank (within ``process_group``) that owns ``param``, keeps its state and sends it."""
        for group, owners in zip(self.param_groups, self._owners_by_group):
            for p, owner in zip(group["params"], owners):
                if p is param:
                    return owner
        raise ValueError("owner_of: this tensor is not a parameter of the optimizer")

    def _mine(self, gi: int) -> list[torch.Tensor]:
        return [p for p, o in zip(self.param_groups[gi]["params"], self._owners_by_group[gi]) if o == self.rank]

    def _rebuild_local(self) -> None:
        """A fresh local optimizer over the owned parameters, one group per group; old state carried over."""
        old_state = self.local_optimizer.state if self.local_optimizer is not None else {}
        local_groups = []
        for gi, group in enumerate(self.param_groups):
            options = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            local_groups.append({**options, "params": self._mine(gi)})
        self.local_optimizer = self._cls(local_groups, **self._kwargs)
        for p, st in old_state.items():
            self.local_optimizer.state[p] = st
        for local, group in zip(self.local_optimizer.param_groups, self.param_groups):
            group.update({k: v for k, v in local.items() if k not in ("params", "param_names")})
        self.state = self.local_optimizer.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group on every rank; its parameters are balanced on top of the current loads."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict with a 'params' entry, got {type(param_group).__name__}")
        if "params" not in param_group:
            raise ValueError("param_group must have a 'params' entry (a tensor or a list of tensors)")
        known = [p for g in self.param_groups for p in g["params"]]
        _reject_repeats(_tensors_in(param_group), already=known)
        super().add_param_group(dict(param_group))
        owners, self._rank_loads = partition_by_size([p.numel() for p in self.param_groups[-1]["params"]],
                                                     self.world_size, self._rank_loads)
        self._owners_by_group.append(owners)
        if self.local_optimizer is not None:
            self._rebuild_local()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step the owned parameters, then one all-gather per dtype of every rank's packed, padded share."""
        for local, group in zip(self.local_optimizer.param_groups, self.param_groups):
            local.update({k: v for k, v in group.items() if k not in ("params", "param_names")})
        if closure is None:
            loss = self.local_optimizer.step()
        else:
            with torch.enable_grad():
                loss = self.local_optimizer.step(closure)
        by_kind: dict[tuple[torch.dtype, torch.device], list[tuple[torch.Tensor, int]]] = {}
        for group, owners in zip(self.param_groups, self._owners_by_group):
            for p, owner in zip(group["params"], owners):
                by_kind.setdefault((p.dtype, p.device), []).append((p, owner))
        for (dtype, device), items in by_kind.items():
            per_rank = [[p for p, o in items if o == r] for r in range(self.world_size)]
            width = max(sum(p.numel() for p in ps) for ps in per_rank)
            if width == 0:
                continue
            send = torch.zeros(width, dtype=dtype, device=device)
            offset = 0
            for p in per_rank[self.rank]:
                send[offset : offset + p.numel()] = p.detach().reshape(-1)
                offset += p.numel()
            recv = torch.empty(self.world_size * width, dtype=dtype, device=device)
            dist.all_gather_into_tensor(recv, send, group=self.process_group)
            for r, ps in enumerate(per_rank):
                offset = r * width
                for p in ps:
                    p.copy_(recv[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        return loss

    def _flat_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any] | None:  # type: ignore[override]
        """The unsharded optimizer's state dict, consolidated on the group's rank 0 (None elsewhere)."""
        flat = self._flat_params()
        mine = {}
        for p, st in self.local_optimizer.state.items():
            index = next(i for i, q in enumerate(flat) if q is p)
            mine[index] = _to_cpu(dict(st))
        root = _global_rank(self.process_group, 0)
        parts: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=root, group=self.process_group)
        if self.rank != 0:
            return None
        merged: dict[int, Any] = {}
        for part in parts:
            merged.update(part)
        groups, start = [], 0
        for g in self.param_groups:
            saved = {k: v for k, v in g.items() if k != "params"}
            saved["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(saved)
        return {"state": {i: merged[i] for i in sorted(merged)}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an unsharded-format state dict (any world size): keep the owned parameters' states."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise TypeError("state_dict must be a dict with 'state' and 'param_groups' (from state_dict())")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} param groups but this optimizer has {len(self.param_groups)}"
            )
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"state_dict param group {i} has {len(saved['params'])} parameters, this "
                                 f"optimizer's has {len(group['params'])}")
        for saved, group in zip(saved_groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
        self.local_optimizer = None  # forget every old state, then rebuild with the new options
        self._rebuild_local()
        # Let the local optimizer cast the owned states (device, dtype) through its own load_state_dict.
        local_sd = self.local_optimizer.state_dict()
        local_params = [p for g in self.local_optimizer.param_groups for p in g["params"]]
        flat_index = {id(p): i for i, p in enumerate(self._flat_params())}
        saved_index = [i for g in saved_groups for i in g["params"]]
        local_sd["state"] = {}
        for li, p in enumerate(local_params):
            key = saved_index[flat_index[id(p)]]
            if key in state_dict["state"]:
                local_sd["state"][li] = state_dict["state"][key]
        self.local_optimizer.load_state_dict(local_sd)
        self.state = self.local_optimizer.state
