"""Stage 1 benchmark: the kit's Transformer across presets × context lengths × modes × dtypes.

    python benchmarks/bench_model.py                       # CPU-sized defaults
    python benchmarks/bench_model.py --presets small medium large xl 2.7B --contexts 128 256 512 1024  # GPU
    python benchmarks/bench_model.py --smoke --out /tmp/r  # seconds, for the test suite

Reports mean/std step time, tokens/s, achieved TFLOP/s and, on a known GPU, model FLOP utilisation
(MFU). Writes benchmarks/results/bench_model.{md,csv,json} and bench_model.png, stamped with the device,
versions, date and command. Uses the implementation selected by $LLMSYS_IMPL (default student).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import kit  # noqa: E402,F401 — sets TRITON_INTERPRET before triton loads
from kit.flops import peak_flops, transformer_flops  # noqa: E402
from kit.impl import load  # noqa: E402
from kit.model import TransformerLM, get_config  # noqa: E402
from kit.results import RESULTS_DIR, save_results  # noqa: E402


def parse_args() -> argparse.Namespace:
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--smoke", action="store_true", help="one tiny configuration, for tests")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args()
    if args.smoke:
        args.presets, args.contexts, args.modes = ["tiny"], [32], ["forward", "train_step"]
        args.dtypes, args.warmup, args.iters, args.batch_size = ["fp32"], 1, 2, 2
    return args


def run_one(bench, args, preset: str, context: int, mode: str, dtype: str) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = get_config(preset, context_length=max(context, get_config(preset).context_length))
    attention = bench.annotated_scaled_dot_product_attention if args.annotate else None
    row = {"preset": preset, "context": context, "mode": mode, "dtype": dtype, "batch": args.batch_size}
    try:
        model = TransformerLM(config, attention_fn=attention).to(device)
        kwargs = dict(context_length=context, batch_size=args.batch_size, mode=mode, dtype=dtype, device=device,
                      model=model)
        if args.profile_range and device == "cuda":
            bench.benchmark_model(preset, warmup=args.warmup, iters=1, **kwargs)
            torch.cuda.cudart().cudaProfilerStart()
            result = bench.benchmark_model(preset, warmup=0, iters=args.iters, **kwargs)
            torch.cuda.cudart().cudaProfilerStop()
        else:
            result = bench.benchmark_model(preset, warmup=args.warmup, iters=args.iters, **kwargs)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {**row, "mean_ms": None, "std_ms": None, "tokens_per_s": None, "tflops": None, "mfu": None,
                "note": "OOM"}
    timing = result["timing"]
    flops = transformer_flops(config, args.batch_size, context, mode)
    achieved = flops / timing.mean
    peak = peak_flops(torch.cuda.get_device_name(0), dtype) if device == "cuda" else None
    del model
    return {**row, "params_M": result["params"] / 1e6, "mean_ms": 1e3 * timing.mean, "std_ms": 1e3 * timing.std,
            "tokens_per_s": result["tokens_per_s"], "tflops": achieved / 1e12,
            "mfu": achieved / peak if peak else None, "note": ""}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (preset, mode, dtype), group in itertools.groupby(
        sorted(rows, key=lambda r: (r["preset"], r["mode"], r["dtype"], r["context"])),
        key=lambda r: (r["preset"], r["mode"], r["dtype"]),
    ):
        group = [r for r in group if r["tokens_per_s"]]
        if group:
            ax.plot([r["context"] for r in group], [r["tokens_per_s"] for r in group], marker="o",
                    label=f"{preset} {mode} {dtype}")
    ax.set_xlabel("context length")
    ax.set_ylabel("tokens / s")
    ax.set_xscale("log", base=2)
    ax.set_title("Transformer throughput")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    bench = load().benchmarking
    configs = list(itertools.product(args.presets, args.contexts, args.modes, args.dtypes))
    rows = [run_one(bench, args, *c) for c in tqdm(configs, desc="bench_model", unit="config")]
    save_results("bench_model", rows, out_dir=args.out, title="Stage 1 — Transformer step time")
    plot(rows, Path(args.out) / "bench_model.png")


if __name__ == "__main__":
    main()
