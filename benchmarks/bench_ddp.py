"""Step time and exposed communication of every DDP variant, next to torch's DistributedDataParallel.

    python benchmarks/bench_ddp.py              # CPU: 2 gloo ranks; GPUs: NCCL on every GPU (at least 2)
    python benchmarks/bench_ddp.py --smoke      # seconds, any machine
    python benchmarks/bench_ddp.py --width 2048 --layers 16 --batch 32 --buckets 1 25 100

The model is a stack of ``--layers`` Linear(width, width) layers with tanh: plenty of gradient bytes per
FLOP, so communication matters. Every method trains the same model on the same data in one run: naive,
flat, individual, bucketed at each ``--buckets`` size, and ``torch.nn.parallel.DistributedDataParallel``
with the same ``bucket_cap_mb``. Per method: mean step time (forward, backward, gradient
synchronisation, SGD step); the step time of the same work without any communication (``compute_ms``,
measured with every rank computing at once, so the ranks contend for the machine as they do in DDP);
``exposed_comm_ms = step_ms - compute_ms``, the communication the backward pass did not hide, and its
share of the step. For torch DDP, the c10d logger's own backward compute, communication and overlap
times are reported as well (averaged over its sampled iterations). Writes ``ddp.{csv,json,md}`` and
``ddp.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# Run as `python benchmarks/<name>.py`: the kit lives one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit.impl import load
from kit.results import RESULTS_DIR, save_results
from kit.spawn import rank_device, run_on_ranks


class Stack(nn.Module):
    """``layers`` × (Linear(width, width) → tanh). Gradients: layers · (width² + width) float32."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_steps(step, device: torch.device, warmup: int, iters: int) -> list[float]:
    """Seconds per step, each step's end aligned across ranks (the slowest rank's time counts)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        step()
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed.item()))
    return times


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

    for method, bucket_mb in tqdm(methods, desc="ddp", unit="method", disable=rank != 0):
        # The same work with no communication at all, every rank at once, right before the method.
        model = Stack(width, layers).to(device)
        compute = statistics.fmean(_time_steps(make_step(model), device, warmup, iters))
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
        step_times = _time_steps(make_step(model, ddp), device, max(warmup, 2), iters)
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


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["method"] + ("" if r["bucket_mb"] is None else f"\n{r['bucket_mb']:g} MB") for r in rows]
    compute = [r["compute_ms"] for r in rows]
    exposed = [r["step_ms"] - r["compute_ms"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(rows)), 4))
    ax.bar(labels, compute, label="compute (no communication)", color="#4c72b0")
    ax.bar(labels, exposed, bottom=compute, label="exposed communication", color="#dd8452")
    ax.set(ylabel="ms per step", title=title)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: all GPUs, or 2 on a CPU)")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="rows per rank")
    parser.add_argument("--buckets", nargs="+", type=float, default=[1, 10, 100, 1000], help="bucket sizes, MiB")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--impl", default=None, help="student or reference (default: $LLMSYS_IMPL or student)")
    args = parser.parse_args(argv)

    if args.smoke:
        width, layers, batch, warmup, iters, buckets = 64, 4, 8, 1, 2, [0.01, 1000]
    elif gpus >= 2:
        width, layers, batch, warmup, iters, buckets = 4096, 24, 64, 5, 20, args.buckets
    else:
        width, layers, batch, warmup, iters, buckets = 1024, 12, 32, 2, 6, args.buckets
    width, layers, batch = args.width or width, args.layers or layers, args.batch or batch
    iters = args.iters or iters
    world = args.world_size or (gpus if gpus >= 2 else 2)
    backend = "nccl" if gpus >= world else "gloo"
    impl_name = load(args.impl).package

    methods: list[tuple[str, float | None]] = [("naive", None), ("flat", None), ("individual", None)]
    for mb in buckets:
        methods += [("bucketed", mb), ("torch DDP", mb)]
    rows = run_on_ranks(_bench_rank, world, args=(impl_name, methods, width, layers, batch, warmup, iters),
                        timeout=1200, backend=backend)[0]
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
    paths = save_results("ddp", rows, out_dir=args.out, columns=columns, title=title)
    plot(rows, paths["csv"].with_suffix(".png"), title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
