"""Which aten operations allocate new memory, and how many bytes are alive at once — on a CPU too.

CUDA keeps allocator statistics (``torch.cuda.max_memory_allocated``); a CPU keeps none. :class:`Allocations`
is a ``TorchDispatchMode`` that sees every aten operation's outputs and asks one question of each: is its
storage new? A storage none of the operation's arguments already had is memory the operation allocated.
Views, in-place results and the Triton interpreter's own views of a kernel's arguments (it wraps each
argument's storage in a tensor) share an argument's storage and allocate nothing.

For every new storage it keeps

* ``largest`` and ``what``: the biggest single allocation (bytes) and which op made it, with its shape and dtype;
* ``live`` and ``peak``: the bytes of new storages still referenced by some tensor, now and at most. A storage
  stops counting when the last tensor the mode saw using it is garbage-collected.

Memory allocated before the mode was entered (inputs, parameters) is never counted::

    with Allocations() as seen:
        loss = fused_linear_cross_entropy(h, w, t)
        loss.backward()
    seen.peak, seen.largest, seen.what       # e.g. 73728, 36864, "aten.empty.memory_format → (72, 64) fp64"
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def storages_in(obj: Any, found: set[int] | None = None) -> set[int]:
    """The data pointers of every tensor's or storage's memory in ``obj`` (nested lists, tuples, dicts)."""
    found = set() if found is None else found
    if isinstance(obj, torch.Tensor):
        found.add(obj.untyped_storage().data_ptr())
    elif isinstance(obj, torch.UntypedStorage):
        found.add(obj.data_ptr())
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            storages_in(item, found)
    elif isinstance(obj, dict):
        for item in obj.values():
            storages_in(item, found)
    return found


class Allocations(TorchDispatchMode):
    """Counts the new storages aten operations create while the mode is active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.what = 0, ""
        self.live, self.peak = 0, 0
        self._owners: dict[int, list[int]] = {}  # storage pointer → [bytes, tensors alive that use it]

    def _release(self, key: int) -> None:
        entry = self._owners[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._owners[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        arguments: set[int] | None = None  # computed once per op, and only when an output is not yet known
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(x, torch.Tensor) or x.untyped_storage().data_ptr() == 0:
                continue  # not a tensor, or one without memory (size 0, meta)
            key = x.untyped_storage().data_ptr()
            if key not in self._owners:
                arguments = storages_in([args, kwargs or {}]) if arguments is None else arguments
                if key in arguments:
                    continue  # memory that existed before this op: a view, an in-place result
                size = x.untyped_storage().nbytes()
                if size > self.largest:
                    self.largest, self.what = size, f"{func} → {tuple(x.shape)} {x.dtype}"
                self._owners[key] = [size, 0]
                self.live += size
                self.peak = max(self.peak, self.live)
            self._owners[key][1] += 1
            weakref.finalize(x, self._release, key)
        return out
