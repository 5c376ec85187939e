"""Where a tensor's bytes came from: the storages it was copied, cast, summed or scaled from, op by op.

Stages 3 and 7's rules ask which launched kernel *wrote* a graded output (o, dQ, dH…). A design may store a result
into a scratch buffer and finish it in PyTorch — cast an fp32 accumulator to bf16, sum per-tile partials, scale
by 1/√D — so the writer of the output is the writer of one of those sources. :class:`Lineage` is a dispatch mode,
run in the worker around the workload, that remembers for each storage the storages the ops in ``carries`` made it
from; :meth:`Lineage.ancestry` walks back through them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Lineage(TorchDispatchMode):
    """Which storages each storage was computed from by the ATen ops named in ``carries`` (a copy, a cast, a sum…):
    ``sources[ptr]`` = the data pointers of the inputs' storages. Every tensor seen is kept alive, so that no
    storage's address is reused for another while the workload runs."""

    def __init__(self, carries: frozenset[str]) -> None:
        super().__init__()
        self.carries = carries
        self.sources: dict[int, set[int]] = {}
        self.keep: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "aten" and func._schema.name.split("::")[-1] in self.carries:
            leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
            inputs = [a for a in leaves if isinstance(a, torch.Tensor)]
            outputs = [a for a in torch.utils._pytree.tree_leaves(out) if isinstance(a, torch.Tensor)]
            for o in outputs:
                ptr = o.untyped_storage().data_ptr()
                if ptr:  # 0: an empty storage, shared by all
                    carried = {i.untyped_storage().data_ptr() for i in inputs}
                    self.sources.setdefault(ptr, set()).update(carried - {0, ptr})
            self.keep += inputs + outputs
        return out

    def ancestry(self, ptrs: Iterable[int]) -> set[int]:
        """The storages ``ptrs`` and every storage they were carried from."""
        seen, todo = set(), list(ptrs)
        while todo:
            ptr = todo.pop()
            if ptr not in seen:
                seen.add(ptr)
                todo += self.sources.get(ptr, ())
        return seen
