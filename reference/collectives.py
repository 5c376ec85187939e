"""Stage 4 — how fast is an all-reduce? The single-node collective benchmark (handout/04-ddp.md §6).

An all-reduce of ``S`` bytes over ``n`` ranks, done as a ring, sends ``2(n-1)/n · S`` bytes out of each
rank (a reduce-scatter then an all-gather, each moving ``(n-1)/n · S``). Two bandwidths follow from the
measured time ``t``, as in nccl-tests:

* algorithm bandwidth ``algbw = S / t`` — what the caller sees;
* bus bandwidth ``busbw = algbw · 2(n-1)/n`` — what each link carried; comparable across ``n`` and with
  the hardware's link bandwidth.

Timing a collective: every rank must start together (a barrier first), the work must be finished before
the clock stops (``torch.cuda.synchronize()`` under NCCL: the call only queues the kernel), and the
first calls pay for connection set-up (warm-up). The slowest rank's time is the collective's time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from kit.spawn import rank_device, run_on_ranks
from kit.validate import choice, integer, non_negative_int, positive_int, positive_number

__all__ = ["all_reduce_benchmark", "bus_bandwidth", "time_all_reduce"]


def bus_bandwidth(size_bytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in bytes per second for an all-reduce of ``size_bytes`` taking ``seconds``.

    ``algbw = size_bytes / seconds`` and ``busbw = algbw · 2(world_size - 1) / world_size``.

    Raises:
        TypeError: a value of the wrong type (``world_size`` not an int, a size or time not a number).
        ValueError: a size, time or world size that is not positive.
    """
    positive_int("size_bytes", size_bytes)
    positive_number("seconds", seconds)
    positive_int("world_size", world_size)
    # BEGIN SOLUTION algorithm bandwidth is size / time; bus bandwidth scales it by 2(n-1)/n (handout 04 §6)
    algbw = size_bytes / seconds
    return algbw, algbw * 2 * (world_size - 1) / world_size
    # END SOLUTION


def time_all_reduce(size_bytes: int, *, warmup: int = 3, iters: int = 10) -> float:
    """Seconds per all-reduce of ``size_bytes`` of float32, measured on the calling rank's process group.

    Run on every rank (inside ``kit.spawn.run_on_ranks``). Each timed call is preceded by a barrier and
    followed by a device synchronisation; returns the mean over ``iters`` calls of the *slowest* rank's
    time (an all-reduce of the per-rank times with ``MAX``), so every rank returns the same number.
    The reduced tensor is checked: rank r contributes r + 1 everywhere, so each element must end up
    equal to n(n+1)/2.

    Raises:
        TypeError: a size or count that is not an int.
        ValueError: ``size_bytes < 4``, ``warmup < 0`` or ``iters < 1``.
        RuntimeError: the all-reduce returned a wrong sum.
    """
    integer("size_bytes", size_bytes, minimum=4)  # one float32
    non_negative_int("warmup", warmup)
    positive_int("iters", iters)
    device = rank_device()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = dist.get_world_size()
    data = torch.empty(size_bytes // 4, dtype=torch.float32, device=device)
    # BEGIN SOLUTION warm up; time barrier-aligned, synced calls; MAX over ranks (handout 04 §6)
    for _ in range(warmup):
        dist.all_reduce(data)
    total = 0.0
    for _ in range(iters):
        data.fill_(dist.get_rank() + 1)
        dist.barrier()
        sync()
        start = time.perf_counter()
        dist.all_reduce(data)
        sync()
        total += time.perf_counter() - start
    expected = n * (n + 1) / 2
    if not torch.all(data == expected):
        raise RuntimeError(f"all-reduce of {size_bytes} bytes gave a wrong sum (expected {expected})")
    mean = torch.tensor([total / iters], dtype=torch.float64, device=device)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    return float(mean.item())
    # END SOLUTION


# ------------------------------------------------------------------------------------------------------
# Given: the benchmark driver. It spawns the ranks and calls your time_all_reduce for every size.


def _benchmark_on_rank(sizes_bytes: list[int], warmup: int, iters: int) -> list[float]:
    return [time_all_reduce(size, warmup=warmup, iters=iters) for size in sizes_bytes]


def all_reduce_benchmark(
    sizes_bytes: Sequence[int],
    world_sizes: Sequence[int],
    backend: str | None = None,
    device: str | None = None,
    *,
    warmup: int = 3,
    iters: int = 10,
    timeout: float = 600.0,
) -> list[dict]:
    """All-reduce timings and bandwidths for every (world size, message size), one spawn per world size.

    Args:
        sizes_bytes: message sizes in bytes, each a positive multiple of 4 (float32 elements).
        world_sizes: numbers of ranks, each ≥ 2.
        backend: ``"gloo"``, ``"nccl"`` or ``None`` (NCCL when there are enough GPUs, else gloo).
        device: ``"cpu"``, ``"cuda"`` or ``None`` (follows the backend). gloo runs on the CPU, NCCL on GPUs.
        warmup, iters: untimed and timed calls per size.

    Returns:
        one row per (world size, size): ``backend``, ``device``, ``world_size``, ``size_bytes``, ``size_mb``
        (10**6 bytes), ``time_ms``, ``algbw_gbps`` and ``busbw_gbps`` (GB/s, 10**9 bytes per second).

    Raises:
        TypeError: a size or world size that is not an int.
        ValueError: an unknown backend or device, a backend that does not suit the device, empty lists, a size
            under 4 bytes, a world size under 2, or more NCCL ranks than GPUs.
    """
    sizes = list(sizes_bytes)
    worlds = list(world_sizes)
    for i, s in enumerate(sizes):
        integer(f"sizes_bytes[{i}]", s, minimum=4)
    for i, w in enumerate(worlds):
        integer(f"world_sizes[{i}]", w, minimum=2)
    if not sizes or not worlds or any(s % 4 for s in sizes):
        raise ValueError(f"sizes_bytes must be non-empty multiples of 4 bytes and world_sizes non-empty, got "
                         f"sizes_bytes={sizes!r}, world_sizes={worlds!r}")
    choice("backend", backend, (None, "gloo", "nccl"))
    choice("device", device, (None, "cpu", "cuda"))
    if device == "cpu" and backend == "nccl":
        raise ValueError("backend 'nccl' needs device 'cuda'; use 'gloo' for the CPU")
    if device == "cuda" and backend == "gloo":
        raise ValueError("this benchmark runs gloo on the CPU; use backend 'nccl' or None for device 'cuda'")
    if backend is None and device == "cpu":
        backend = "gloo"
    rows = []
    for world in worlds:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        chosen = backend or ("nccl" if gpus >= world else "gloo")
        if chosen == "nccl" and gpus < world:
            raise ValueError(f"world size {world} needs {world} GPUs for NCCL, found {gpus}")
        times = run_on_ranks(_benchmark_on_rank, world, args=(sizes, warmup, iters), timeout=timeout,
                             backend=chosen)[0]
        for size, seconds in zip(sizes, times):
            algbw, busbw = bus_bandwidth(size, seconds, world)
            rows.append({
                "backend": chosen,
                "device": "cuda" if chosen == "nccl" else "cpu",
                "world_size": world,
                "size_bytes": size,
                "size_mb": size / 1e6,
                "time_ms": 1e3 * seconds,
                "algbw_gbps": algbw / 1e9,
                "busbw_gbps": busbw / 1e9,
            })
    return rows
