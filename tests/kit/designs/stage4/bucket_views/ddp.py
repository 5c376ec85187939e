"""Design override: DDPBucketed with gradients as views into the bucket buffers (torch's gradient_as_bucket_view):
the hook moves each gradient into its bucket slice and re-points param.grad at it, so the all-reduce averages in
place and nothing is copied back.

Only what this design writes differently from reference/ddp.py:
instructor/overrides.py builds the graded module from the reference and these definitions.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kit.validate import instance, number

ADDS = ('DDPBucketed._grad_ready', 'DDPBucketed._send')


class DataParallelBase(nn.Module, abc.ABC):
    """What every DDP class shares: construction, ``forward``, ``no_sync`` and the step hooks.

    Attributes:
        module: the wrapped model (its parameters are ``self.parameters()`` too).
        process_group: the group gradients are averaged over (``None`` = the default group).
        world_size: the number of ranks in that group.
        require_backward_grad_sync: ``False`` inside :meth:`no_sync`.
    """


class DDPBucketed(DataParallelBase):
    """Gradients in buckets of at most ``bucket_size_mb`` MiB; one async all-reduce per bucket.

    Design: each parameter's gradient *lives in* its bucket's flat buffer. When a gradient is ready, the hook
    copies it into the parameter's slice of the buffer (once per step, unless it is already there) and
    points ``param.grad`` at that slice (``param.grad = view``); the all-reduce then averages the gradients
    in place, so there is nothing to copy back afterwards (torch's ``gradient_as_bucket_view=True``).

    Attributes:
        bucket_names: the parameter names in each bucket, bucket 0 first (the first to be launched).
        bucket_numels: the number of gradient elements in each bucket (its flat buffer's length).
    """
    def __init__(self, module: nn.Module, bucket_size_mb: float | None = 25.0, *, process_group: Any = None):
        _check_module(module)
        assign_buckets([], bucket_size_mb)
        super().__init__(module, process_group=process_group)
        self.bucket_size_mb = bucket_size_mb
        named = trainable_parameters(self.module)
        buckets = assign_buckets([p for _, p in named], bucket_size_mb)
        self.bucket_names = [[named[i][0] for i in b] for b in buckets]
        self.bucket_numels = [sum(named[i][1].numel() for i in b) for b in buckets]
        self._members: list[list[nn.Parameter]] = [[named[i][1] for i in b] for b in buckets]
        self._flat: list[torch.Tensor] = []
        self._view: dict[int, torch.Tensor] = {}  # id(param) -> its slice of the bucket, shaped like the param
        self._where: dict[int, int] = {}  # id(param) -> bucket index
        for k, params in enumerate(self._members):
            flat = torch.zeros(self.bucket_numels[k], dtype=params[0].dtype, device=params[0].device)
            self._flat.append(flat)
            start = 0
            for p in params:
                self._view[id(p)] = flat[start : start + p.numel()].view_as(p)
                self._where[id(p)] = k
                start += p.numel()
        self._missing: list[int] = []
        self._works: list[Any] = []
        self.on_train_batch_start()
        for _, p in named:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync_this_step:
            return
        view = self._view[id(param)]
        if param.grad is not view:
            view.copy_(param.grad)
            param.grad = view  # the gradient is now the bucket's slice
        k = self._where[id(param)]
        if self._works[k] is not None:
            raise RuntimeError(f"DDPBucketed: bucket {k} got a gradient after it was sent; call "
                               "finish_gradient_synchronization() after each backward")
        self._missing[k] -= 1
        if self._missing[k] == 0:
            self._send(k)

    def _send(self, k: int) -> None:
        for p in self._members[k]:
            if p.grad is None:  # no gradient this step: contribute zeros, keep .grad None
                self._view[id(p)].zero_()
        self._works[k] = dist.all_reduce(self._flat[k], op=dist.ReduceOp.SUM, group=self.process_group,
                                         async_op=True)

    def on_train_batch_start(self) -> None:
        self._missing = [len(params) for params in self._members]
        self._works = [None] * len(self._members)

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_step:
            return
        for k in range(len(self._members)):
            if self._works[k] is None:
                self._send(k)
        for k, work in enumerate(self._works):
            work.wait()
            self._flat[k].div_(self.world_size)
            for p in self._members[k]:
                # A gradient that autograd re-allocated after the hook (not expected) still gets the average.
                if p.grad is not None and p.grad is not self._view[id(p)]:
                    p.grad.copy_(self._view[id(p)])
        self.on_train_batch_start()
