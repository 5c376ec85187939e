"""Stage 3 benchmark: attention implementations, forward / backward / forward+backward, ms and TFLOP/s.

    python benchmarks/bench_attention.py            # the sizes that fit this machine (full grid on a GPU)
    python benchmarks/bench_attention.py --smoke    # tiny, < 30 s on a CPU
    python benchmarks/bench_attention.py --out DIR  # where the tables and the plot go

Providers (handout 03 §7): ``naive`` (kit.model.naive_attention, materialises Nq × Nk),
``naive_compiled`` (the same under torch.compile), ``sdpa`` (torch's scaled_dot_product_attention; the
flash backend is forced on CUDA for bf16), ``flash_pytorch`` (FlashAttentionPytorch, a Python loop over
tiles) and ``flash_triton`` (FlashAttentionTriton).

Grid on a GPU: sequence 128 … 65536 × head dim 16 … 128 × {bf16, fp32}, batch 1, causal — plus the
goal rows: the leaderboard configuration (batch 16, Nq = Nk = 16384, D = 64, causal, bf16,
forward+backward) and a forward-throughput row (batch 8, N = 16384, D = 128, non-causal, bf16).

FLOPs: forward 4·B·Nq·Nk·D (halved when causal), backward 2.5× that (2× for the gradients, 0.5× to
recompute P), forward+backward 3.5×. On CUDA each cell is timed with ``triton.testing.do_bench``
(median); out-of-memory cells are marked ``OOM``. On a CPU the Triton kernels run in the *interpreter*:
those numbers say nothing about GPU speed — GPU figures must be measured on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Run as `python benchmarks/<name>.py`: the kit lives one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from tqdm import tqdm

import kit  # noqa: F401 — before triton: the interpreter on machines without CUDA
from kit.impl import load
from kit.model import naive_attention
from kit.results import RESULTS_DIR, save_results

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODES = ("forward", "backward", "forward_backward")
MODE_FLOPS = {"forward": 1.0, "backward": 2.5, "forward_backward": 3.5}
PROVIDERS = ("naive", "naive_compiled", "sdpa", "flash_pytorch", "flash_triton")
COLUMNS = ["config", "provider", "dtype", "batch", "seq", "d_head", "causal", "mode", "ms", "tflops", "peak_mib",
           "status"]


def attention_flops(batch: int, nq: int, nk: int, d: int, causal: bool, mode: str) -> float:
    """Model FLOPs of one attention call: 4·B·Nq·Nk·D forward (two matmuls), halved when causal."""
    forward = 4.0 * batch * nq * nk * d / (2.0 if causal else 1.0)
    return MODE_FLOPS[mode] * forward


def time_ms(fn: Callable[[], object], on_cuda: bool, cpu_iters: int) -> float:
    """Median milliseconds per call: triton's do_bench on CUDA (it flushes L2 and syncs), else perf_counter."""
    if on_cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # warm-up: allocator, first-call overheads
    samples: list[float] = []
    # At least cpu_iters calls and 0.2 s in all (cheap calls repeat more), at most 100 calls.
    while len(samples) < cpu_iters or (sum(samples) < 0.2 and len(samples) < 100):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)


def make_provider(name: str, on_cuda: bool, fa) -> Callable:
    """``attn(q, k, v, causal) -> o`` for a provider name."""
    if name == "naive":
        return naive_attention
    if name == "naive_compiled":
        # Default dynamic=None: the first shape compiles statically, the next recompiles once with
        # symbolic sizes, so the whole grid costs a few compilations rather than one per cell.
        return torch.compile(naive_attention)
    if name == "sdpa":
        def sdpa(q, k, v, causal):
            if on_cuda and q.dtype != torch.float32:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return sdpa
    if name == "flash_pytorch":
        return lambda q, k, v, causal: fa.FlashAttentionPytorch.apply(q, k, v, causal)
    if name == "flash_triton":
        return lambda q, k, v, causal: fa.FlashAttentionTriton.apply(q, k, v, causal)
    raise ValueError(f"provider must be one of {PROVIDERS}, got {name!r}")


