"""Stage 4 benchmark: step time and exposed communication of every DDP variant, next to torch's DDP.

    python -m benchmarks.bench_ddp              # CPU: 2 gloo ranks; GPUs: NCCL on every GPU (at least 2)
    python -m benchmarks.bench_ddp --smoke      # seconds, any machine (into bench-output/smoke/)
    python -m benchmarks.bench_ddp --width 2048 --layers 16 --batch 32 --buckets 1 25 100
    python -m benchmarks.bench_ddp --impl reference --save   # the committed benchmarks/results/ tables
    torchrun --nnodes 2 --nproc-per-node 8 … -m benchmarks.bench_ddp   # one rank per process, any nodes

Run it from the repository root.
The model is a stack of ``--layers`` Linear(width, width) layers with tanh: plenty of gradient bytes per
FLOP, so communication matters. Every method trains the same model on the same data in one run: naive,
flat, individual, bucketed at each ``--buckets`` size, and ``torch.nn.parallel.DistributedDataParallel``
with the same ``bucket_cap_mb``. Per method: mean step time (forward, backward, gradient
synchronisation, SGD step); the step time of the same work without any communication (``compute_ms``,
measured with every rank computing at once, so the ranks contend for the machine as they do in DDP);
``exposed_comm_ms = step_ms - compute_ms``, the communication the backward pass did not hide, and its
share of the step. For torch DDP, the c10d logger's own backward compute, communication and overlap
times are reported as well (averaged over its sampled iterations). Each step is timed with
``kit.bench.step_time`` (all ranks start together; the slowest rank's time counts). Writes
``ddp.{md,csv,json,png}`` into ``bench-output/`` unless ``--out DIR`` or ``--save`` (full reference runs
only) says otherwise.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
from torch import nn

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit import bench, launch
from kit.impl import load
from kit.spawn import rank_device


class Stack(nn.Module):
    """``layers`` × (Linear(width, width) → tanh). Gradients: layers · (width² + width) float32."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _time_steps(step, warmup: int, iters: int) -> list[float]:
    """Seconds per step over ``iters`` steps after ``warmup`` untimed ones (the slowest rank's time)."""
    for _ in range(warmup):
        step()
    return [bench.step_time(step) for _ in range(iters)]


