"""Stage 6 benchmark (handout 06b): ring attention's tokens/s and peak memory per rank against the sequence length,
for cp ∈ {1, 2, 4}, causal, in both layouts (contiguous and zig-zag).

    python -m benchmarks.bench_context_parallel            # 4 gloo ranks on a CPU; sequences 512 … 4096
    python -m benchmarks.bench_context_parallel --smoke    # 2 ranks, seconds (into bench-output/smoke/)
    python -m benchmarks.bench_context_parallel --impl reference --save   # the committed benchmarks/results/ tables
    torchrun --nnodes 2 --nproc-per-node 2 … -m benchmarks.bench_context_parallel   # the same 4 ranks on two nodes

Run it from the repository root. One spawn runs every configuration. For each cp the ranks form world/cp groups of cp
consecutive ranks (the mesh's cp axis is innermost but for tp), and every group runs the same job at once, so every
rank is busy in every row and the ranks contend for the machine alike. A job is one causal ``ring_attention`` forward
and backward of a ``(batch, heads, s, d_head)`` fp32 sequence (bf16 on GPUs) over its cp group, each rank holding
its shard (``shard_sequence``). Per row:

* ``step_ms`` — one forward + backward, the slowest rank's time (``kit.bench.step_time``), median of the timed steps;
* ``tokens_per_s`` — the group's tokens (batch · s) per second, and ``tokens_per_s_per_rank`` that divided by cp;
* ``peak_MiB`` — the most bytes one rank's forward + backward holds at once beyond its inputs: the outputs, what
  autograd saves, the blocks in flight, the gradients. On a CPU counted by ``kit.allocations.Allocations`` (every new
  storage aten allocates, alive at once), on CUDA the allocator's peak. The largest rank's;
* ``work_max_over_min`` — the exact causal imbalance of the layout (``causal_work``), next to the time it costs.

A GPU row needs one GPU per rank (NCCL); ``make gpu-check`` does not run this benchmark (its budget goes to the
kernels; on one GPU a ring has no peer). Run it on a multi-GPU node with ``torchrun --nproc-per-node 4``.
Writes ``bench_context_parallel.{md,csv,json,png}`` into ``bench-output/`` unless ``--out DIR`` or ``--save`` (full
reference runs only) says otherwise.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit import bench, launch
from kit.impl import load
from kit.spawn import rank_device

LAYOUTS = ("contiguous", "zigzag")


def _peak_bytes(step, device: torch.device) -> int:
    """The most bytes ``step()`` holds at once beyond what existed before it (see the module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    from kit.allocations import Allocations

    with Allocations() as seen:
        step()
    return seen.peak


def _job(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, layout: str):
    """One causal ring-attention forward and backward of this rank's shards, as a step to time."""
    grad_out = torch.randn_like(q)

    def step() -> None:
        ctx.ring_attention(q, k, v, group, is_causal=True, layout=layout).backward(grad_out)
        q.grad = k.grad = v.grad = None

    return step


def _rank(impl_name: str, seqs: list[int], cps: list[int], shape: dict, warmup: int, iters: int) -> list[dict]:
    impl = load(impl_name)
    ctx = impl.parallel.context_parallel
    device = rank_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    world, rank = dist.get_world_size(), dist.get_rank()
    # Groups are collective to create: every rank creates every group of every cp, once, before any timing.
    groups = {}
    for cp in cps:
        mine, _ = dist.new_subgroups_by_enumeration([list(range(i, i + cp)) for i in range(0, world, cp)])
        groups[cp] = mine
    configs = [(s, cp, layout) for s in seqs for cp in cps for layout in (LAYOUTS if cp > 1 else LAYOUTS[:1])]
    rows = []
    for s, cp, layout in bench.progress(configs, f"ring attention on {world} ranks"):
        group = groups[cp]
        cp_rank = dist.get_rank(group)
        torch.manual_seed(s)  # the same full sequence in every group
        full = [torch.randn(shape["batch"], shape["heads"], s, shape["d_head"], dtype=dtype, device=device)
                for _ in range(3)]
        q, k, v = (ctx.shard_sequence(x, cp=cp, cp_rank=cp_rank, layout=layout).requires_grad_() for x in full)
        step = _job(ctx, q, k, v, group, layout)
        for _ in range(warmup):
            step()
        times = [bench.step_time(step, device) for _ in range(iters)]
        peak = _peak_bytes(step, device)
        work = ctx.causal_work(s, cp, layout)
        step_s = statistics.median(times)
        tokens = shape["batch"] * s
        rows.append({"seq_len": s, "cp": cp, "layout": layout, "rank": rank, "step_ms": 1e3 * step_s,
                     "tokens_per_s": tokens / step_s, "tokens_per_s_per_rank": tokens / step_s / cp,
                     "peak_MiB": peak / 2**20, "work_max_over_min": max(work) / min(work)})
        dist.barrier()
    return rows


@launch.exit_on_launch_error("bench_context_parallel")
def main(argv: list[str] | None = None) -> list[dict]:
    p = bench.parser(__doc__)
    p.add_argument("--world-size", type=int, default=None, help="ranks (default 4, or 2 with --smoke)")
    p.add_argument("--seqs", nargs="+", type=int, default=[512, 1024, 2048, 4096], help="sequence lengths")
    p.add_argument("--iters", type=int, default=3, help="timed steps per row (the median is reported)")
    args = bench.parse(p, argv)
    if args.smoke:
        seqs, shape, warmup, iters, default_world = [32, 64], dict(batch=1, heads=2, d_head=16), 1, 2, 2
    else:
        seqs, shape, warmup, iters, default_world = args.seqs, dict(batch=1, heads=4, d_head=64), 1, args.iters, 4
    world = launch.world_size(args.world_size, default_world, option="--world-size")
    backend = launch.backend_for(launch.launched(), world)
    cps = [cp for cp in (1, 2, 4) if world % cp == 0]
    per_rank = launch.on_ranks(_rank, world, args=(args.impl, seqs, cps, shape, warmup, iters), timeout=1800,
                               backend=backend, what="bench_context_parallel")
    if not launch.is_main():
        return per_rank[launch.launched().rank]  # under torchrun, rank 0 writes the tables
    rows = []
    for i, first in enumerate(per_rank[0]):
        ranks = [r[i] for r in per_rank]
        rows.append({k: first[k] for k in ("seq_len", "cp", "layout")} | {
            # Every rank's step_time is already the slowest rank's; memory: the most loaded rank.
            "step_ms": first["step_ms"], "tokens_per_s": first["tokens_per_s"],
            "tokens_per_s_per_rank": first["tokens_per_s_per_rank"],
            "peak_MiB": max(r["peak_MiB"] for r in ranks), "work_max_over_min": first["work_max_over_min"],
            "world_size": world, "backend": backend, "dtype": "bf16" if backend == "nccl" else "fp32",
            "batch": shape["batch"], "heads": shape["heads"], "d_head": shape["d_head"]})
    title = (f"Causal ring attention, forward + backward, {world} ranks ({backend}): tokens/s and peak memory per "
             f"rank against the sequence length")
    notes = [] if backend == "nccl" else [
        "Ranks share the CPU's cores: a rank that waits for its neighbour frees its core for a busy one, so the "
        "contiguous layout's causal imbalance costs less time here than on GPUs, where every rank has its own device "
        "and each ring step waits for the slowest (handout 06b §5)."]
    bench.save("bench_context_parallel", rows, args, title=title, notes=notes)

    fig, (left, right) = bench.subplots(1, 2, figsize=(11, 4))
    for cp in cps:
        for layout in LAYOUTS if cp > 1 else LAYOUTS[:1]:
            sel = [r for r in rows if r["cp"] == cp and r["layout"] == layout]
            label, style = f"cp={cp}" + (f" {layout}" if cp > 1 else ""), "--" if layout == "zigzag" else "-"
            left.plot([r["seq_len"] for r in sel], [r["tokens_per_s"] for r in sel], style, marker="o", label=label)
            right.plot([r["seq_len"] for r in sel], [r["peak_MiB"] for r in sel], style, marker="o", label=label)
    left.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="tokens/s (one cp group)",
             title="Throughput, causal forward + backward")
    right.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="MiB",
              title="Peak memory per rank beyond the inputs")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    bench.save_figure(fig, "bench_context_parallel", args)
    return rows


if __name__ == "__main__":
    main()