def measure(attn: Callable, batch: int, seq: int, d: int, dtype: torch.dtype, causal: bool, modes: tuple[str, ...],
            device: torch.device, cpu_iters: int) -> dict[str, tuple[float | None, float | None, str]]:
    """``{mode: (ms, peak MiB or None, status)}`` for one provider and shape."""
    on_cuda = device.type == "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, seq, d, device=device, dtype=dtype, generator=g, requires_grad=True)
               for _ in range(3))
    do = torch.randn(batch, seq, d, device=device, dtype=dtype, generator=g)
    out: dict[str, tuple[float | None, float | None, str]] = {}
    for mode in modes:
        try:
            if on_cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            if mode == "forward":
                def fn():
                    with torch.no_grad():
                        return attn(q, k, v, causal)
            elif mode == "backward":
                o = attn(q, k, v, causal)

                def fn(o=o):
                    return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
            else:
                def fn():
                    return torch.autograd.grad(attn(q, k, v, causal), (q, k, v), do)
            peak = None
            if on_cuda:  # one call on its own for the peak (do_bench allocates an L2-flush buffer)
                fn()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() / 2**20
            ms = time_ms(fn, on_cuda, cpu_iters)
            out[mode] = (ms, peak, "ok")
        except torch.cuda.OutOfMemoryError:
            out[mode] = (None, None, "OOM")
        except RuntimeError as exc:  # CPU allocations and some CUDA paths raise plain RuntimeErrors
            status = "OOM" if "out of memory" in str(exc).lower() else f"error: {str(exc).splitlines()[0][:80]}"
            out[mode] = (None, None, status)
        finally:
            fn = o = None  # noqa: F841 — free the retained graph before the next mode
            if on_cuda:
                torch.cuda.empty_cache()
    return out


def plan(args: argparse.Namespace, on_cuda: bool) -> list[dict]:
    """The cells to run: the grid, then the goal rows."""
    if args.smoke:
        seqs, dims, dtypes = [128], [16], ["fp32"]
    elif on_cuda:
        seqs, dims, dtypes = [2**p for p in range(7, 17)], [16, 32, 64, 128], ["bf16", "fp32"]
    else:
        seqs, dims, dtypes = [128, 256, 512], [16, 64], ["fp32", "bf16"]
    cells = [dict(config="grid", batch=1, seq=s, d_head=d, dtype=t, causal=True, modes=MODES)
             for t in dtypes for d in dims for s in seqs]
    if not args.smoke:
        cells.append(dict(config="leaderboard", batch=16, seq=16384, d_head=64, dtype="bf16", causal=True,
                          modes=("forward_backward",)))
        cells.append(dict(config="fwd-throughput", batch=8, seq=16384, d_head=128, dtype="bf16", causal=False,
                          modes=("forward",)))
    return cells


def skip_reason(provider: str, cell: dict, on_cuda: bool, args: argparse.Namespace) -> str | None:
    """Why a provider does not run a cell on this machine, or None when it does."""
    seq = cell["seq"]
    if not on_cuda:
        if cell["config"] != "grid":
            return "needs a CUDA GPU: measure on an H100"
        if provider == "naive_compiled" and not args.compile_on_cpu:
            return "skipped on CPU: torch.compile takes minutes here (--compile-on-cpu)"
        if provider == "flash_triton" and seq > args.cpu_triton_max_seq:
            return f"skipped: Triton interpreter, N > {args.cpu_triton_max_seq}"
        if provider == "flash_pytorch" and seq > 1024:
            return "skipped: Python tile loop too slow"
        return None
    if provider == "flash_pytorch" and cell["batch"] * seq > 4096:
        return "skipped: Python tile loop (B·N > 4096)"
    return None


