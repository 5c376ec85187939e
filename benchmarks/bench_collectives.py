"""Stage 4 benchmark: all-reduce time, algorithm bandwidth and bus bandwidth by message size and number of ranks.

    python -m benchmarks.bench_collectives            # GPUs: NCCL, 1 MB … 1 GB over 2, 4, 6 GPUs (those present)
                                                      # CPU: gloo, 1 MB … 64 MB over 2 and 4 ranks
    python -m benchmarks.bench_collectives --smoke    # seconds, any machine (into bench-output/smoke/)
    python -m benchmarks.bench_collectives --sizes-mb 1 16 256 --world-sizes 2 4
    python -m benchmarks.bench_collectives --impl reference --save   # the committed benchmarks/results/ tables

Run it from the repository root. Bus bandwidth = 2(n-1)/n · size / time: the bytes each rank's link
carries in a ring all-reduce, so numbers for different n compare with each other and with the link's
rated bandwidth (handout 04 §6). Writes ``collectives.{md,csv,json,png}`` into ``bench-output/`` unless
``--out DIR`` or ``--save`` (full reference runs only) says otherwise.
"""

from __future__ import annotations

import torch

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit import bench, launch
from kit.impl import load

MB = 10**6


@launch.exit_on_launch_error("bench_collectives")
def main(argv: list[str] | None = None) -> list[dict]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    p = bench.parser(__doc__)
    p.add_argument("--sizes-mb", nargs="+", type=float, default=None, help="message sizes in MB (10^6 bytes)")
    p.add_argument("--world-sizes", nargs="+", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    args = bench.parse(p, argv)
    if launch.launched() is not None:
        # Your all_reduce_benchmark (Stage 4) starts its own ranks for each world size, on this machine.
        raise launch.LaunchError("bench_collectives spawns its own ranks on this machine, one set per world size: "
                                 "run it with `python -m benchmarks.bench_collectives`, not under torchrun")

    if args.smoke:
        sizes_mb, worlds, warmup, iters = [0.01, 0.1], [2], 1, 2
    elif gpus >= 2:
        sizes_mb, worlds, warmup, iters = [1, 10, 100, 1000], [w for w in (2, 4, 6) if w <= gpus], 5, 20
    else:
        sizes_mb, worlds, warmup, iters = [1, 4, 16, 64], [2, 4], 2, 5
    sizes_mb, worlds, iters = args.sizes_mb or sizes_mb, args.world_sizes or worlds, args.iters or iters
    backend = "nccl" if gpus >= max(worlds) else "gloo"
    collectives = load(args.impl).collectives
    sizes = [int(mb * MB) // 4 * 4 for mb in sizes_mb]  # whole float32 elements

    rows = []
    for world in bench.progress(worlds, "all-reduce", unit="world size"):
        rows += collectives.all_reduce_benchmark(sizes, [world], backend=backend, warmup=warmup, iters=iters)
    title = f"all-reduce, {backend}, {iters} timed calls per size"
    bench.save("collectives", rows, args, title=title)

    fig, axes = bench.subplots(1, 2, figsize=(11, 4))
    for world in dict.fromkeys(r["world_size"] for r in rows):
        sel = [r for r in rows if r["world_size"] == world]
        sizes = [r["size_bytes"] / MB for r in sel]
        axes[0].plot(sizes, [r["time_ms"] for r in sel], marker="o", label=f"{world} ranks")
        axes[1].plot(sizes, [r["busbw_gbps"] for r in sel], marker="o", label=f"{world} ranks")
    axes[0].set(xlabel="message size (MB)", ylabel="time (ms)", title="All-reduce time", xscale="log", yscale="log")
    axes[1].set(xlabel="message size (MB)", ylabel="bus bandwidth (GB/s)", title="Bus bandwidth = 2(n−1)/n · S / t",
                xscale="log")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    bench.save_figure(fig, "collectives", args)
    return rows


if __name__ == "__main__":
    main()
