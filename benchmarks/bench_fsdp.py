"""Stage 5 benchmark: FSDP's per-rank memory and step time, against DDP, ZeRO-1 and torch's ``fully_shard``.

    python -m benchmarks.bench_fsdp                       # 2 gloo ranks on a CPU; NCCL when there are 2+ GPUs
    python -m benchmarks.bench_fsdp --smoke               # seconds, any machine (into bench-output/smoke/)
    python -m benchmarks.bench_fsdp --d-model 512 --layers 8 --compute-dtype bf16
    python -m benchmarks.bench_fsdp --impl reference --save   # the committed benchmarks/results/ tables
    torchrun --nnodes 2 --nproc-per-node 8 … -m benchmarks.bench_fsdp   # one rank per process, any nodes

Run it from the repository root. Every rank trains the kit Transformer with AdamW on its own part of
each batch, in one spawn, with each implementation built side by side:

* ``DDP`` — Stage 4's ``DDPBucketed`` and ``torch.optim.AdamW``;
* ``ZeRO-1`` — ``DDPBucketed`` and Stage 5's ``ShardedOptimizer``;
* ``FSDP p0/p1/p2`` — this stage's ``FSDP`` with prefetch 0, 1, 2 (resharding after forward), and
  ``FSDP p1 keep`` without resharding;
* ``fully_shard`` — PyTorch's FSDP2 with the same units (every module owning a matrix) and the root for
  the norm gains, ``reshard_after_forward=True``, the same compute dtype.

Per implementation, for the rank that holds the most:

* ``state_mb`` — parameters + gradients + optimizer state this rank holds after a step (local tensors,
  each storage once); ``predicted_mb`` — the accounting: ``zero_memory_accounting`` (stage 0 for DDP,
  1 for ZeRO-1; fp32 Adam) and ``fsdp_accounting`` for FSDP and ``fully_shard``; ``state_goal`` — within
  5 % (handout 05b §7);
* ``peak_mb`` — the most bytes allocated during a step: on CUDA the allocator's peak; on a CPU the live
  model state before the step plus the highest running total of ``torch.profiler``'s allocation events;
* ``comm_mb`` — the bytes handed to collectives in one step, recorded by ``kit.comm_log``;
  ``predicted_comm_mb`` — the FSDP accounting's (all-gathers, reduce-scatters, all-reduces), and for DDP
  every gradient once (its all-reduces), for this kit's ZeRO-1 every gradient and every parameter (its
  broadcasts). Bytes *handed in*: on gloo a reduce-scatter sends what an all-reduce sends (handout 05b §5);
* ``step_ms`` — median step (zero_grad, forward, backward, gradient synchronisation, optimizer step),
  timed with ``kit.bench.step_time`` in interleaved rounds so background load hits each alike;
  ``vs_fully_shard`` — the ratio to ``fully_shard``'s, goal ≤ 1.2 (handout 05b §9).

An implementation that is not there yet — a stub of Stage 4 (``DDP``, ``ZeRO-1``), Stage 5's ZeRO-1
(``ZeRO-1``) or this chapter's FSDP raising ``NotImplementedError`` while it is built, takes its first step
or is accounted for — is skipped and named (``note``), and the others run: each stage's rows work as soon as
that stage is done. ``fully_shard`` is torch's own and always runs.

Writes ``bench_fsdp.{md,csv,json,png}``.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from typing import Any

import torch

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit import bench, launch
from kit.comm_log import CommLog
from kit.data import random_batch
from kit.impl import load
from kit.model import ModelConfig, TransformerLM, cross_entropy
from kit.spawn import rank_device

ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
MB = 2**20
FSDP_ROWS = {"FSDP p0": {"prefetch": 0}, "FSDP p1": {"prefetch": 1}, "FSDP p2": {"prefetch": 2},
             "FSDP p1 keep": {"prefetch": 1, "reshard_after_forward": False}}
IMPLEMENTATIONS = ("DDP", "ZeRO-1", *FSDP_ROWS, "fully_shard")
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
COLUMNS = ["world_size", "impl", "params_m", "state_mb", "predicted_mb", "state_vs_predicted", "state_goal",
           "peak_mb", "comm_mb", "predicted_comm_mb", "step_ms", "vs_fully_shard", "note"]


def _matrix_owners(model: torch.nn.Module) -> list[str]:
    """FSDP's default units: the modules that directly own a parameter of two or more dimensions."""
    return [n for n, m in model.named_modules() if any(p.dim() >= 2 for p in m.parameters(recurse=False))]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank


