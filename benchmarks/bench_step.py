"""Stage 7 benchmark: the whole training step, the naive one against the reference's pieces one at a time.

    python -m benchmarks.bench_step                 # CPU: the leaderboard cpu task's model, one process
    python -m benchmarks.bench_step --smoke         # seconds, any machine (into bench-output/smoke/)
    python -m benchmarks.bench_step --impl reference --save   # the committed benchmarks/results/ tables

Run it from the repository root. Two tables:

* ``bench_step``: one process builds ``build_train_step(StepConfig(...))`` for each configuration — the naive step
  (the kit's attention, full logits, ``torch.optim.AdamW``, fp32), then one choice changed at a time (FusedAdamW,
  FlashAttention in PyTorch or Triton, the fused loss, bf16 autocast, bf16 weights with master weights,
  activation checkpointing), then all of them — and times ``--iters`` steps after ``--warmup`` (median and
  interquartile range), with tokens/s, the first step's loss against the naive one, and on a GPU the peak
  memory and MFU (:mod:`kit.flops`). A configuration whose piece is not implemented yet is reported as such.
* ``bench_step_optimizer``: ``optimizer.step()`` alone over the same model's parameters: ``torch.optim.AdamW`` with
  its per-tensor loop (``foreach=False``), with its for-each path, and ``FusedAdamW``; and the bytes each
  moves per parameter (handout 07b §4).

On a CPU the Triton kernels run in the interpreter, in Python: their rows time the interpreter, not the
kernels. The bf16 rows depend on the CPU: with bf16 units (avx512_bf16 or AMX on x86, bf16 on ARM) they are
usually faster than fp32, without them bf16 is emulated and several times slower; the table's stamp names the CPU,
and a CPU without them gets a note. GPU rows are unmeasured until someone runs this on a GPU.
"""

from __future__ import annotations

import importlib
import statistics
import time

import torch

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit import bench
from kit.data import random_batch
from kit.flops import peak_flops, transformer_flops
from kit.leaderboard import OPTIMIZER, TASKS
from kit.model import ModelConfig

CONFIGS: dict[str, dict] = {
    "naive": {},
    "fused AdamW": {"optimizer": "fused_adamw"},
    "flash (PyTorch)": {"attention": "flash_pytorch"},
    "flash (Triton)": {"attention": "flash_triton"},
    "fused loss": {"loss": "fused"},
    "bf16 autocast": {"dtype": "bf16_autocast"},
    "bf16 weights + master": {"dtype": "bf16", "optimizer": "fused_adamw"},
    "checkpointing": {"activation_checkpointing": True},
    "all fused, bf16": {"attention": "flash_triton", "loss": "fused", "optimizer": "fused_adamw", "dtype": "bf16",
                        "activation_checkpointing": True},
}


def _module(impl: str):
    return importlib.import_module(f"{impl}.whole_step.train_step")


def _time(fn, warmup: int, iters: int, cuda: bool) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def measure_step(impl: str, model: ModelConfig, batch: int, name: str, choices: dict, warmup: int, iters: int,
                 naive_loss: float | None) -> dict:
    module = _module(impl)
    cuda = torch.cuda.is_available()
    x, y = random_batch(batch, model.context_length, model.vocab_size, seed=7)
    row = {"config": name, **{k: choices.get(k, "") for k in ("attention", "loss", "optimizer", "dtype")}}
    try:
        step = module.build_train_step(module.StepConfig.from_dict(
            {"model": model.as_dict(), **OPTIMIZER, "device": "cuda" if cuda else "cpu", **choices}))
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        first = step(x, y)
        times = _time(lambda: step(x, y), max(warmup - 1, 0), iters, cuda)
    except NotImplementedError as exc:
        return {**row, "status": f"not implemented: {str(exc)[:60]}"}
    median = statistics.median(times)
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [median] * 3
    flops = transformer_flops(model, batch, model.context_length, "train_step")
    dtype = "fp32" if choices.get("dtype", "fp32") == "fp32" else "bf16"
    peak = peak_flops(torch.cuda.get_device_name(), dtype) if cuda else None
    return {**row, "status": "ok", "step_ms": 1e3 * median, "iqr_ms": 1e3 * (q[2] - q[0]),
            "tokens_per_s": batch * model.context_length / median,
            "vs_naive": None, "first_loss": first,
            "loss_diff_vs_naive": None if naive_loss is None else first - naive_loss,
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
            "mfu": flops / median / peak if peak else None}


