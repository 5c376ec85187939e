"""Stage 4 — distributed data parallel, built from collectives up (handout/04-ddp.md).

Every rank holds a full replica of the model and trains on its own shard of the batch. After the
backward pass each rank has the gradient of *its* shard's loss; averaging the gradients over the ranks
gives the gradient of the full batch (the loss is a mean), so every replica takes the same optimizer
step and the replicas stay identical. Four ways to do the averaging, each faster than the last:

* :class:`NaiveDDP` — one all-reduce per parameter, after backward.
* :class:`FlatDDP` — all gradients copied into one flat buffer, one all-reduce, copied back.
* :class:`DDPIndividualParameters` — an asynchronous all-reduce per parameter, launched by a hook the
  moment that parameter's gradient is ready, so communication overlaps the rest of the backward pass.
* :class:`DDPBucketed` — gradients grouped into buckets of about ``bucket_size_mb`` MiB in reverse
  registration order; one asynchronous all-reduce per bucket, launched when its last gradient is ready.

All four share one interface, used the same way in every training loop::

    ddp = DDPBucketed(model, bucket_size_mb=25)          # broadcasts rank 0's weights to every rank
    optimizer = torch.optim.AdamW(ddp.parameters())
    for x, y in shard_of_my_rank:
        ddp.on_train_batch_start()
        loss = loss_fn(ddp(x), y)
        loss.backward()
        ddp.finish_gradient_synchronization()             # afterwards: every p.grad is the global mean
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

Gradient accumulation: run the forward *and* backward of every micro-batch but the last inside
``with ddp.no_sync():`` — gradients then only accumulate locally, and the last micro-batch communicates
the accumulated sum once.

Every class takes ``process_group=None`` (the default, world group) or a group from ``dist.new_group``
/ a ``DeviceMesh`` dimension: the broadcast comes from that group's first rank and gradients are
averaged over that group only (Stage 6 runs DDP over the data-parallel dimension of a 4D mesh).

What all of them promise:

* parameters that do not require grad are broadcast at construction (so replicas start identical) and
  otherwise left alone: no hook, no all-reduce, their ``.grad`` stays ``None``;
* tied (shared) parameters are one tensor in ``module.parameters()`` and are reduced once;
* a parameter that gets no gradient in a step keeps ``.grad = None`` and nothing hangs — provided every
  rank runs the same graph (the same parameters are unused on every rank; see handout 04 §7);
* a rank that fails raises; with ``kit.spawn.run_on_ranks`` its error reaches you instead of a hang.
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

__all__ = [
    "DDPBucketed",
    "DDPIndividualParameters",
    "DataParallelBase",
    "FlatDDP",
    "NaiveDDP",
    "assign_buckets",
    "broadcast_module_states",
    "verify_same_model",
]

MIB = 2**20


# ----------------------------------------------------------------------------------------------------
# Helpers shared by every DDP class
# ----------------------------------------------------------------------------------------------------


def verify_same_model(module: nn.Module, process_group: Any = None) -> None:
    """Raise ``ValueError`` on every rank unless all ranks of the group hold the same architecture.

    Compares, across the ranks of ``process_group``, the list of ``(name, shape, dtype, requires_grad)``
    of every parameter and buffer. Without this check, replicas that differ make the later collectives
    disagree on sizes: gloo errors out with an opaque message, NCCL may hang. torch's
    DistributedDataParallel does the same check at construction.

    Only the architecture is compared, never the values: replicas that start from different weights are
    expected (the broadcast that follows makes them equal).

    Raises:
        ValueError: the ranks' parameters or buffers differ in names, shapes, dtypes or ``requires_grad`` (not
            in their values); the message names the first difference.
    """
    # BEGIN SOLUTION all_gather_object each rank's list, compare with group rank 0's (handout 04 §1)
    mine = [(n, tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for n, p in module.named_parameters()]
    mine += [(n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()]
    everyone: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, mine, group=process_group)
    reference = everyone[0]
    for group_rank, theirs in enumerate(everyone):
        if theirs == reference:
            continue
        if len(theirs) != len(reference):
            raise ValueError(
                f"DDP: the model on group rank {group_rank} has {len(theirs)} parameters and buffers, group "
                f"rank 0's has {len(reference)}: every rank must build the same model"
            )
        for a, b in zip(reference, theirs):
            if a != b:
                raise ValueError(
                    f"DDP: models differ across ranks: group rank 0 has {a[0]} {a[1]} {a[2]} "
                    f"requires_grad={a[3]}, group rank {group_rank} has {b[0]} {b[1]} {b[2]} "
                    f"requires_grad={b[3]}: every rank must build the same model"
                )
    # END SOLUTION


def broadcast_module_states(module: nn.Module, process_group: Any = None) -> None:
    """Overwrite every parameter and buffer, in place, with the values of the group's first rank.

    Parameters that do not require grad are broadcast too: replicas must compute the same function.
    Runs under ``torch.no_grad()`` so the copy is not recorded by autograd.
    """
    # BEGIN SOLUTION broadcast each parameter and buffer from the group's first rank (handout 04 §1)
    src = _group_source_rank(process_group)
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=src, group=process_group)
    # END SOLUTION


def assign_buckets(params: Sequence[torch.Tensor], bucket_size_mb: float | None) -> list[list[int]]:
    """Group parameters into gradient buckets, the way torch DDP does before its first iteration.

    Args:
        params: the parameters in registration order (``module.parameters()`` order).
        bucket_size_mb: the most bytes a bucket may hold, in MiB (2**20 bytes); ``None`` puts every
            parameter into one bucket.

    Returns:
        buckets as lists of indices into ``params``. Parameters are visited in *reverse* registration
        order (roughly the order their gradients become ready in backward); a parameter joins the current
        bucket while the bucket's total ``numel * element_size`` stays within the cap, else it starts a
        new bucket. A parameter larger than the cap gets a bucket of its own. A parameter whose dtype or
        device differs from the current bucket's also starts a new bucket (one flat buffer per bucket).
        Bucket 0 therefore holds the last-registered parameters, and the indices inside each bucket
        are in decreasing order. Example: sizes 4, 4, 4 MiB and a cap of 8 MiB give ``[[2, 1], [0]]``.

    Raises:
        TypeError: ``bucket_size_mb`` not a number (or None), or a parameter that is not a tensor.
        ValueError: ``bucket_size_mb`` ≤ 0.
    """
    if bucket_size_mb is not None:
        number("bucket_size_mb", bucket_size_mb, above=0)  # MiB; None means one bucket
    for i, p in enumerate(params):
        instance(f"params[{i}]", p, torch.Tensor, "a tensor")
    # BEGIN SOLUTION walk params in reverse, open a new bucket at the cap (handout 04 §4)
    cap = float("inf") if bucket_size_mb is None else bucket_size_mb * MIB
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        first = params[current[0]] if current else p
        same_kind = first.dtype == p.dtype and first.device == p.device
        if current and (current_bytes + nbytes > cap or not same_kind):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += nbytes
    if current:
        buckets.append(current)
    return buckets
    # END SOLUTION


# ----------------------------------------------------------------------------------------------------
# The common interface
# ----------------------------------------------------------------------------------------------------


class DataParallelBase(nn.Module, abc.ABC):
    """What every DDP class shares: construction, ``forward``, ``no_sync`` and the step hooks.

    Attributes:
        module: the wrapped model (its parameters are ``self.parameters()`` too).
        process_group: the group gradients are averaged over (``None`` = the default group).
        world_size: the number of ranks in that group.
        require_backward_grad_sync: ``False`` inside :meth:`no_sync`.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        RuntimeError: no process group is initialised.
    """

    def __init__(self, module: nn.Module, *, process_group: Any = None):
        _check_module(module)
        if not dist.is_initialized():
            raise RuntimeError(
                "DDP needs an initialised process group: call dist.init_process_group first "
                "(kit.spawn.run_on_ranks does it for each rank)"
            )
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.require_backward_grad_sync = True
        # Decided at forward time, like torch DDP: what counts is whether the *forward* ran inside no_sync.
        self._sync_this_step = True
        verify_same_model(module, process_group)
        broadcast_module_states(module, process_group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; remembers whether this step's backward should communicate."""
        self._sync_this_step = self.require_backward_grad_sync
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: inside, backward passes only accumulate gradients locally.

        Put the forward *and* the backward of every micro-batch but the last inside the context; the
        last micro-batch, outside it, communicates the accumulated gradients once. Restores the previous
        setting on exit, even after an exception.
        """
        # BEGIN SOLUTION turn require_backward_grad_sync off, restore it on exit (handout 04 §5)
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous
        # END SOLUTION

    def on_train_batch_start(self) -> None:
        """Call before each step's forward. Resets per-step communication state (nothing to reset here)."""

    @abc.abstractmethod
    def finish_gradient_synchronization(self) -> None:
        """Call after ``loss.backward()``, before ``optimizer.step()``: leaves every ``p.grad`` averaged
        over the group's ranks. Does nothing when the step's forward ran inside :meth:`no_sync`.
        Each subclass implements it (an abstract method: the base class cannot be instantiated)."""


