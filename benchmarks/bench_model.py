"""Stage 1 benchmark: the kit's Transformer across presets × context lengths × modes × dtypes.

    python -m benchmarks.bench_model                        # CPU-sized defaults, into bench-output/
    python -m benchmarks.bench_model --presets small medium large xl 2.7B --contexts 128 256 512 1024  # GPU
    python -m benchmarks.bench_model --smoke                # seconds, into bench-output/smoke/
    python -m benchmarks.bench_model --impl reference --save  # the committed benchmarks/results/ tables
    python -m benchmarks.bench_model --compile              # eager vs torch.compile, forward and forward+backward

Run it from the repository root. Reports mean/std step time, tokens/s, achieved TFLOP/s on model FLOPs
(``kit.flops.transformer_flops``: 6·N + 6·L·d·T per token for a train step, attention counted causally)
and, on a GPU the kit knows, model FLOP utilisation (MFU). Writes ``bench_model.{md,csv,json,png}``
stamped with the device, versions, date, implementation, command and the machine (CPU model, instruction sets,
BLAS) — into ``bench-output/`` unless ``--out DIR`` or ``--save`` says otherwise (``--save``: full reference
runs only). On a CPU the bf16 rows depend on the CPU: without bf16 units (avx512_bf16 or AMX on x86, bf16 on
ARM) bf16 is emulated and slower than fp32, and the table carries a note saying so.

``--compile`` (handout 01 §7) times the whole model eager and under ``torch.compile`` for the forward and
the forward+backward, side by side in one run, and writes ``bench_model_compile.*`` instead: each row has
the first call's time (compilation included), and the compiled rows the speed-up over eager. On a CPU its
defaults are ``tiny`` at context 64 in fp32 (compiling takes tens of seconds per graph on two cores);
``--compile-backend`` picks the backend (``inductor``; ``aot_eager`` or ``eager`` only trace, for tests).
"""

from __future__ import annotations

import itertools
import time

import torch

import kit  # noqa: F401 — sets TRITON_INTERPRET before triton loads
from kit import bench
from kit.flops import describe_device, peak_flops, transformer_flops
from kit.impl import load
from kit.model import TransformerLM, get_config


def run_one(benchmarking, args, preset: str, context: int, mode: str, dtype: str, compiled: bool = False) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = get_config(preset, context_length=max(context, get_config(preset).context_length))
    attention = benchmarking.annotated_scaled_dot_product_attention if args.annotate else None
    row = {"preset": preset, "context": context, "mode": mode, "dtype": dtype, "batch": args.batch_size}
    if args.compile:
        row["compile"] = args.compile_backend if compiled else "eager"
    try:
        torch.manual_seed(0)
        model = TransformerLM(config, attention_fn=attention).to(device)
        first_call_s = None
        if compiled:
            torch._dynamo.reset()  # each configuration compiles afresh: no recompile limit
            # A cold compile every time, so first_call_s is what a student's first run pays (inductor keeps an
            # on-disk cache between processes that would hide it).
            torch._inductor.config.force_disable_caches = True
            # In place (nn.Module.compile): still a TransformerLM, with its attributes, for benchmark_model.
            model.compile(backend=args.compile_backend)
        kwargs = dict(context_length=context, batch_size=args.batch_size, mode=mode, dtype=dtype, device=device,
                      model=model)
        if args.compile:
            # The first call alone, untimed by benchmark_model's warm-up: for a compiled model it compiles.
            t0 = time.perf_counter()
            benchmarking.benchmark_model(preset, warmup=0, iters=1, **kwargs)
            first_call_s = time.perf_counter() - t0
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
    name = torch.cuda.get_device_name(0) if device == "cuda" else None
    peak = peak_flops(name, dtype) if name else None
    note = describe_device(name) if name and peak is None else ""
    # On a shared CPU the mean carries other jobs' noise; the compile table also reports median and minimum.
    extra = {"first_call_s": first_call_s, "median_ms": 1e3 * timing.median, "min_ms": 1e3 * timing.min} \
        if args.compile else {}
    return {**row, "params_M": result["params"] / 1e6, **extra, "mean_ms": 1e3 * timing.mean,
            "std_ms": 1e3 * timing.std, "tokens_per_s": result["tokens_per_s"], "tflops": achieved / 1e12,
            "mfu": achieved / peak if peak else None, "note": note}


