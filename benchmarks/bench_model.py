"""Stage 1 benchmark: the kit's Transformer across presets × context lengths × modes × dtypes.

    python -m benchmarks.bench_model                        # CPU-sized defaults, into bench-output/
    python -m benchmarks.bench_model --presets small medium large xl 2.7B --contexts 128 256 512 1024  # GPU
    python -m benchmarks.bench_model --smoke                # seconds, into bench-output/smoke/
    python -m benchmarks.bench_model --impl reference --save  # the committed benchmarks/results/ tables

Run it from the repository root. Reports mean/std step time, tokens/s, achieved TFLOP/s on model FLOPs
(``kit.flops.transformer_flops``: 6·N + 6·L·d·T per token for a train step, attention counted causally)
and, on a GPU the kit knows, model FLOP utilisation (MFU). Writes ``bench_model.{md,csv,json,png}``
stamped with the device, versions, date, implementation and command — into ``bench-output/`` unless
``--out DIR`` or ``--save`` says otherwise (``--save``: full reference runs only).
"""

from __future__ import annotations

import itertools

import torch

import kit  # noqa: F401 — sets TRITON_INTERPRET before triton loads
from kit import bench
from kit.flops import peak_flops, transformer_flops
from kit.impl import load
from kit.model import TransformerLM, get_config


def run_one(benchmarking, args, preset: str, context: int, mode: str, dtype: str) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = get_config(preset, context_length=max(context, get_config(preset).context_length))
    attention = benchmarking.annotated_scaled_dot_product_attention if args.annotate else None
    row = {"preset": preset, "context": context, "mode": mode, "dtype": dtype, "batch": args.batch_size}
    try:
        model = TransformerLM(config, attention_fn=attention).to(device)
        kwargs = dict(context_length=context, batch_size=args.batch_size, mode=mode, dtype=dtype, device=device,
                      model=model)
        if args.profile_range and device == "cuda":
            benchmarking.benchmark_model(preset, warmup=args.warmup, iters=1, **kwargs)
            torch.cuda.cudart().cudaProfilerStart()
            result = benchmarking.benchmark_model(preset, warmup=0, iters=args.iters, **kwargs)
            torch.cuda.cudart().cudaProfilerStop()
        else:
            result = benchmarking.benchmark_model(preset, warmup=args.warmup, iters=args.iters, **kwargs)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {**row, "note": "OOM"}
    timing = result["timing"]
    achieved = transformer_flops(config, args.batch_size, context, mode) / timing.mean
    peak = peak_flops(torch.cuda.get_device_name(0), dtype) if device == "cuda" else None
    return {**row, "params_M": result["params"] / 1e6, "mean_ms": 1e3 * timing.mean, "std_ms": 1e3 * timing.std,
            "tokens_per_s": result["tokens_per_s"], "tflops": achieved / 1e12,
            "mfu": achieved / peak if peak else None, "note": ""}


def main(argv: list[str] | None = None) -> list[dict]:
    on_gpu = torch.cuda.is_available()
    p = bench.parser(__doc__)
    p.add_argument("--presets", nargs="+", default=["small", "medium"] if on_gpu else ["tiny", "mini"])
    p.add_argument("--contexts", nargs="+", type=int, default=[256, 512] if on_gpu else [64, 128])
    p.add_argument("--modes", nargs="+", default=["forward", "forward_backward", "train_step"])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--annotate", action="store_true", help="use the NVTX-annotated attention (nsys lab)")
    p.add_argument("--profile-range", action="store_true",
                   help="call cudaProfilerStart/Stop around the timed steps (nsys --capture-range=cudaProfilerApi)")
    args = bench.parse(p, argv)
    if args.smoke:
        args.presets, args.contexts, args.modes = ["tiny"], [32], ["forward", "train_step"]
        args.dtypes, args.warmup, args.iters, args.batch_size = ["fp32"], 1, 2, 2

    benchmarking = load(args.impl).benchmarking
    configs = list(itertools.product(args.presets, args.contexts, args.modes, args.dtypes))
    rows = [run_one(benchmarking, args, *c) for c in bench.progress(configs, "bench_model")]
    columns = ["preset", "context", "mode", "dtype", "batch", "params_M", "mean_ms", "std_ms", "tokens_per_s",
               "tflops", "mfu", "note"]
    bench.save("bench_model", rows, args, columns=columns,
               title="Stage 1 — Transformer step time (TFLOP/s on model FLOPs, causal attention)")

    fig, ax = bench.subplots(figsize=(7, 4))
    for (preset, mode, dtype), group in itertools.groupby(
        sorted(rows, key=lambda r: (r["preset"], r["mode"], r["dtype"], r["context"])),
        key=lambda r: (r["preset"], r["mode"], r["dtype"]),
    ):
        group = [r for r in group if r.get("tokens_per_s")]
        if group:
            ax.plot([r["context"] for r in group], [r["tokens_per_s"] for r in group], marker="o",
                    label=f"{preset} {mode} {dtype}")
    ax.set(xlabel="context length", ylabel="tokens / s", title="Transformer throughput")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=6)
    bench.save_figure(fig, "bench_model", args)
    return rows


if __name__ == "__main__":
    main()
