# Your work goes in this file. Generated from the kit's reference by `make student`.
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
    raise NotImplementedError("verify_same_model: all_gather_object each rank's list, compare with group rank 0's (handout 04 §1)")


def broadcast_module_states(module: nn.Module, process_group: Any = None) -> None:
    """Overwrite every parameter and buffer, in place, with the values of the group's first rank.

    Parameters that do not require grad are broadcast too: replicas must compute the same function.
    Runs under ``torch.no_grad()`` so the copy is not recorded by autograd.
    """
    raise NotImplementedError("broadcast_module_states: broadcast each parameter and buffer from the group's first rank (handout 04 §1)")


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
    raise NotImplementedError("assign_buckets: walk params in reverse, open a new bucket at the cap (handout 04 §4)")


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
        raise NotImplementedError("DataParallelBase.no_sync: turn require_backward_grad_sync off, restore it on exit (handout 04 §5)")

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
        raise NotImplementedError("NaiveDDP.finish_gradient_synchronization: all-reduce each trainable .grad, then average (handout 04 §2)")


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
        raise NotImplementedError("FlatDDP.finish_gradient_synchronization: flatten the grads, one all-reduce, average, copy back (handout 04 §2)")


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
        self._pending: list[tuple[torch.Tensor, Any]] = []  # (gradient, work handle) launched this step
        raise NotImplementedError("DDPIndividualParameters.__init__: hook self._on_grad_ready on each trainable param (handout 04 §3)")

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """Hook: ``param.grad`` is final for this backward; start its all-reduce unless in no_sync."""
        raise NotImplementedError("DDPIndividualParameters._on_grad_ready: unless in no_sync, launch an async all-reduce, keep it (handout 04 §3)")

    def on_train_batch_start(self) -> None:
        """Forget handles left over from an aborted step."""
        self._pending = []

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_step:
            return
        raise NotImplementedError("DDPIndividualParameters.finish_gradient_synchronization: wait on each handle, average each grad, forget them (handout 04 §3)")


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
        raise NotImplementedError("DDPBucketed.__init__: hook self._on_grad_ready on each trainable param (handout 04 §4)")

    def _launch_bucket(self, k: int) -> None:
        """Copy bucket ``k``'s gradients (zeros where ``.grad`` is None) into its buffer; all-reduce it async."""
        raise NotImplementedError("DDPBucketed._launch_bucket: fill the bucket's buffer, launch its async all-reduce (handout 04 §4)")

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """Hook: one more gradient of this parameter's bucket is ready; launch the bucket when it is full."""
        raise NotImplementedError("DDPBucketed._on_grad_ready: count the gradient; launch the bucket when full (handout 04 §4)")

    def on_train_batch_start(self) -> None:
        """Reset the per-step state: no bucket launched, no gradient counted."""
        raise NotImplementedError("DDPBucketed.on_train_batch_start: reset the ready counts and the handles (handout 04 §4)")

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_step:
            return
        raise NotImplementedError("DDPBucketed.finish_gradient_synchronization: launch leftovers, wait, average, copy back, reset (handout 04 §4)")


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
