"""Design override: Buckets launched strictly in bucket order (like torch's reducer), flattened per launch with
torch._utils._flatten_dense_tensors instead of preallocated buffers; collectives called positionally
(dist.all_reduce(t, op, group, True)).

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
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from kit.validate import instance, number

ADDS = ('DDPBucketed._mark_ready', 'DDPBucketed._launch_next')


class DataParallelBase(nn.Module, abc.ABC):
    """What every DDP class shares: construction, ``forward``, ``no_sync`` and the step hooks.

    Attributes:
        module: the wrapped model (its parameters are ``self.parameters()`` too).
        process_group: the group gradients are averaged over (``None`` = the default group).
        world_size: the number of ranks in that group.
        require_backward_grad_sync: ``False`` inside :meth:`no_sync`.
    """
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as restore:
            restore.callback(setattr, self, "require_backward_grad_sync", self.require_backward_grad_sync)
            self.require_backward_grad_sync = False
            yield


class FlatDDP(DataParallelBase):
    """After backward, copy every gradient into one flat buffer, all-reduce it once, copy back.

    One big message instead of one per parameter: each collective has a fixed latency (tens of
    microseconds on NCCL, more on gloo), so a model with hundreds of parameters pays it hundreds of
    times in :class:`NaiveDDP`.
    """
    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_step:
            return
        params = [p for _, p in trainable_parameters(self.module) if p.grad is not None]
        if not params:
            return
        flat = _flatten_dense_tensors([p.grad for p in params])
        dist.all_reduce(flat, dist.ReduceOp.SUM, self.process_group)
        flat /= self.world_size
        for p, averaged in zip(params, _unflatten_dense_tensors(flat, [p.grad for p in params])):
            p.grad.copy_(averaged)


class DDPIndividualParameters(DataParallelBase):
    """An async all-reduce per parameter, launched by a hook as soon as that gradient is accumulated.

    ``register_post_accumulate_grad_hook(hook)`` calls ``hook(param)`` — the *parameter*, whose ``.grad``
    now holds this backward's (accumulated) gradient — once per backward pass. The hook launches
    ``dist.all_reduce(param.grad, async_op=True)`` and keeps the returned work handle; autograd goes on
    computing earlier layers' gradients while the message is in flight.
    :meth:`finish_gradient_synchronization` waits on the handles and divides by the world size.
    """
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync_this_step:
            return
        self._pending.append((param, dist.all_reduce(param.grad, dist.ReduceOp.SUM, self.process_group, True)))

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_step:
            return
        for param, handle in self._pending:
            handle.wait()
            param.grad /= self.world_size
        self._pending = []


class DDPBucketed(DataParallelBase):
    """Gradients in buckets of at most ``bucket_size_mb`` MiB; one async all-reduce per bucket.

    Design: buckets are launched strictly in bucket order, as torch's reducer does. A bucket whose gradients
    are all ready waits until every earlier bucket has been launched; no buffer is kept between steps: each
    launch flattens the bucket's gradients with ``torch._utils._flatten_dense_tensors`` and
    ``finish_gradient_synchronization`` scatters the average back with ``_unflatten_dense_tensors``.

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
        order = assign_buckets([p for _, p in named], bucket_size_mb)
        self.bucket_names = [[named[i][0] for i in b] for b in order]
        self.bucket_numels = [sum(named[i][1].numel() for i in b) for b in order]
        self._groups = [[named[i][1] for i in b] for b in order]
        self._bucket_index = {id(p): k for k, ps in enumerate(self._groups) for p in ps}
        self.on_train_batch_start()
        for _, p in named:
            p.register_post_accumulate_grad_hook(self._mark_ready)

    def on_train_batch_start(self) -> None:
        self._seen: list[set[int]] = [set() for _ in self._groups]
        self._next = 0  # the next bucket to launch; buckets before it are in flight
        self._in_flight: list[tuple[torch.Tensor, Any]] = []  # (flat, work) in bucket order

    def _mark_ready(self, param: torch.Tensor) -> None:
        if not self._sync_this_step:
            return
        k = self._bucket_index[id(param)]
        if k < self._next:
            raise RuntimeError(f"DDPBucketed: bucket {k} got a gradient after it was launched; call "
                               "finish_gradient_synchronization() after each backward")
        self._seen[k].add(id(param))
        while self._next < len(self._groups) and len(self._seen[self._next]) == len(self._groups[self._next]):
            self._launch_next()

    def _launch_next(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._groups[self._next]]
        flat = _flatten_dense_tensors(grads)
        work = dist.all_reduce(flat, dist.ReduceOp.SUM, self.process_group, True)  # positional: async_op=True
        self._in_flight.append((flat, work))
        self._next += 1

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_step:
            return
        while self._next < len(self._groups):  # incomplete buckets (unused parameters), still in order
            self._launch_next()
        for params, (flat, work) in zip(self._groups, self._in_flight):
            work.wait()
            flat /= self.world_size
            for p, averaged in zip(params, _unflatten_dense_tensors(flat, params)):
                if p.grad is not None:
                    p.grad.copy_(averaged)
        self.on_train_batch_start()
