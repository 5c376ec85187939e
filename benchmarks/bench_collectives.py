"""All-reduce time, algorithm bandwidth and bus bandwidth by message size and number of ranks.

    python benchmarks/bench_collectives.py            # GPUs: NCCL, 1 MB … 1 GB over 2, 4, 6 GPUs (those present)
                                                      # CPU: gloo, 1 MB … 64 MB over 2 and 4 ranks
    python benchmarks/bench_collectives.py --smoke    # seconds, any machine
    python benchmarks/bench_collectives.py --sizes-mb 1 16 256 --world-sizes 2 4

Bus bandwidth = 2(n-1)/n · size / time: the bytes each rank's link carries in a ring all-reduce, so
numbers for different n compare with each other and with the link's rated bandwidth (handout 04 §6).
Writes ``collectives.{csv,json,md}`` and ``collectives.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as `python benchmarks/<name>.py`: the kit lives one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from tqdm import tqdm

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit.impl import load
from kit.results import RESULTS_DIR, save_results

MB = 10**6


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--sizes-mb", nargs="+", type=float, default=None, help="message sizes in MB (10^6 bytes)")
    parser.add_argument("--world-sizes", nargs="+", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--impl", default=None, help="student or reference (default: $LLMSYS_IMPL or student)")
    args = parser.parse_args(argv)

    if args.smoke:
        sizes_mb, worlds, warmup, iters = [0.01, 0.1], [2], 1, 2
    elif gpus >= 2:
        sizes_mb, worlds, warmup, iters = [1, 10, 100, 1000], [w for w in (2, 4, 6) if w <= gpus], 5, 20
    else:
        sizes_mb, worlds, warmup, iters = [1, 4, 16, 64], [2, 4], 2, 5
    sizes_mb = args.sizes_mb or sizes_mb
    worlds = args.world_sizes or worlds
    iters = args.iters or iters
    backend = "nccl" if gpus >= max(worlds) else "gloo"
    coll = load(args.impl).collectives
    sizes = [int(mb * MB) // 4 * 4 for mb in sizes_mb]  # whole float32 elements

    rows = []
    for world in tqdm(worlds, desc="all-reduce", unit="world size"):
        rows += coll.all_reduce_benchmark(sizes, [world], backend=backend, warmup=warmup, iters=iters)
    title = f"all-reduce, {backend}, {iters} timed calls per size"
    paths = save_results("collectives", rows, out_dir=args.out, title=title)
    plot(rows, paths["csv"].with_suffix(".png"), title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
