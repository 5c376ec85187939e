"""fp32 vs bf16 vs fp16 (with loss scaling): forward, backward and train-step time, and memory.

    python benchmarks/bench_precision.py            # GPU: small/medium/large; CPU: tiny/mini
    python benchmarks/bench_precision.py --smoke    # seconds, any machine
    python benchmarks/bench_precision.py --presets small --contexts 256 1024 --out /tmp/results

Per configuration: median milliseconds of a forward (graph built), of the backward (forward+backward
minus forward) and of a full AdamW step through ``mixed_precision_train_step``; on CUDA the peak
memory of an inference forward and of a train step (Stage 1's ``peak_memory``); everywhere the bytes
autograd saves for backward, measured and counted analytically. Writes
``precision.{csv,json,md}`` and ``precision.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as `python benchmarks/<name>.py`: the kit lives one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from tqdm import tqdm

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit.data import random_batch
from kit.impl import load
from kit.model import TransformerLM, cross_entropy, get_config, make_optimizer
from kit.results import RESULTS_DIR, save_results

MiB = 2**20


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

    def forward_backward() -> None:
        loss = forward()
        (scaler.scale(loss) if scaler else loss).backward()
        model.zero_grad(set_to_none=True)

    def train_step() -> None:
        precision.mixed_precision_train_step(model, (inputs, targets), optimizer, dtype=dtype, scaler=scaler)

    # Medians: robust to the odd slow call on a shared machine.
    fwd = time_fn(forward, warmup=warmup, iters=iters).median
    fwd_bwd = time_fn(forward_backward, warmup=warmup, iters=iters).median
    step = time_fn(train_step, warmup=warmup, iters=iters).median
    saved = precision.saved_activation_bytes(forward)
    est = precision.activation_memory_estimate(config, batch, context, dtype, device_type=device.type)
    row = {
        "preset": preset, "context": context, "batch": batch, "dtype": dtype_name + ("+scaler" if scaler else ""),
        # backward = (forward+backward) − forward: noisy when the two timings are noisy.
        "forward_ms": 1e3 * fwd, "fwd_bwd_ms": 1e3 * fwd_bwd, "backward_ms": 1e3 * (fwd_bwd - fwd),
        "train_step_ms": 1e3 * step,
        "saved_MiB": saved / MiB, "estimate_MiB": est["total"] / MiB,
        "peak_forward_MiB": None, "peak_train_MiB": None,
    }
    if device.type == "cuda":
        row["peak_forward_MiB"] = precision.step_peak_memory(model, (inputs, targets), dtype=dtype,
                                                             mode="forward") / MiB
        row["peak_train_MiB"] = precision.step_peak_memory(model, (inputs, targets), dtype=dtype, mode="train_step",
                                                           optimizer=optimizer, scaler=scaler) / MiB
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--presets", nargs="+", default=None)
    parser.add_argument("--contexts", nargs="+", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "fp16"])
    parser.add_argument("--impl", default=None, help="student or reference (default: $LLMSYS_IMPL or student)")
    args = parser.parse_args(argv)

    if args.smoke:
        presets, contexts, batch, warmup, iters = ["tiny"], [16], 1, 1, 1
    elif on_gpu:
        presets, contexts, batch, warmup, iters = ["small", "medium", "large"], [256, 512, 1024], 4, 3, 10
    else:
        presets, contexts, batch, warmup, iters = ["tiny", "mini"], [64, 256], 2, 1, 3
    presets = args.presets or presets
    contexts = args.contexts or contexts
    batch = args.batch or batch
    device = torch.device("cuda" if on_gpu else "cpu")
    impl = load(args.impl)

    configs = [(p, c, d) for p in presets for c in contexts for d in args.dtypes]
    rows = []
    for preset, context, dtype in tqdm(configs, desc="precision", unit="config"):
        rows.append(run_one(impl, preset, context, batch, dtype, device, warmup, iters))
    paths = save_results("precision", rows, out_dir=args.out, title="Mixed precision: time and memory")
    plot(rows, paths["csv"].with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
