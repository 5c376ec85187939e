# Given code — read, don't edit. Generated from the kit's reference by `make student`.
"""Stage 4 — see the overlap: a torch.profiler timeline of one DDP training step (given code, no exercise).

``run_on_ranks(profile_ddp_step, 2, args=("bucketed", 1.0))`` profiles one step of a stack of Linear
layers wrapped in one of your DDP classes and returns, per rank, the spans a timeline needs:

* ``phase``: the ``forward``, ``backward`` and ``finish_gradient_synchronization`` ranges;
* ``compute``: each autograd function the backward pass ran (``AddmmBackward0`` …) on the main thread;
* ``comm``: each all-reduce (``gloo:all_reduce``, ``nccl:all_reduce``) from launch to completion. Async
  all-reduces run on the backend's own threads, so they can overlap the compute spans.

The notebook (``notebooks/04_ddp.py``) draws these for DDPIndividualParameters and DDPBucketed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from kit.spawn import rank_device

from .ddp import DDPBucketed, DDPIndividualParameters, FlatDDP, NaiveDDP

PHASES = ("forward", "backward", "finish_gradient_synchronization")


def _stack(width: int, layers: int) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods)


def profile_ddp_step(
    kind: str,
    bucket_size_mb: float | None = None,
    *,
    width: int = 256,
    layers: int = 8,
    batch: int = 64,
    warmup: int = 2,
) -> list[tuple[str, str, float, float]]:
    """Profile one training step on this rank; return ``(lane, name, start_ms, end_ms)`` spans.

    Args:
        kind: ``"naive"``, ``"flat"``, ``"individual"`` or ``"bucketed"``.
        bucket_size_mb: the bucket cap for ``"bucketed"`` (ignored otherwise).
        width, layers, batch: the model (``layers`` × Linear(width, width) + tanh) and rows per rank.
        warmup: untimed steps before the profiled one.

    Times are milliseconds from the start of the profiled step (a barrier aligns the ranks first).

    Raises:
        ValueError: an unknown ``kind``.
    """
    kinds = {"naive": NaiveDDP, "flat": FlatDDP, "individual": DDPIndividualParameters, "bucketed": DDPBucketed}
    if kind not in kinds:
        raise ValueError(f"kind must be one of {sorted(kinds)}, got {kind!r}")
    device = rank_device()
    torch.manual_seed(dist.get_rank())
    model = _stack(width, layers).to(device)
    ddp = DDPBucketed(model, bucket_size_mb) if kind == "bucketed" else kinds[kind](model)
    x = torch.randn(batch, width, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> None:
        ddp.on_train_batch_start()
        with record_function("forward"):
            loss = ddp(x).square().mean()
        with record_function("backward"):
            loss.backward()
        with record_function("finish_gradient_synchronization"):
            ddp.finish_gradient_synchronization()
        sync()
        model.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    dist.barrier()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
    events = list(prof.events())
    main_thread = next(e.thread for e in events if e.name == "forward")
    t0 = min(e.time_range.start for e in events if e.name == "forward")
    spans = []
    for e in events:
        start, end = (e.time_range.start - t0) / 1e3, (e.time_range.end - t0) / 1e3
        if e.name in PHASES:
            spans.append(("phase", e.name, start, end))
        elif e.name.endswith(":all_reduce"):
            spans.append(("comm", e.name, start, end))
        elif e.thread == main_thread and e.name.endswith("Backward0") and not e.name.startswith("autograd::"):
            spans.append(("compute", e.name, start, end))
    return sorted(spans, key=lambda s: s[2])