def _bench_rank(impl_name: str, methods: list[tuple[str, float | None]], width: int, layers: int, batch: int,
                warmup: int, iters: int) -> list[dict]:
    impl = load(impl_name)
    device = rank_device()
    rank = dist.get_rank()
    torch.manual_seed(rank + 1)  # different data and initial weights per rank; DDP broadcasts rank 0's
    x = torch.randn(batch, width, device=device)
    rows = []

    def make_step(model: nn.Module, ddp=None):
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            if ddp is not None and hasattr(ddp, "on_train_batch_start"):
                ddp.on_train_batch_start()
            out = (ddp or model)(x)
            out.square().mean().backward()
            if ddp is not None and hasattr(ddp, "finish_gradient_synchronization"):
                ddp.finish_gradient_synchronization()
            optimizer.step()

        return step

    for method, bucket_mb in bench.progress(methods, "ddp", unit="method"):
        # The same work with no communication at all, every rank at once, right before the method.
        model = Stack(width, layers).to(device)
        compute = statistics.fmean(_time_steps(make_step(model), warmup, iters))
        if method == "torch DDP":
            ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb or 25.0)
        elif method == "naive":
            ddp = impl.ddp.NaiveDDP(model)
        elif method == "flat":
            ddp = impl.ddp.FlatDDP(model)
        elif method == "individual":
            ddp = impl.ddp.DDPIndividualParameters(model)
        else:
            ddp = impl.ddp.DDPBucketed(model, bucket_mb)
        # torch DDP rebuilds its buckets after iteration 0: the warm-up covers it.
        step_times = _time_steps(make_step(model, ddp), max(warmup, 2), iters)
        step = statistics.fmean(step_times)
        row = {
            "method": method,
            "bucket_mb": bucket_mb,
            "buckets": None,
            "step_ms": 1e3 * step,
            "step_std_ms": 1e3 * (statistics.stdev(step_times) if len(step_times) > 1 else 0.0),
            "compute_ms": 1e3 * compute,
            "exposed_comm_ms": 1e3 * max(step - compute, 0.0),
            "comm_share": max(step - compute, 0.0) / step,
            "torch_bwd_compute_ms": None,
            "torch_bwd_comm_ms": None,
            "torch_overlap_ms": None,
        }
        if method == "torch DDP":
            data = ddp._get_ddp_logging_data()
            row["buckets"] = len(str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", "")).split(","))
            row["torch_bwd_compute_ms"] = data.get("avg_backward_compute_time", 0) / 1e6
            row["torch_bwd_comm_ms"] = data.get("avg_backward_comm_time", 0) / 1e6
            row["torch_overlap_ms"] = data.get("avg_backward_compute_comm_overlap_time", 0) / 1e6
        elif method == "bucketed":
            row["buckets"] = len(ddp.bucket_names)
        elif method in ("naive", "individual"):
            row["buckets"] = sum(1 for p in model.parameters() if p.requires_grad)
        else:
            row["buckets"] = 1
        rows.append(row)
        del ddp, model
    return rows



@launch.exit_on_launch_error("bench_ddp")
def main(argv: list[str] | None = None) -> list[dict]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    p = bench.parser(__doc__)
    p.add_argument("--world-size", type=int, default=None, help="ranks (default: all GPUs, or 2 on a CPU)")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="rows per rank")
    p.add_argument("--buckets", nargs="+", type=float, default=[1, 10, 100, 1000], help="bucket sizes, MiB")
    p.add_argument("--iters", type=int, default=None)
    args = bench.parse(p, argv)

    if args.smoke:
        width, layers, batch, warmup, iters, buckets = 64, 4, 8, 1, 2, [0.01, 1000]
    elif gpus >= 2:
        width, layers, batch, warmup, iters, buckets = 4096, 24, 64, 5, 20, args.buckets
    else:
        width, layers, batch, warmup, iters, buckets = 1024, 12, 32, 2, 6, args.buckets
    width, layers, batch = args.width or width, args.layers or layers, args.batch or batch
    iters = args.iters or iters
    # Under torchrun the launcher decides: WORLD_SIZE ranks, NCCL when each rank of a node has a GPU.
    world = launch.world_size(args.world_size, gpus if gpus >= 2 else 2, option="--world-size")
    backend = launch.backend_for(launch.launched(), world)

    methods: list[tuple[str, float | None]] = [("naive", None), ("flat", None), ("individual", None)]
    for mb in buckets:
        methods += [("bucketed", mb), ("torch DDP", mb)]
    rows = launch.on_ranks(_bench_rank, world, args=(args.impl, methods, width, layers, batch, warmup, iters),
                           timeout=1200, backend=backend, what="bench_ddp")[0]
    if not launch.is_main():
        return rows  # under torchrun, rank 0 writes the tables
    torch_by_bucket = {r["bucket_mb"]: r["step_ms"] for r in rows if r["method"] == "torch DDP"}
    for r in rows:
        ref = torch_by_bucket.get(r["bucket_mb"]) if r["method"] == "bucketed" else None
        r["vs_torch_ddp"] = r["step_ms"] / ref if ref else None
    grad_mb = layers * (width * width + width) * 4 / 2**20
    title = (f"DDP step time, {world} ranks ({backend}), {layers}×Linear({width}) = {grad_mb:.0f} MiB of "
             f"gradients, batch {batch}/rank")
    for r in rows:
        r.update(world_size=world, backend=backend, grad_mib=grad_mb, batch_per_rank=batch)
    columns = ["method", "bucket_mb", "buckets", "step_ms", "step_std_ms", "compute_ms", "exposed_comm_ms",
               "comm_share", "vs_torch_ddp", "torch_bwd_compute_ms", "torch_bwd_comm_ms", "torch_overlap_ms",
               "world_size", "backend", "grad_mib", "batch_per_rank"]
    bench.save("ddp", rows, args, columns=columns, title=title)

    labels = [r["method"] + ("" if r["bucket_mb"] is None else f"\n{r['bucket_mb']:g} MB") for r in rows]
    compute = [r["compute_ms"] for r in rows]
    exposed = [r["step_ms"] - r["compute_ms"] for r in rows]
    fig, ax = bench.subplots(figsize=(max(6, 0.8 * len(rows)), 4))
    ax.bar(labels, compute, label="compute (no communication)", color="#4c72b0")
    ax.bar(labels, exposed, bottom=compute, label="exposed communication", color="#dd8452")
    ax.set(ylabel="ms per step", title=title)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    bench.save_figure(fig, "ddp", args)
    return rows


if __name__ == "__main__":
    main()