def _held_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """Bytes of distinct storages of the parameters, their gradients and the optimizer state on this rank."""
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    if hasattr(optimizer, "local_optimizer"):  # ShardedOptimizer: the state lives in its local optimizer
        state = [v for s in optimizer.local_optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    tensors = [_local(t) for t in params + [p.grad for p in params if p.grad is not None] + state]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _peak_above(fn: Callable[[], Any], device: torch.device) -> int:
    """The most bytes allocated above the starting point while ``fn`` runs (see the module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    deltas = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    return max(itertools.accumulate((d for _, d in deltas), initial=0))


def _build(name: str, impl: Any, cfg: ModelConfig, compute_dtype: torch.dtype | None, device: torch.device):
    """(model, what the step calls, optimizer, the model's parameters on this rank) for implementation ``name``."""
    torch.manual_seed(0)
    model = TransformerLM(cfg).to(device)
    if name in ("DDP", "ZeRO-1"):
        wrapper = impl.ddp.DDPBucketed(model, bucket_size_mb=25)
        optimizer = (torch.optim.AdamW(model.parameters(), **ADAMW) if name == "DDP"
                     else impl.zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW))
    elif name == "fully_shard":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        for unit in _matrix_owners(model):
            fully_shard(model.get_submodule(unit), mp_policy=policy)
        wrapper = fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    else:
        wrapper = impl.fsdp.FSDP(model, compute_dtype=compute_dtype, **FSDP_ROWS[name])
        optimizer = torch.optim.AdamW(wrapper.parameters(), **ADAMW)
    return wrapper, optimizer, list(model.parameters())


def _step_fn(wrapper: Any, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        if hasattr(wrapper, "on_train_batch_start"):
            wrapper.on_train_batch_start()
        cross_entropy(wrapper(x), y).backward()
        if hasattr(wrapper, "finish_gradient_synchronization"):  # fully_shard synchronises inside backward
            wrapper.finish_gradient_synchronization()
        optimizer.step()

    return step


def measure_rank(impl_name: str, config: dict, batch_size: int, dtype: str, names: list[str], warmup: int,
                 iters: int) -> list[dict]:
    """Run in every rank: one row per implementation with this rank's bytes and the (global) step time."""
    import torch.distributed as dist

    impl = load(impl_name)
    device = rank_device()
    cfg = ModelConfig(**config)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = random_batch(batch_size * world, cfg.context_length, cfg.vocab_size, device=device, seed=0)
    x, y = x[rank * batch_size: (rank + 1) * batch_size], y[rank * batch_size: (rank + 1) * batch_size]
    built, steps, skipped = {}, {}, {}
    for name in names:
        # Every rank runs the same code, so a stub raises on every rank at the same point: all skip it alike.
        try:
            built[name] = _build(name, impl, cfg, DTYPES[dtype], device)
            wrapper, optimizer, _ = built[name]
            steps[name] = _step_fn(wrapper, optimizer, x, y)
            steps[name]()  # the first step: AdamW allocates its state, FSDP records the order
        except NotImplementedError as exc:
            built.pop(name, None)
            steps.pop(name, None)
            skipped[name] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    rows = [{"impl": name, "skipped": why} for name, why in skipped.items()]
    for name, (wrapper, optimizer, params) in built.items():
        before = _held_bytes(params, optimizer)
        peak = before + _peak_above(steps[name], device)
        with CommLog() as log:
            steps[name]()
        rows.append({"impl": name, "params": sum(p.numel() for p in TransformerLM(cfg).parameters()),
                     "state": _held_bytes(params, optimizer), "peak": peak,
                     "comm": sum(log.bytes_by_op().values()),
                     "unit_shapes": getattr(wrapper, "unit_shapes", None),
                     "replicated_shapes": getattr(wrapper, "replicated_shapes", None)})
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in bench.progress(range(iters), "timed rounds", unit="round"):
        for name, step in steps.items():
            times[name].append(bench.step_time(step))
    for row in rows:
        if "skipped" not in row:
            row["step_ms"] = 1e3 * statistics.median(times[row["impl"]])
    order = {name: i for i, name in enumerate(names)}
    return sorted(rows, key=lambda r: order[r["impl"]])


def summarize(per_rank: list[list[dict]], world: int, impl_name: str, dtype: str) -> list[dict]:
    """The largest rank's bytes per implementation, next to the accounting and the goals."""
    impl = load(impl_name)
    fsdp_shapes = next((r for r in per_rank[0] if r.get("unit_shapes") is not None), None)
    compute_bytes = 4 if DTYPES[dtype] is None else 2
    rows = []
    for i, first in enumerate(per_rank[0]):
        name = first["impl"]
        if "skipped" in first:
            rows.append({"world_size": world, "impl": name, "note": f"not implemented yet: {first['skipped']}"})
            continue
        psi = first["params"]
        worst = {k: max(r[i][k] for r in per_rank) for k in ("state", "peak", "comm")}
        row = {"world_size": world, "impl": name, "params_m": psi / 1e6, "state_mb": worst["state"] / MB,
               "peak_mb": worst["peak"] / MB, "comm_mb": worst["comm"] / MB, "step_ms": first["step_ms"],
               "vs_fully_shard": None, "note": ""}
        try:
            row.update(_predicted(impl, name, psi, world, fsdp_shapes, compute_bytes, worst["state"]))
        except NotImplementedError as exc:  # the accounting of an unfinished stage: measure, don't predict
            row["note"] = f"no prediction, accounting not implemented yet: {str(exc).splitlines()[0]}"
        rows.append(row)
    reference = next((r["step_ms"] for r in rows if r["impl"] == "fully_shard"), None)
    for r in rows:
        if reference and r["impl"].startswith("FSDP") and r.get("step_ms") is not None:
            r["vs_fully_shard"] = r["step_ms"] / reference
    return rows


def _predicted(impl: Any, name: str, psi: int, world: int, fsdp_shapes: dict | None, compute_bytes: int,
               state: int) -> dict:
    """The accounting's state and handed-in bytes for one implementation's row (fp32 Adam)."""
    predicted_comm = None
    if name in ("DDP", "ZeRO-1"):
        predicted = impl.zero.zero_memory_accounting(psi, world, 0 if name == "DDP" else 1, param_bytes=4,
                                                     grad_bytes=4, optimizer_bytes_per_param=8).total_bytes
        # Handed in: every fp32 gradient to DDP's all-reduces; ZeRO-1 also every parameter to its owner's
        # broadcast (each rank passes the whole tensor, owner or not).
        predicted_comm = (1 if name == "DDP" else 2) * 4 * psi / MB
    elif fsdp_shapes is None:  # fully_shard alone: no FSDP row gave the units' shapes
        return {"predicted_mb": None, "predicted_comm_mb": None}
    else:
        options = FSDP_ROWS.get(name, {"prefetch": 1})
        acc = impl.fsdp.fsdp_accounting(fsdp_shapes["unit_shapes"], fsdp_shapes["replicated_shapes"], world,
                                        compute_bytes=compute_bytes, optimizer_bytes_per_param=8, **options)
        predicted = acc.total_bytes
        predicted_comm = (acc.all_gather_bytes + acc.reduce_scatter_bytes + acc.all_reduce_bytes) / MB
    return {"predicted_mb": predicted / MB, "state_vs_predicted": state / predicted,
            "state_goal": "met" if abs(state / predicted - 1) <= 0.05 else "missed",
            "predicted_comm_mb": predicted_comm}


@launch.exit_on_launch_error("bench_fsdp")
def main(argv: list[str] | None = None) -> list[dict]:
    p = bench.parser(__doc__)
    p.add_argument("--world-size", type=int, default=None, help="ranks (default 2; under torchrun its WORLD_SIZE)")
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None, help="sequences per rank")
    p.add_argument("--compute-dtype", choices=sorted(DTYPES), default="fp32", help="FSDP's compute_dtype")
    p.add_argument("--iters", type=int, default=None, help="timed rounds")
    p.add_argument("--impls", nargs="+", choices=IMPLEMENTATIONS, default=None,
                   help="implementations to compare (default: all; with --smoke: DDP, FSDP p1, fully_shard)")
    args = bench.parse(p, argv)
    impls = args.impls or (["DDP", "FSDP p1", "fully_shard"] if args.smoke else list(IMPLEMENTATIONS))
    world = launch.world_size(args.world_size, 2, option="--world-size")
    if world < 2:
        p.error(f"--world-size must be at least 2, got {world}")
    big = launch.backend_for(launch.launched(), world) == "nccl"  # a GPU for every rank: GPU-sized runs
    d_model = args.d_model or (64 if args.smoke else 1024 if big else 256)
    layers = args.layers or (2 if args.smoke else 8 if big else 4)
    config = ModelConfig(vocab_size=512 if args.smoke else 4096, context_length=32 if args.smoke else 128,
                         d_model=d_model, d_ff=4 * d_model, num_layers=layers, num_heads=4).as_dict()
    batch = args.batch_size or (2 if args.smoke else 8 if big else 4)
    iters, warmup = args.iters or (1 if args.smoke else 10), 0 if args.smoke else 2
    per_rank = launch.on_ranks(measure_rank, world, args=(args.impl, config, batch, args.compute_dtype, impls,
                                                          warmup, iters),
                               timeout=300 if args.smoke else 1800, what="bench_fsdp")
    if not launch.is_main():
        return per_rank[launch.launched().rank]  # under torchrun, rank 0 writes the tables
    rows = summarize(per_rank, world, args.impl, args.compute_dtype)
    params_m = next(r["params_m"] for r in rows if r.get("params_m") is not None)
    title = (f"FSDP vs DDP, ZeRO-1 and fully_shard: {params_m:.1f} M parameters, "
             f"{world} ranks, {batch}×{config['context_length']} tokens per rank, "
             f"compute dtype {args.compute_dtype}")
    bench.save("bench_fsdp", rows, args, title=title, columns=COLUMNS,
               notes=bench.bf16_notes(args.compute_dtype == "bf16"))
    for r in rows:
        if r.get("note", "").startswith("not implemented"):
            print(f"skipped {r['impl']}: {r['note']}")
    measured = [r for r in rows if r.get("step_ms") is not None]
    fig, (left, right) = bench.subplots(1, 2, figsize=(12, 4))
    names = [r["impl"] for r in measured]
    left.bar(names, [r["step_ms"] for r in measured], color="tab:blue")
    left.set_ylabel("step time (ms, median)")
    right.bar(names, [r["peak_mb"] for r in measured], color="tab:gray", label="peak during a step")
    right.bar(names, [r["state_mb"] for r in measured], color="tab:orange", label="params + grads + optimizer")
    right.plot(names, [r.get("predicted_mb") or float("nan") for r in measured], "k_", markersize=20,
               label="accounting")
    right.set_ylabel("MiB on the largest rank")
    right.set_ylim(0, 1.4 * max(r["peak_mb"] for r in measured))  # room for the legend above the bars
    right.legend(loc="upper right", fontsize=8)
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=45)
    fig.suptitle(title, fontsize=9)
    bench.save_figure(fig, "bench_fsdp", args)
    return rows


if __name__ == "__main__":
    main()