def measure_optimizers(impl: str, model: ModelConfig, warmup: int, iters: int) -> list[dict]:
    """``optimizer.step()`` alone, fp32, over ``model``'s parameters with random gradients."""
    fused = importlib.import_module(f"{impl}.whole_step.fused_adamw").FusedAdamW
    from kit.model import TransformerLM

    cuda = torch.cuda.is_available()
    net = TransformerLM(model).to("cuda" if cuda else "cpu")
    params = list(net.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    options = {**OPTIMIZER, "betas": tuple(OPTIMIZER["betas"])}
    makers = {"torch AdamW, per-tensor loop (foreach=False)": lambda: torch.optim.AdamW(params, foreach=False,
                                                                                        **options),
              "torch AdamW, foreach": lambda: torch.optim.AdamW(params, foreach=True, **options),
              "FusedAdamW": lambda: fused(params, **options)}
    # Bytes through memory per fp32 parameter per step (handout 07b §4): one pass per operation for the loop and
    # the for-each path (8 operations reading and writing their operands), one read of p, g, m, v and one write of
    # p, m, v for a single fused kernel.
    rows = []
    for name, make in makers.items():
        try:
            optimizer = make()
            times = _time(optimizer.step, warmup, iters, cuda)
        except NotImplementedError as exc:
            rows.append({"optimizer": name, "status": f"not implemented: {str(exc)[:60]}"})
            continue
        rows.append({"optimizer": name, "status": "ok", "tensors": len(params),
                     "params_m": sum(p.numel() for p in params) / 1e6, "step_ms": 1e3 * statistics.median(times),
                     "bytes_per_param": 80,
                     "fully_fused_bytes_per_param": 28})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = bench.parser(__doc__)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--only", nargs="+", default=None, choices=list(CONFIGS), help="these configurations only")
    args = bench.parse(p, argv)
    cpu_task = TASKS["cpu"]
    if args.smoke:
        model, batch, warmup, iters = TASKS["cpu"].gate_model, 2, 1, 2
        names = ["naive", "fused AdamW", "bf16 weights + master"]
    else:
        model, batch = cpu_task.model, cpu_task.batch // cpu_task.world
        warmup, iters = 2, 5
        names = list(CONFIGS)
        if torch.cuda.is_available():
            model, batch, warmup, iters = TASKS["gpu1"].gate_model.with_(context_length=4096), 4, 3, 10
    warmup, iters = args.warmup or warmup, args.iters or iters
    names = args.only or names
    notes = bench.bf16_notes(any(CONFIGS[n].get("dtype", "fp32") != "fp32" for n in names))
    rows, naive_loss = [], None
    for name in bench.progress(names, "step configurations"):
        row = measure_step(args.impl, model, batch, name, CONFIGS[name], warmup, iters, naive_loss)
        if name == "naive" and row["status"] == "ok":
            naive_loss = row["first_loss"]
        rows.append(row)
    base = next((r["step_ms"] for r in rows if r["config"] == "naive" and r["status"] == "ok"), None)
    for r in rows:
        if base and r.get("step_ms"):
            r["vs_naive"] = r["step_ms"] / base
    shape = (f"d {model.d_model}, {model.num_layers} layers, vocab {model.vocab_size}, {batch} × "
             f"{model.context_length} tokens")
    bench.save("bench_step", rows, args, title=f"One training step, one process: {shape}",
               columns=["config", "attention", "loss", "optimizer", "dtype", "status", "step_ms", "iqr_ms",
                        "vs_naive", "tokens_per_s", "loss_diff_vs_naive", "peak_mib", "mfu"], notes=notes)
    opt_rows = measure_optimizers(args.impl, model, warmup, iters)
    bench.save("bench_step_optimizer", opt_rows, args, title=f"optimizer.step() alone, fp32: {shape}")

    timed = [r for r in rows if r.get("step_ms")]
    fig, ax = bench.subplots(figsize=(7, 0.45 * len(timed) + 1.2))
    ax.barh([r["config"] for r in timed], [r["step_ms"] for r in timed],
            xerr=[r["iqr_ms"] / 2 for r in timed], color="#4c72b0")
    ax.invert_yaxis()
    ax.set(xlabel="median ms per step (error bar: interquartile range)", title=f"Whole step: {shape}")
    bench.save_figure(fig, "bench_step", args)
    return rows + opt_rows


if __name__ == "__main__":
    main()
