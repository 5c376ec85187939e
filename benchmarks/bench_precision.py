"""Stage 2 benchmark: fp32 vs bf16 vs fp16 (with loss scaling) — forward, backward and train-step time, memory.

    python -m benchmarks.bench_precision                  # GPU: small/medium/large; CPU: tiny/mini
    python -m benchmarks.bench_precision --smoke          # seconds, any machine (into bench-output/smoke/)
    python -m benchmarks.bench_precision --presets small --contexts 256 1024 --out /tmp/results
    python -m benchmarks.bench_precision --impl reference --save   # the committed benchmarks/results/ tables

Run it from the repository root. Per configuration, with Stage 1's ``time_fn`` (median and standard
deviation over the timed calls, after warm-up calls):

* ``forward`` — a forward that builds the autograd graph, under autocast for bf16/fp16;
* ``backward`` — timed directly: the backward of one retained graph (``retain_graph=True``, gradients set
  to None after each call so every call allocates them as a training step does), not the difference
  of two noisy timings;
* ``train_step`` — a full AdamW step through ``mixed_precision_train_step``; its TFLOP/s on model FLOPs
  (``kit.flops.transformer_flops``) and, on a GPU the kit knows, MFU.

``spread`` names every phase whose standard deviation exceeds its mean: that row's time is noise, not a
measurement (a loaded machine, too few calls). Memory: on CUDA the peak of an inference forward and of a
train step (``step_peak_memory``); everywhere the bytes autograd saves for backward, measured and counted
analytically. Writes ``precision.{md,csv,json,png}`` into ``bench-output/`` unless ``--out DIR`` or
``--save`` (full reference runs only) says otherwise.
"""

from __future__ import annotations

import torch

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit import bench
from kit.data import random_batch
from kit.flops import peak_flops, transformer_flops
from kit.impl import load
from kit.model import TransformerLM, cross_entropy, get_config, make_optimizer

MiB = 2**20
PHASES = ("forward", "backward", "train_step")


def run_one(impl, preset: str, context: int, batch: int, dtype_name: str, device: torch.device,
            warmup: int, iters: int) -> dict:
    precision = impl.precision
    time_fn = impl.benchmarking.time_fn
    dtype = precision.as_compute_dtype(dtype_name)
    config = get_config(preset, context_length=max(context, get_config(preset).context_length))
    torch.manual_seed(0)
    model = TransformerLM(config).to(device)
    optimizer = make_optimizer(model)
    scaler = precision.DynamicLossScaler() if dtype == torch.float16 else None
    inputs, targets = random_batch(batch, context, config.vocab_size, device=device, seed=0)
    autocast = dict(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32)

    def forward() -> torch.Tensor:
        with torch.autocast(**autocast):
            logits = model(inputs)
        return cross_entropy(logits, targets)

    # One graph, built outside the timed region; each timed call runs its whole backward again.
    loss = forward()
    scaled = scaler.scale(loss) if scaler else loss

    def backward() -> None:
        scaled.backward(retain_graph=True)
        model.zero_grad(set_to_none=True)

    def train_step() -> None:
        precision.mixed_precision_train_step(model, (inputs, targets), optimizer, dtype=dtype, scaler=scaler)

    timing = {name: time_fn(fn, warmup=warmup, iters=iters)
              for name, fn in (("forward", forward), ("backward", backward), ("train_step", train_step))}
    loss = scaled = None  # free the retained graph before measuring memory
    saved = precision.saved_activation_bytes(forward)
    est = precision.activation_memory_estimate(config, batch, context, dtype, device_type=device.type)
    achieved = transformer_flops(config, batch, context, "train_step") / timing["train_step"].median
    peak = peak_flops(torch.cuda.get_device_name(0), dtype_name) if device.type == "cuda" else None
    row = {"preset": preset, "context": context, "batch": batch, "dtype": dtype_name + ("+scaler" if scaler else "")}
    for name, t in timing.items():
        row[f"{name}_ms"] = 1e3 * t.median
        row[f"{name}_std_ms"] = 1e3 * t.std
    row.update({
        "spread": ", ".join(name for name, t in timing.items() if t.std > t.mean) or "ok",
        "train_tflops": achieved / 1e12, "mfu": achieved / peak if peak else None,
        "saved_MiB": saved / MiB, "estimate_MiB": est["total"] / MiB,
        "peak_forward_MiB": None, "peak_train_MiB": None,
    })
    if device.type == "cuda":
        row["peak_forward_MiB"] = precision.step_peak_memory(model, (inputs, targets), dtype=dtype,
                                                             mode="forward") / MiB
        row["peak_train_MiB"] = precision.step_peak_memory(model, (inputs, targets), dtype=dtype, mode="train_step",
                                                           optimizer=optimizer, scaler=scaler) / MiB
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    on_gpu = torch.cuda.is_available()
    p = bench.parser(__doc__)
    p.add_argument("--presets", nargs="+", default=None)
    p.add_argument("--contexts", nargs="+", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "fp16"])
    p.add_argument("--warmup", type=int, default=None, help="untimed calls before each timing")
    p.add_argument("--iters", type=int, default=None, help="timed calls (median and std)")
    args = bench.parse(p, argv)

    if args.smoke:
        presets, contexts, batch, warmup, iters = ["tiny"], [16], 1, 1, 2
    elif on_gpu:
        presets, contexts, batch, warmup, iters = ["small", "medium", "large"], [256, 512, 1024], 4, 5, 20
    else:
        presets, contexts, batch, warmup, iters = ["tiny", "mini"], [64, 256], 2, 3, 7
    presets, contexts, batch = args.presets or presets, args.contexts or contexts, args.batch or batch
    warmup, iters = args.warmup or warmup, args.iters or iters
    device = torch.device("cuda" if on_gpu else "cpu")
    impl = load(args.impl)

    configs = [(p_, c, d) for p_ in presets for c in contexts for d in args.dtypes]
    notes = bench.bf16_notes("bf16" in args.dtypes)
    rows = [run_one(impl, preset, context, batch, dtype, device, warmup, iters)
            for preset, context, dtype in bench.progress(configs, "precision")]
    columns = ["preset", "context", "batch", "dtype"] + [f"{n}{s}" for n in PHASES for s in ("_ms", "_std_ms")] + [
        "spread", "train_tflops", "mfu", "saved_MiB", "estimate_MiB", "peak_forward_MiB", "peak_train_MiB"]
    bench.save("precision", rows, args, columns=columns, notes=notes,
               title=f"Mixed precision: median time ({warmup} warm-up + {iters} timed calls) and memory")

    fig, axes = bench.subplots(1, 2, figsize=(11, 4))
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for preset in dict.fromkeys(r["preset"] for r in rows):
            sel = [r for r in rows if r["dtype"] == dtype and r["preset"] == preset]
            ctx = [r["context"] for r in sel]
            axes[0].plot(ctx, [r["train_step_ms"] for r in sel], marker="o", label=f"{preset} {dtype}")
            axes[1].plot(ctx, [r["saved_MiB"] for r in sel], marker="o", label=f"{preset} {dtype}")
    axes[0].set(xlabel="context length", ylabel="train step (ms)", title="Train-step time", xscale="log", yscale="log")
    axes[1].set(xlabel="context length", ylabel="MiB saved for backward", title="Saved activations",
                xscale="log", yscale="log")
    for ax in axes:
        ax.legend(fontsize=7)
    bench.save_figure(fig, "precision", args)
    return rows


if __name__ == "__main__":
    main()