# ----------------------------------------------------------------------------------------------------
# 1. Naive: one blocking all-reduce per parameter, after backward
# ----------------------------------------------------------------------------------------------------


class NaiveDDP(DataParallelBase):
    """Broadcast at construction; after backward, all-reduce each gradient one by one and average.

    Args:
        module: the model replica on this rank (already on this rank's device).
        process_group: the group to average over; ``None`` for the default group.
    """

    def __init__(self, module: nn.Module, *, process_group: Any = None):
        super().__init__(module, process_group=process_group)

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_step:
            return
        # BEGIN SOLUTION all-reduce each trainable .grad, then average (handout 04 §2)
        for _, p in trainable_parameters(self.module):
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.process_group)
                p.grad.div_(self.world_size)
        # END SOLUTION


# ----------------------------------------------------------------------------------------------------
# 2. Flat: one all-reduce for all gradients
# ----------------------------------------------------------------------------------------------------


class FlatDDP(DataParallelBase):
    """After backward, copy every gradient into one flat buffer, all-reduce it once, copy back.

    One big message instead of one per parameter: each collective has a fixed latency (tens of
    microseconds on NCCL, more on gloo), so a model with hundreds of parameters pays it hundreds of
    times in :class:`NaiveDDP`.
    """

    def __init__(self, module: nn.Module, *, process_group: Any = None):
        super().__init__(module, process_group=process_group)

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_step:
            return
        # BEGIN SOLUTION flatten the grads, one all-reduce, average, copy back (handout 04 §2)
        grads = [p.grad for _, p in trainable_parameters(self.module) if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
        flat.div_(self.world_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        # END SOLUTION


# ----------------------------------------------------------------------------------------------------
# 3. Overlapped, one asynchronous all-reduce per parameter
# ----------------------------------------------------------------------------------------------------


class DDPIndividualParameters(DataParallelBase):
    """An async all-reduce per parameter, launched by a hook as soon as that gradient is accumulated.

    ``register_post_accumulate_grad_hook(hook)`` calls ``hook(param)`` — the *parameter*, whose ``.grad``
    now holds this backward's (accumulated) gradient — once per backward pass. The hook launches
    ``dist.all_reduce(param.grad, async_op=True)`` and keeps the returned work handle; autograd goes on
    computing earlier layers' gradients while the message is in flight.
    :meth:`finish_gradient_synchronization` waits on the handles and divides by the world size.
    """

    def __init__(self, module: nn.Module, *, process_group: Any = None):
        super().__init__(module, process_group=process_group)
        # BEGIN SCAFFOLD hook each trainable param to launch its async all-reduce; keep the handles (handout 04 §3)
        self._pending: list[tuple[torch.Tensor, Any]] = []  # (gradient, work handle) launched this step
        # END SCAFFOLD
        # BEGIN SOLUTION hook self._on_grad_ready on each trainable param (handout 04 §3)
        for _, p in trainable_parameters(self.module):
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        # END SOLUTION

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """Hook: ``param.grad`` is final for this backward; start its all-reduce unless in no_sync."""
        # BEGIN SOLUTION unless in no_sync, launch an async all-reduce, keep it (handout 04 §3)
        if not self._sync_this_step:
            return
        handle = dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
        self._pending.append((param.grad, handle))
        # END SOLUTION

    def on_train_batch_start(self) -> None:
        """Forget handles left over from an aborted step."""
        # BEGIN SCAFFOLD forget whatever your hooks kept from an aborted step (handout 04 §3)
        self._pending = []
        # END SCAFFOLD

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_step:
            return
        # BEGIN SOLUTION wait on each handle, average each grad, forget them (handout 04 §3)
        for grad, handle in self._pending:
            handle.wait()
            grad.div_(self.world_size)
        self._pending = []
        # END SOLUTION


# ----------------------------------------------------------------------------------------------------
# 4. Overlapped and bucketed
# ----------------------------------------------------------------------------------------------------


class DDPBucketed(DataParallelBase):
    """Gradients in buckets of at most ``bucket_size_mb`` MiB; one async all-reduce per bucket.

    Buckets come from :func:`assign_buckets` (reverse registration order). Each bucket owns one flat
    buffer. A hook counts the gradients of its bucket as they become ready; when the last one is ready
    the hook copies them into the buffer and launches ``dist.all_reduce(buffer, async_op=True)``.
    :meth:`finish_gradient_synchronization` launches any bucket that never became complete (a parameter
    that got no gradient this step contributes zeros), waits, averages and copies each slice back
    into its parameter's ``.grad`` (parameters without a gradient keep ``None``).

    Args:
        module: the model replica on this rank.
        bucket_size_mb: the cap per bucket in MiB (2**20 bytes), > 0; ``None`` for a single bucket.
        process_group: the group to average over; ``None`` for the default group.

    Attributes:
        bucket_names: the parameter names in each bucket, bucket 0 first (the first to be launched).
        bucket_numels: the number of gradient elements in each bucket (its flat buffer's length).
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float | None = 25.0, *, process_group: Any = None):
        _check_module(module)
        assign_buckets([], bucket_size_mb)  # validates bucket_size_mb before any communication
        super().__init__(module, process_group=process_group)
        self.bucket_size_mb = bucket_size_mb
        # BEGIN SCAFFOLD bucket_names, bucket_numels (assign_buckets), per-bucket state, hooks (handout 04 §4)
        named = trainable_parameters(self.module)
        index_buckets = assign_buckets([p for _, p in named], bucket_size_mb)
        self._bucket_params: list[list[nn.Parameter]] = [[named[i][1] for i in b] for b in index_buckets]
        self.bucket_names: list[list[str]] = [[named[i][0] for i in b] for b in index_buckets]
        self.bucket_numels: list[int] = [sum(p.numel() for p in b) for b in self._bucket_params]
        # One flat buffer per bucket, allocated once and reused every step.
        self._buffers: list[torch.Tensor] = [
            torch.zeros(n, dtype=b[0].dtype, device=b[0].device)
            for n, b in zip(self.bucket_numels, self._bucket_params)
        ]
        self._bucket_of: dict[int, int] = {id(p): k for k, b in enumerate(self._bucket_params) for p in b}
        # Per-step state, reset by on_train_batch_start and at the end of finish_gradient_synchronization.
        self._ready_count: list[int] = [0] * len(self._bucket_params)
        self._handles: list[Any] = [None] * len(self._bucket_params)
        # END SCAFFOLD
        # BEGIN SOLUTION hook self._on_grad_ready on each trainable param (handout 04 §4)
        for _, p in named:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        # END SOLUTION

    def _launch_bucket(self, k: int) -> None:
        """Copy bucket ``k``'s gradients (zeros where ``.grad`` is None) into its buffer; all-reduce it async."""
        # BEGIN SOLUTION fill the bucket's buffer, launch its async all-reduce (handout 04 §4)
        buffer = self._buffers[k]
        offset = 0
        for p in self._bucket_params[k]:
            view = buffer[offset : offset + p.numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
            offset += p.numel()
        self._handles[k] = dist.all_reduce(
            buffer, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True
        )
        # END SOLUTION

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """Hook: one more gradient of this parameter's bucket is ready; launch the bucket when it is full."""
        # BEGIN SOLUTION count the gradient; launch the bucket when full (handout 04 §4)
        if not self._sync_this_step:
            return
        k = self._bucket_of[id(param)]
        if self._handles[k] is not None:
            raise RuntimeError(
                f"DDPBucketed: a gradient of bucket {k} ({self.bucket_names[k]}) became ready after the "
                "bucket was sent: call finish_gradient_synchronization() after every backward, or run the extra "
                "backward passes inside no_sync()"
            )
        self._ready_count[k] += 1
        if self._ready_count[k] == len(self._bucket_params[k]):
            self._launch_bucket(k)
        # END SOLUTION

    def on_train_batch_start(self) -> None:
        """Reset the per-step state: no bucket launched, no gradient counted."""
        # BEGIN SOLUTION reset the ready counts and the handles (handout 04 §4)
        self._ready_count = [0] * len(self._bucket_params)
        self._handles = [None] * len(self._bucket_params)
        # END SOLUTION

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_step:
            return
        # BEGIN SOLUTION launch leftovers, wait, average, copy back, reset (handout 04 §4)
        # Buckets whose parameters did not all get a gradient never launched: launch them now, in bucket
        # order, which is the same on every rank because every rank runs the same graph.
        for k, handle in enumerate(self._handles):
            if handle is None:
                self._launch_bucket(k)
        for k, handle in enumerate(self._handles):
            handle.wait()
            buffer = self._buffers[k].div_(self.world_size)
            offset = 0
            for p in self._bucket_params[k]:
                if p.grad is not None:
                    p.grad.copy_(buffer[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.on_train_batch_start()
        # END SOLUTION


# ----------------------------------------------------------------------------------------------------
# Given helpers: used by the code above; read them, no need to change them
# ----------------------------------------------------------------------------------------------------


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for every parameter that requires grad, in registration order.

    ``named_parameters()`` lists a tied (shared) parameter once, under its first name, so each tensor
    appears once here and is reduced once.
    """
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _group_source_rank(process_group: Any) -> int:
    """Global rank of the first member of ``process_group`` (0 for the default group).

    ``dist.broadcast(src=...)`` takes a *global* rank even when ``group=`` is a subgroup.
    """
    if process_group is None:
        return 0
    return dist.get_global_rank(process_group, 0)


def _check_module(module: Any) -> None:
    instance("module", module, nn.Module, "a torch.nn.Module")
