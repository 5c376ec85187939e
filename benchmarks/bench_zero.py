"""Stage 5 benchmark: per-rank memory and step time of unsharded AdamW, ShardedOptimizer, ZeroRedundancyOptimizer.

    python -m benchmarks.bench_zero                       # CPU: 2 and 3 gloo ranks; GPUs: NCCL on 2 … all GPUs
    python -m benchmarks.bench_zero --smoke               # seconds, any machine (into bench-output/smoke/)
    python -m benchmarks.bench_zero --world-sizes 2 4 --d-model 512 --layers 8
    python -m benchmarks.bench_zero --impl reference --save   # the committed benchmarks/results/ tables
    torchrun --nnodes 2 --nproc-per-node 8 … -m benchmarks.bench_zero   # one world size: the launcher's

Run it from the repository root.
Every rank trains the same kit Transformer on the same batch, so gradients agree without any gradient
communication: the step time is the optimizer's alone (the local update plus sending the updated
parameters). For each optimizer and world size, per rank (the largest rank is reported):

* ``state_mb`` — bytes of the tensors in the optimizer state after the first step (``exp_avg``,
  ``exp_avg_sq``, ``step``); ``predicted_state_mb`` — :func:`zero_memory_accounting` for fp32 Adam
  (``optimizer_bytes_per_param=8``) at stage 0 (AdamW) or 1 (both ZeRO-1 optimizers);
* ``model_mb`` — parameters + gradients + optimizer state live after the step, counted tensor by tensor;
* peak memory in three phases: ``peak_build_mb`` (model construction), ``peak_fwd_bwd_mb`` (forward and
  backward, i.e. just before the step) and ``peak_step_mb`` (the first step, where Adam allocates its
  state). On CUDA: ``torch.cuda.max_memory_allocated`` after resetting the peak at each phase. On a CPU,
  where the allocator keeps no statistics: the tensors live at the start of the phase plus the highest
  running total of the allocations ``torch.profiler(profile_memory=True)`` recorded during it;
* ``step_ms`` — median ``optimizer.step()`` time, each step timed with ``kit.bench.step_time`` (all ranks
  start together; the slowest rank counts). The three optimizers are timed in interleaved rounds, so
  background load hits each of them alike.

Goals (handout 05 §5): the largest rank's state within 5% of (unsharded state)/N plus one parameter's
state (``state_goal``), and ShardedOptimizer's step within 10% of ZeroRedundancyOptimizer's
(``vs_torch_zero``). Writes ``zero.{md,csv,json,png}`` into ``bench-output/`` unless ``--out DIR`` or
``--save`` (full reference runs only) says otherwise.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit import bench, launch
from kit.data import random_batch
from kit.impl import load
from kit.model import ModelConfig, TransformerLM, cross_entropy
from kit.spawn import rank_device

OPTIMIZERS = ("AdamW", "ShardedOptimizer", "ZeroRedundancyOptimizer")
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
MB = 2**20
COLUMNS = ["world_size", "optimizer", "params_m", "state_mb", "predicted_state_mb", "state_vs_predicted",
           "state_goal", "model_mb", "peak_build_mb", "peak_fwd_bwd_mb", "peak_step_mb", "step_ms",
           "vs_torch_zero"]


def _tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among ``tensors`` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _model_state_bytes(model: torch.nn.Module, local_optimizer: torch.optim.Optimizer | None) -> int:
    tensors = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    if local_optimizer is not None:
        tensors += [v for state in local_optimizer.state.values() for v in state.values()]
    return _tensor_bytes(tensors)


def _phase_peak(fn: Callable[[], Any], device: torch.device, live_before: int) -> tuple[Any, int]:
    """Run ``fn``; return its value and the peak bytes allocated while it ran (see the module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        value = fn()
        torch.cuda.synchronize(device)
        return value, torch.cuda.max_memory_allocated(device)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        value = fn()
    try:  # every allocation (+) and free (-) the CPU allocator saw, in time order
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    except AttributeError:  # a torch without the event list: report the live bytes only
        return value, live_before
    running = highest = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        running += event.nbytes()
        highest = max(highest, running)
    return value, live_before + highest


def _build(name: str, impl: Any, cfg: ModelConfig, device: torch.device):
    """A fresh model and optimizer ``name``; returns (model, optimizer, its local optimizer)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = TransformerLM(cfg).to(device)
    if name == "AdamW":
        optimizer = local = torch.optim.AdamW(model.parameters(), **ADAMW)
    elif name == "ShardedOptimizer":
        optimizer = impl.zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
        local = optimizer.local_optimizer
    else:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
        local = optimizer.optim
    return model, optimizer, local


def _interleaved_step_times(steps: dict[str, Callable[[], Any]], warmup: int, iters: int) -> dict[str, list[float]]:
    """Seconds per call of each step function, timed in rounds (A, B, C, A, B, C, …) so that every
    optimizer sees the same background load; each call is timed across the ranks by ``bench.step_time``."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(iters):
        for name, step in steps.items():
            times[name].append(bench.step_time(step))
    return times


def measure_rank(impl_name: str, config: dict, batch_size: int, optimizers: list[str], warmup: int,
                 iters: int) -> list[dict]:
    """Run in every rank: one row per optimizer with this rank's bytes and the (global) step time."""
    impl = load(impl_name)
    device = rank_device()
    cfg = ModelConfig(**config)
    x, y = random_batch(batch_size, cfg.context_length, cfg.vocab_size, device=device, seed=0)

    def forward_backward(model: torch.nn.Module) -> None:
        cross_entropy(model(x), y).backward()

    # Memory: one optimizer at a time, freed before the next, so no run sees another's tensors.
    rows = []
    for name in optimizers:
        (model, optimizer, local), peak_build = _phase_peak(lambda name=name: _build(name, impl, cfg, device),
                                                            device, 0)
        _, peak_fwd_bwd = _phase_peak(lambda model=model: forward_backward(model), device,
                                      _model_state_bytes(model, local))
        _, peak_step = _phase_peak(optimizer.step, device, _model_state_bytes(model, local))
        rows.append({"optimizer": name, "params": model.num_parameters(),
                     "largest_param": max(p.numel() for p in model.parameters()),
                     "state_bytes": impl.zero.optimizer_state_bytes(local),
                     "model_bytes": _model_state_bytes(model, local), "peak_build": peak_build,
                     "peak_fwd_bwd": peak_fwd_bwd, "peak_step": peak_step})
        del model, optimizer, local

    # Time: all optimizers side by side, interleaved (gradients stay from one backward pass).
    steps = {}
    for name in optimizers:
        model, optimizer, _ = _build(name, impl, cfg, device)
        forward_backward(model)
        steps[name] = optimizer.step
    times = _interleaved_step_times(steps, warmup, iters)
    for row in rows:
        row["step_ms"] = 1e3 * statistics.median(times[row["optimizer"]])
    return rows


def summarize(per_rank: list[list[dict]], world_size: int, impl_name: str) -> list[dict]:
    """The largest rank's bytes per optimizer, next to the accounting's prediction and the goals."""
    account = load(impl_name).zero.zero_memory_accounting
    rows = []
    for i, first in enumerate(per_rank[0]):
        worst = {k: max(r[i][k] for r in per_rank) for k in ("state_bytes", "model_bytes", "peak_build",
                                                             "peak_fwd_bwd", "peak_step")}
        stage = 0 if first["optimizer"] == "AdamW" else 1
        predicted = account(first["params"], world_size, stage, param_bytes=4, grad_bytes=4,
                            optimizer_bytes_per_param=8).optimizer_bytes
        # Goal: within 5% of total/N, plus one (the largest) parameter's state, which cannot be split.
        allowance = 1.05 * 8 * first["params"] / (world_size if stage else 1) + 8 * first["largest_param"]
        rows.append({
            "world_size": world_size, "optimizer": first["optimizer"], "params_m": first["params"] / 1e6,
            "state_mb": worst["state_bytes"] / MB, "predicted_state_mb": predicted / MB,
            "state_vs_predicted": worst["state_bytes"] / predicted,
            "state_goal": "met" if worst["state_bytes"] <= allowance else "missed",
            "model_mb": worst["model_bytes"] / MB, "peak_build_mb": worst["peak_build"] / MB,
            "peak_fwd_bwd_mb": worst["peak_fwd_bwd"] / MB, "peak_step_mb": worst["peak_step"] / MB,
            "step_ms": first["step_ms"], "vs_torch_zero": None,
        })
    torch_zero = next((r["step_ms"] for r in rows if r["optimizer"] == "ZeroRedundancyOptimizer"), None)
    for r in rows:
        if r["optimizer"] == "ShardedOptimizer" and torch_zero:
            r["vs_torch_zero"] = r["step_ms"] / torch_zero
    return rows


@launch.exit_on_launch_error("bench_zero")
def main(argv: list[str] | None = None) -> list[dict]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    p = bench.parser(__doc__)
    p.add_argument("--world-sizes", nargs="+", type=int, default=None,
                   help="rank counts (default: 2 and 3 on a CPU; 2 … all GPUs, doubling, on GPUs)")
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    args = bench.parse(p, argv)

    if args.smoke:
        d_model, layers, vocab, ctx, batch, warmup, iters, world_sizes = 64, 2, 256, 32, 2, 1, 3, [2]
    elif gpus >= 2:
        d_model, layers, vocab, ctx, batch, warmup, iters = 1024, 16, 32000, 512, 4, 3, 20
        world_sizes = [w for w in (2, 4, 8, 16) if w <= gpus]
    else:
        d_model, layers, vocab, ctx, batch, warmup, iters, world_sizes = 256, 4, 4096, 64, 2, 2, 15, [2, 3]
    d_model, layers = args.d_model or d_model, args.layers or layers
    iters = args.iters or iters
    world_sizes = launch.world_sizes(args.world_sizes, world_sizes, option="--world-sizes")
    heads = max(1, d_model // 64)
    config = {"vocab_size": vocab, "context_length": ctx, "d_model": d_model, "d_ff": 4 * d_model,
              "num_layers": layers, "num_heads": heads}

    rows: list[dict] = []
    backends = set()
    for world_size in bench.progress(world_sizes, "zero", unit="world size"):
        backend = launch.backend_for(launch.launched(), world_size)
        backends.add(backend)
        per_rank = launch.on_ranks(measure_rank, world_size,
                                   args=(args.impl, config, batch, list(OPTIMIZERS), warmup, iters),
                                   timeout=1200, backend=backend, what="bench_zero")
        rows += summarize(per_rank, world_size, args.impl)
    if not launch.is_main():
        return rows  # under torchrun, rank 0 writes the tables
    title = (f"ZeRO-1, {', '.join(sorted(backends))}: Transformer d_model={d_model}, {layers} layers, "
             f"vocab {vocab} ({rows[0]['params_m']:.2f} M params, fp32 AdamW)")
    bench.save("zero", rows, args, columns=COLUMNS, title=title)

    fig, (ax_mem, ax_time) = bench.subplots(1, 2, figsize=(11, 4))
    world_sizes = sorted({r["world_size"] for r in rows})
    width = 0.8 / len(OPTIMIZERS)
    colors = {"AdamW": "#4c72b0", "ShardedOptimizer": "#dd8452", "ZeroRedundancyOptimizer": "#55a868"}
    for k, name in enumerate(OPTIMIZERS):
        mine = [next((r for r in rows if r["world_size"] == w and r["optimizer"] == name), None) for w in world_sizes]
        xs = [i + (k - 1) * width for i in range(len(world_sizes))]
        ax_mem.bar(xs, [r["state_mb"] if r else 0 for r in mine], width, label=f"{name} (measured)",
                   color=colors[name])
        ax_mem.scatter(xs, [r["predicted_state_mb"] if r else 0 for r in mine], color="black", marker="_", s=200,
                       zorder=3, label="predicted (accounting)" if k == 0 else None)
        ax_time.bar(xs, [r["step_ms"] if r else 0 for r in mine], width, label=name, color=colors[name])
    for ax, ylabel in ((ax_mem, "optimizer state per rank (MiB)"), (ax_time, "optimizer.step() (ms, median)")):
        ax.set_xticks(range(len(world_sizes)), [f"{w} ranks" for w in world_sizes])
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    bench.save_figure(fig, "zero", args)
    return rows


if __name__ == "__main__":
    main()