def with_speedups(rows: list[dict]) -> list[dict]:
    """Each compiled row gets ``speedup`` = the eager row's median time / its own (same configuration): the
    median, because a loaded machine's noise inflates the means of the two runs differently."""
    eager = {(r["preset"], r["context"], r["mode"], r["dtype"]): r.get("median_ms") for r in rows
             if r.get("compile") == "eager"}
    for r in rows:
        base = eager.get((r["preset"], r["context"], r["mode"], r["dtype"]))
        r["speedup"] = base / r["median_ms"] if r.get("compile") != "eager" and base and r.get("median_ms") else None
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    on_gpu = torch.cuda.is_available()
    p = bench.parser(__doc__)
    p.add_argument("--presets", nargs="+", default=None,
                   help="default: small medium on a GPU, tiny mini on a CPU (with --compile: tiny on a CPU)")
    p.add_argument("--contexts", nargs="+", type=int, default=None,
                   help="default: 256 512 on a GPU, 64 128 on a CPU (with --compile: 64 on a CPU)")
    p.add_argument("--modes", nargs="+", default=None,
                   help="default: forward forward_backward train_step (with --compile: forward forward_backward)")
    p.add_argument("--dtypes", nargs="+", default=None, help="default: fp32 bf16 (with --compile on a CPU: fp32)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--annotate", action="store_true", help="use the NVTX-annotated attention (nsys lab)")
    p.add_argument("--profile-range", action="store_true",
                   help="call cudaProfilerStart/Stop around the timed steps (nsys --capture-range=cudaProfilerApi)")
    p.add_argument("--compile", action="store_true",
                   help="eager vs torch.compile(model), forward and forward_backward: bench_model_compile.* (§7)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    args = bench.parse(p, argv)
    small = args.compile and not on_gpu
    args.presets = args.presets or (["small", "medium"] if on_gpu else ["tiny"] if small else ["tiny", "mini"])
    args.contexts = args.contexts or ([256, 512] if on_gpu else [64] if small else [64, 128])
    args.modes = args.modes or (["forward", "forward_backward"] if args.compile
                                else ["forward", "forward_backward", "train_step"])
    args.dtypes = args.dtypes or (["fp32"] if small else ["fp32", "bf16"])
    if args.smoke:
        args.presets, args.contexts, args.dtypes, args.warmup, args.iters, args.batch_size = ["tiny"], [32], ["fp32"], \
            1, 2, 2
        args.modes = ["forward", "forward_backward"] if args.compile else ["forward", "train_step"]

    notes = bench.bf16_notes("bf16" in args.dtypes)
    benchmarking = load(args.impl).benchmarking
    variants = (False, True) if args.compile else (False,)
    configs = list(itertools.product(args.presets, args.contexts, args.modes, args.dtypes, variants))
    rows = [run_one(benchmarking, args, *c) for c in bench.progress(configs, "bench_model")]
    columns = ["preset", "context", "mode", "dtype", "batch", "params_M", "mean_ms", "std_ms", "tokens_per_s",
               "tflops", "mfu", "note"]
    if args.compile:
        rows = with_speedups(rows)
        columns[4:4] = ["compile"]
        columns[-1:-1] = ["median_ms", "min_ms", "first_call_s", "speedup"]
        bench.save("bench_model_compile", rows, args, columns=columns, notes=notes,
                   title="Stage 1 — the whole model, eager vs torch.compile (first call includes compilation)")
        fig, ax = bench.subplots(figsize=(7, 4))
        labels = [f"{r['preset']} {r['context']} {r['mode']} {r['dtype']}\n{r['compile']}" for r in rows]
        ax.bar(labels, [r.get("median_ms") or 0 for r in rows],
               color=["tab:gray" if r["compile"] == "eager" else "tab:green" for r in rows])
        ax.set(ylabel="median ms per step", title="eager vs torch.compile")
        ax.tick_params(axis="x", labelsize=6)
        bench.save_figure(fig, "bench_model_compile", args)
        return rows
    bench.save("bench_model", rows, args, columns=columns, notes=notes,
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
