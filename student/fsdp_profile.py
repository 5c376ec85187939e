# Given code — read, don't edit. Generated from the kit's reference by `make student`.
"""Stage 5, part two — see FSDP's schedule: a torch.profiler timeline and the memory of one step (given code).

``run_on_ranks(profile_fsdp_steps, 2, args=((0, 1, 2),))`` profiles one training step of a small kit
Transformer wrapped in your ``FSDP``, for each prefetch value, and returns per rank ``{prefetch: profile}``,
each profile a dict with

* ``spans`` — ``(lane, name, start_ms, end_ms)``: the ``forward``, ``backward``,
  ``finish_gradient_synchronization`` and ``optimizer.step`` phases (lane ``"phase"``); each matmul on
  the main thread (``"compute"``); each all-gather (``"gather"``) and each reduction (``"reduce"``) from
  launch to completion on the backend's own threads, where they can overlap the compute. (gloo runs a
  reduce-scatter as an all-reduce of the whole buffer, so both kinds of reduction appear as
  ``gloo:all_reduce``; NCCL shows ``nccl:reduce_scatter``.)
* ``memory`` — ``(ms, bytes)``: the bytes allocated on this rank over the step: what was live before it
  (parameters and optimizer state) plus the running total of the profiler's allocation events;
* ``predicted`` — :func:`fsdp_accounting` for this configuration: ``state_bytes`` (parameters and
  optimizer state between steps), ``with_gradients`` (and the gradients, after the step) and
  ``peak_gathered_bytes``.

The notebook (``notebooks/05b_fsdp.py``) draws them for prefetch 0, 1 and 2.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from kit.data import random_batch
from kit.model import ModelConfig, TransformerLM, cross_entropy
from kit.spawn import rank_device

from .fsdp import FSDP, fsdp_accounting

PHASES = ("forward", "backward", "finish_gradient_synchronization", "optimizer.step")
COMPUTE = ("aten::mm", "aten::addmm", "aten::bmm", "aten::embedding_dense_backward", "aten::embedding")
GATHERS = (":all_gather", ":_allgather_base")
REDUCTIONS = (":all_reduce", ":reduce_scatter", ":_reduce_scatter_base")


def _lane(event: Any, main_thread: int) -> str | None:
    """Which row of the timeline a profiler event belongs to, if any."""
    if event.name in PHASES:
        return "phase"
    if event.name.endswith(GATHERS):
        return "gather"
    if event.name.endswith(REDUCTIONS):
        return "reduce"
    return "compute" if event.thread == main_thread and event.name in COMPUTE else None


def profile_fsdp_steps(prefetches: Sequence[int] = (0, 1, 2), **options: Any) -> dict[int, dict[str, Any]]:
    """:func:`profile_fsdp_step` for each prefetch value, in one spawn: ``{prefetch: profile}``. ``options``
    are :func:`profile_fsdp_step`'s keywords."""
    return {p: profile_fsdp_step(p, **options) for p in prefetches}


def profile_fsdp_step(
    prefetch: int,
    *,
    reshard_after_forward: bool = True,
    d_model: int = 256,
    layers: int = 4,
    vocab: int = 2048,
    seq: int = 32,
    batch: int = 2,
    warmup: int = 1,
) -> dict[str, Any]:
    """Profile one AdamW step of ``FSDP(TransformerLM, prefetch=prefetch)`` on this rank (see the module doc).

    Times are milliseconds from the start of the profiled step (a barrier aligns the ranks first).
    """
    device = rank_device()
    cfg = ModelConfig(vocab_size=vocab, context_length=seq, d_model=d_model, d_ff=4 * d_model, num_layers=layers,
                      num_heads=4)
    torch.manual_seed(0)
    fsdp = FSDP(TransformerLM(cfg).to(device), prefetch=prefetch, reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
    x, y = random_batch(batch, seq, vocab, device=device, seed=dist.get_rank())

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with record_function("forward"):
            loss = cross_entropy(fsdp(x), y)
        with record_function("backward"):
            loss.backward()
        with record_function("finish_gradient_synchronization"):
            fsdp.finish_gradient_synchronization()
        with record_function("optimizer.step"):
            optimizer.step()

    for _ in range(warmup + 1):  # the first records the execution order, and AdamW allocates its state
        step()
    optimizer.zero_grad(set_to_none=True)  # freed now: the profiler would not see this free of older memory
    state = [*fsdp.parameters(), *(v for s in optimizer.state.values() for v in s.values())]
    live_before = sum(t.untyped_storage().nbytes() for t in state)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = list(prof.events())
    first = min((e for e in events if e.name == "forward"), key=lambda e: e.time_range.start)
    t0, main_thread = first.time_range.start, first.thread
    spans = sorted(((lane, e.name, (e.time_range.start - t0) / 1e3, (e.time_range.end - t0) / 1e3)
                    for e in events if (lane := _lane(e, main_thread))), key=lambda span: span[2])
    results = prof.profiler.kineto_results  # memory events: absolute ns; the spans: µs since the trace began
    allocations = sorted((e.start_ns(), e.nbytes()) for e in results.events() if e.name() == "[memory]")
    totals = itertools.accumulate(b for _, b in allocations)
    memory = [(((t - results.trace_start_ns()) / 1e3 - t0) / 1e3, live_before + total)
              for (t, _), total in zip(allocations, totals)]
    acc = fsdp_accounting(fsdp.unit_shapes, fsdp.replicated_shapes, fsdp.world_size, prefetch=prefetch,
                          reshard_after_forward=reshard_after_forward, optimizer_bytes_per_param=8)
    steps = 4 * len(optimizer.state)  # AdamW's `step` counters: one fp32 scalar per parameter
    return {"spans": spans, "memory": memory,
            "predicted": {"state_bytes": acc.param_bytes + acc.optimizer_bytes + steps,
                          "with_gradients": acc.total_bytes + steps,
                          "peak_gathered_bytes": acc.peak_gathered_bytes}}