def plot(rows: list[dict], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [r for r in rows if r["config"] == "grid" and r["mode"] == "forward_backward" and r["ms"] is not None]
    if not grid:
        return None
    d_plot = max(r["d_head"] for r in grid)
    dtypes = sorted({r["dtype"] for r in grid})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        for provider in PROVIDERS:
            pts = sorted((r["seq"], r["ms"]) for r in grid
                         if r["provider"] == provider and r["dtype"] == dtype and r["d_head"] == d_plot)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=provider)
        ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="ms (forward+backward)",
               title=f"causal attention, {dtype}, D={d_plot}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    device = "CUDA" if torch.cuda.is_available() else "CPU (Triton interpreted: not a GPU speed)"
    fig.suptitle(f"bench_attention on {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one tiny configuration (< 30 s on a CPU)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for the tables and the plot")
    parser.add_argument("--providers", default=",".join(PROVIDERS), help=f"comma-separated subset of {PROVIDERS}")
    parser.add_argument("--cpu-iters", type=int, default=3, help="timed calls per cell on a CPU (median)")
    parser.add_argument("--cpu-triton-max-seq", type=int, default=128,
                        help="longest sequence the interpreted Triton kernels run on a CPU")
    parser.add_argument("--compile-on-cpu", action="store_true", help="also run torch.compile on a CPU (slow)")
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="torch threads on a CPU (1 keeps timings stable on a shared machine)")
    args = parser.parse_args(argv)
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    bad = [p for p in providers if p not in PROVIDERS]
    if bad:
        parser.error(f"--providers: unknown {bad}; choose from {PROVIDERS}")

    if args.smoke:
        args.cpu_iters = 1
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    if on_cuda:
        torch._dynamo.config.cache_size_limit = 64  # a few graphs per dtype and head dim
    else:
        torch.set_num_threads(args.cpu_threads)
    fa = load().flash_attention
    cells = plan(args, on_cuda)
    rows: list[dict] = []
    for cell in tqdm([(c, p) for c in cells for p in providers], desc="attention cells"):
        cell, provider = cell
        base = {k: cell[k] for k in ("config", "batch", "seq", "d_head", "dtype", "causal")}
        reason = skip_reason(provider, cell, on_cuda, args)
        if reason is None:
            attn = make_provider(provider, on_cuda, fa)
            results = measure(attn, cell["batch"], cell["seq"], cell["d_head"], DTYPES[cell["dtype"]], cell["causal"],
                              cell["modes"], device, args.cpu_iters)
        else:
            results = {mode: (None, None, reason) for mode in cell["modes"]}
        for mode, (ms, peak, status) in results.items():
            flops = attention_flops(cell["batch"], cell["seq"], cell["seq"], cell["d_head"], cell["causal"], mode)
            rows.append({**base, "provider": provider, "mode": mode, "ms": ms,
                         "tflops": None if ms is None else flops / (ms * 1e-3) / 1e12,
                         "peak_mib": peak, "status": status})

    title = "Attention: forward / backward / forward+backward"
    if not on_cuda:
        title += " — CPU run (Triton interpreted); GPU figures must be measured on a GPU"
    save_results("bench_attention", rows, out_dir=args.out, columns=COLUMNS, title=title)
    path = plot(rows, Path(args.out) / "bench_attention.png")
    if path:
        print(f"\nplot: {path}")
    report_goals(rows, on_cuda)
    return rows


def report_goals(rows: list[dict], on_cuda: bool) -> None:
    """Compare the goal rows with the Stage 3 targets (handout 03 §7). Printed, never asserted."""
    if not on_cuda:
        print("\nGoals (leaderboard ≤ 5.0 ms fwd+bwd and ≤ SDPA flash; forward ≥ 450 TFLOP/s at D=128) need a CUDA "
              "GPU: these CPU numbers do not measure them.")
        return

    def pick(config: str, provider: str) -> dict | None:
        return next((r for r in rows if r["config"] == config and r["provider"] == provider and r["ms"]), None)

    lb, lb_sdpa, thr = pick("leaderboard", "flash_triton"), pick("leaderboard", "sdpa"), pick("fwd-throughput",
                                                                                                "flash_triton")
    print(f"\nGoals on {torch.cuda.get_device_name(0)}:")
    if lb:
        verdict = "met" if lb["ms"] <= 5.0 else "missed"
        print(f"  leaderboard fwd+bwd: {lb['ms']:.2f} ms (goal ≤ 5.0 ms: {verdict})")
        if lb_sdpa:
            faster = "not slower" if lb["ms"] <= lb_sdpa["ms"] else "slower"
            print(f"  vs SDPA flash backend {lb_sdpa['ms']:.2f} ms: {faster}")
    if thr:
        verdict = "met" if thr["tflops"] >= 450 else "missed"
        print(f"  forward D=128 N=16384 bf16: {thr['tflops']:.0f} TFLOP/s (goal ≥ 450: {verdict})")


if __name__ == "__main__":
    main()
