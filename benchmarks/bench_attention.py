"""Stage 3 benchmark: attention implementations, forward / backward / forward+backward, ms and TFLOP/s.

    python -m benchmarks.bench_attention            # the sizes that fit this machine (the full grid on a GPU: long)
    python -m benchmarks.bench_attention --goals    # only the goal rows: minutes on one H100
    python -m benchmarks.bench_attention --smoke    # tiny, < 30 s on a CPU (into bench-output/smoke/)
    python -m benchmarks.bench_attention --impl reference --save   # the committed benchmarks/results/ tables

Run it from the repository root. Providers (handout 03 §7): ``naive`` (kit.model.naive_attention,
materialises Nq × Nk), ``naive_compiled`` (the same under torch.compile), ``sdpa`` (torch's
scaled_dot_product_attention; its flash backend is forced on CUDA for bf16/fp16), ``flash_pytorch``
(FlashAttentionPytorch, a Python loop over tiles) and ``flash_triton`` (FlashAttentionTriton).

Inputs are 4-D, ``(batch, heads, N, D)``: SDPA's fused backends accept nothing else (forced onto the flash
backend, 3-D input has "No available kernel"). Grid on a GPU: sequence 128 … 32768 × head dim 16 … 128 ×
{bf16, fp32}, batch·heads 16 (the leaderboard's: naive attention runs out of an 80 GB GPU's memory at
N = 32768 in every dtype and mode but the bf16 forward, 66 GiB, Problem 3.6), causal; on a CPU a small grid at
batch 1. Goal rows
(``--goals`` runs only these, for ``sdpa`` and ``flash_triton`` unless ``--providers`` says otherwise): the
leaderboard configuration (batch·heads 16, Nq = Nk = 16384, D = 64, causal, bf16; forward, backward and
forward+backward) and a forward-throughput
row (batch 8, N = 16384, D = 128, non-causal, bf16). The goal report compares them with the targets and
with SDPA in the same run, and says loudly when a comparison is missing.

Columns: ``tflops`` is model FLOPs per second (``kit.flops.attention_flops``: 4·B·H·Nq·Nk·D forward, halved
when causal; backward 2×, forward+backward 3× — recomputation not counted); ``model_gflop`` those FLOPs;
``executed_gflop`` the matmul FLOPs the provider's design actually executes (see ``DESIGNS``: the kit's
deterministic Triton backward recomputes S and dP in both its dK/dV and its dQ kernels, 7 matmuls
against the model's 4; counted for that design — when ``triton_config.run_backward`` picks the
one-kernel design, ``LLMSYS_FA_BACKWARD=fused`` or measured faster on the GPU, the backward executes 5).
Each cell is measured on its own: an error (a Triton compile error, OutOfResources, out of memory, a stub's
NotImplementedError) becomes that cell's ``status`` and the grid goes on. On CUDA each cell is timed with
``triton.testing.do_bench`` (median) and its peak memory taken on a call after the first (the first call
autotunes, and the autotuner allocates a cache-flush buffer). On a CPU the Triton kernels run in the
*interpreter*: those numbers say nothing about GPU speed — GPU figures must be measured on a GPU, and the goal
rows say they need CUDA.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import kit  # noqa: F401 — before triton: the interpreter on machines without CUDA
from kit import bench
from kit.flops import attention_flops
from kit.impl import load
from kit.model import naive_attention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("forward", "backward", "forward_backward")
PROVIDERS = ("naive", "naive_compiled", "sdpa", "flash_pytorch", "flash_triton")
GOAL_PROVIDERS = ("sdpa", "flash_triton")
# Matmuls of 2·Nq·Nk·D FLOPs each that a design executes: (forward, backward, skips fully masked causal tiles).
# naive: S = q·kᵀ and P·v; backward dV, dP, dQ, dK from the saved P. Flash designs recompute S (and P)
# in backward; FlashAttention-2's single backward kernel (SDPA's flash backend, FlashAttentionPytorch)
# does S, dV, dP, dQ, dK; the kit's Triton backward computes dK/dV in one kernel (S, dV, dP, dK) and dQ
# in another (S, dP, dQ) so that no result is written twice (deterministic).
DESIGNS = {"naive": (2, 4, False), "naive_compiled": (2, 4, False), "sdpa_flash": (2, 5, True),
           "flash_pytorch": (2, 5, True), "flash_triton": (2, 7, True)}
COLUMNS = ["config", "provider", "dtype", "batch", "heads", "seq", "d_head", "causal", "mode", "ms", "tflops",
           "model_gflop", "executed_gflop", "peak_mib", "status"]
GOAL_MS, GOAL_TFLOPS = 5.0, 450.0


def forces_flash(on_cuda: bool, dtype: torch.dtype) -> bool:
    """Whether ``sdpa`` is pinned to its flash backend: on CUDA, for the half-precision dtypes it supports."""
    return on_cuda and dtype != torch.float32


def make_provider(name: str, on_cuda: bool, impl) -> Callable:
    """``attn(q, k, v, causal) -> o`` for a provider name; q, k, v of shape ``(batch, heads, N, D)``."""
    if name == "naive":
        return naive_attention
    if name == "naive_compiled":
        # Default dynamic=None: the first shape compiles statically, the next recompiles once with
        # symbolic sizes, so the whole grid costs a few compilations rather than one per cell.
        return torch.compile(naive_attention)
    if name == "sdpa":
        def sdpa(q, k, v, causal):
            if forces_flash(on_cuda, q.dtype):
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return sdpa
    if name == "flash_pytorch":
        apply = impl.flash_attention.FlashAttentionPytorch.apply
        return lambda q, k, v, causal: apply(q, k, v, causal)
    if name == "flash_triton":
        apply = impl.flash_attention.FlashAttentionTriton.apply
        return lambda q, k, v, causal: apply(q, k, v, causal)
    raise ValueError(f"provider must be one of {PROVIDERS}, got {name!r}")


def executed_flops(provider: str, cell: dict, mode: str, on_cuda: bool) -> float | None:
    """Matmul FLOPs the provider's design executes for one call, or None when its design is not known here
    (SDPA when its backend is not pinned). Causal tile skipping is counted as the causal half; the
    diagonal tiles, computed in full, add a fraction tile/N more."""
    if provider == "sdpa":
        provider = "sdpa_flash" if forces_flash(on_cuda, DTYPES[cell["dtype"]]) else ""
    if provider not in DESIGNS:
        return None
    forward, backward, skips = DESIGNS[provider]
    matmuls = {"forward": forward, "backward": backward, "forward_backward": forward + backward}[mode]
    half = 0.5 if cell["causal"] and skips else 1.0
    return matmuls * 2.0 * cell["batch"] * cell["heads"] * cell["seq"] ** 2 * cell["d_head"] * half


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


def failure(exc: BaseException) -> str:
    """A cell's status for an exception: ``OOM``, ``not implemented: …`` or ``error: Type: first line``."""
    text = (str(exc).strip().splitlines() or [""])[0][:100]
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in text.lower():
        return "OOM"
    if isinstance(exc, NotImplementedError):
        return f"not implemented: {text}"
    return f"error: {type(exc).__name__}: {text}"


def make_call(attn: Callable, cell: dict, mode: str, device: torch.device) -> Callable[[], object]:
    """The call to time for one mode, on seeded inputs q, k, v, dO of shape ``(batch, heads, N, D)``.

    ``backward`` differentiates one retained graph (its forward runs here, untimed)."""
    shape = (cell["batch"], cell["heads"], cell["seq"], cell["d_head"])
    dtype, causal = DTYPES[cell["dtype"]], cell["causal"]
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=g, requires_grad=True) for _ in range(3))
    do = torch.randn(shape, device=device, dtype=dtype, generator=g)
    if mode == "forward":
        def forward():
            with torch.no_grad():
                return attn(q, k, v, causal)

        return forward
    if mode == "backward":
        o = attn(q, k, v, causal)
        return lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    return lambda: torch.autograd.grad(attn(q, k, v, causal), (q, k, v), do)


def measure(attn: Callable, cell: dict, device: torch.device, cpu_iters: int) -> dict[str, tuple]:
    """``{mode: (ms or None, peak MiB or None, status)}`` for one provider and one cell; never raises."""
    on_cuda = device.type == "cuda"
    out: dict[str, tuple] = {}
    for mode in cell["modes"]:
        fn = None
        try:
            fn = make_call(attn, cell, mode, device)
            peak = None
            if on_cuda:
                fn()  # compiles and autotunes: the autotuner's cache-flush buffer must not count
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                fn()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() / 2**20
            out[mode] = (time_ms(fn, on_cuda, cpu_iters), peak, "ok")
        except Exception as exc:  # one cell's failure is that cell's status: the grid goes on
            out[mode] = (None, None, failure(exc))
        finally:
            fn = None  # free the inputs and any retained graph before the next mode
            if on_cuda:
                torch.cuda.empty_cache()
    return out


def plan(args, on_cuda: bool) -> list[dict]:
    """The cells to run: the grid (unless ``--goals``), then the goal rows (unless ``--smoke``)."""
    if args.smoke:
        seqs, dims, dtypes = [128], [16], ["fp32"]
    elif on_cuda:
        seqs, dims, dtypes = [2**p for p in range(7, 16)], [16, 32, 64, 128], ["bf16", "fp32"]
    else:
        seqs, dims, dtypes = [128, 256, 512], [16, 64], ["fp32", "bf16"]
    # On a GPU the grid runs at the leaderboard's batch·heads, 16: naive attention's N × N tensors then exceed
    # 80 GB at N = 32768 in every dtype and mode but the bf16 forward (at batch 1 they would still fit at 65536).
    batch = 16 if on_cuda and not args.smoke else 1
    cells = [] if args.goals else [
        dict(config="grid", batch=batch, heads=1, seq=s, d_head=d, dtype=t, causal=True, modes=MODES)
        for t in dtypes for d in dims for s in seqs]
    if not args.smoke:
        cells.append(dict(config="leaderboard", batch=16, heads=1, seq=16384, d_head=64, dtype="bf16", causal=True,
                          modes=MODES))
        cells.append(dict(config="fwd-throughput", batch=8, heads=1, seq=16384, d_head=128, dtype="bf16",
                          causal=False, modes=("forward",)))
    return cells


def skip_reason(provider: str, cell: dict, on_cuda: bool, args) -> str | None:
    """Why a provider does not run a cell on this machine, or None when it does."""
    seq = cell["seq"]
    if not on_cuda:
        if cell["config"] != "grid":
            return "needs CUDA: a goal row, measured on a GPU only"
        if provider == "naive_compiled" and not args.compile_on_cpu:
            return "skipped on CPU: torch.compile takes minutes here (--compile-on-cpu)"
        if provider == "flash_triton" and seq > args.cpu_triton_max_seq:
            return f"skipped: Triton interpreter, N > {args.cpu_triton_max_seq}"
        if provider == "flash_pytorch" and seq > 1024:
            return "skipped: Python tile loop too slow"
        return None
    if provider == "flash_pytorch" and cell["batch"] * cell["heads"] * seq > 4096:
        return "skipped: Python tile loop (B·H·N > 4096)"
    return None


def goal_report(rows: list[dict], on_cuda: bool, device_name: str = "") -> list[str]:
    """Lines comparing the goal rows with the Stage 3 targets (handout 03 §7) and with SDPA in the same run.
    A comparison that could not be made says so in a line starting with ``MISSING``. Printed, never asserted."""
    if not on_cuda:
        return [f"Goals (leaderboard ≤ {GOAL_MS} ms forward+backward and ≤ SDPA's flash backend; forward ≥ "
                f"{GOAL_TFLOPS:.0f} TFLOP/s at D=128) need a CUDA GPU: these CPU numbers do not measure them."]

    def row(config: str, provider: str, mode: str) -> dict | None:
        return next((r for r in rows if (r["config"], r["provider"], r["mode"]) == (config, provider, mode)), None)

    def missing(config: str, provider: str, mode: str) -> str | None:
        r = row(config, provider, mode)
        if r is not None and r["status"] == "ok":
            return None
        why = "not run (see --providers / --goals)" if r is None else r["status"]
        return f"MISSING {config} {mode} for {provider}: {why}"

    if not any(r["config"] != "grid" for r in rows):
        return ["Goal rows not run (--smoke): run --goals for the comparison with the targets and SDPA."]
    lines = [f"Goals on {device_name}:"]
    for mode in MODES:
        gaps = [m for m in (missing("leaderboard", p, mode) for p in GOAL_PROVIDERS) if m]
        lines += [f"  !! {m} — the leaderboard comparison is incomplete" for m in gaps]
        if gaps:
            continue
        mine, sdpa = row("leaderboard", "flash_triton", mode), row("leaderboard", "sdpa", mode)
        verdict = "not slower" if mine["ms"] <= sdpa["ms"] else "slower"
        line = f"  leaderboard {mode}: {mine['ms']:.2f} ms vs SDPA flash {sdpa['ms']:.2f} ms ({verdict})"
        if mode == "forward_backward":
            line += f"; goal ≤ {GOAL_MS} ms: {'met' if mine['ms'] <= GOAL_MS else 'missed'}"
        lines.append(line)
    gap = missing("fwd-throughput", "flash_triton", "forward")
    if gap:
        lines.append(f"  !! {gap} — the throughput goal is not measured")
    else:
        mine = row("fwd-throughput", "flash_triton", "forward")
        verdict = "met" if mine["tflops"] >= GOAL_TFLOPS else "missed"
        lines.append(f"  forward D=128 N=16384 bf16: {mine['tflops']:.0f} TFLOP/s "
                     f"(goal ≥ {GOAL_TFLOPS:.0f}: {verdict})")
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    p = bench.parser(__doc__)
    p.add_argument("--goals", action="store_true", help="only the goal rows (on a GPU: minutes, not hours)")
    p.add_argument("--providers", default=None,
                   help=f"comma-separated subset of {PROVIDERS} (default: all; with --goals: {GOAL_PROVIDERS})")
    p.add_argument("--cpu-iters", type=int, default=3, help="timed calls per cell on a CPU (median)")
    p.add_argument("--cpu-triton-max-seq", type=int, default=128,
                   help="longest sequence the interpreted Triton kernels run on a CPU")
    p.add_argument("--compile-on-cpu", action="store_true", help="also run torch.compile on a CPU (slow)")
    args = bench.parse(p, argv)
    default = GOAL_PROVIDERS if args.goals else PROVIDERS
    providers = [s.strip() for s in args.providers.split(",") if s.strip()] if args.providers else list(default)
    bad = [s for s in providers if s not in PROVIDERS]
    if bad:
        p.error(f"--providers: unknown {bad}; choose from {PROVIDERS}")
    if args.smoke:
        args.cpu_iters = 1

    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    if on_cuda:
        torch._dynamo.config.cache_size_limit = 64  # a few graphs per dtype and head dim
    impl = load(args.impl)
    cells = plan(args, on_cuda)
    notes = bench.bf16_notes(any(c["dtype"] == "bf16" for c in cells))
    rows: list[dict] = []
    for cell, provider in bench.progress([(c, s) for c in cells for s in providers], "attention"):
        base = {k: cell[k] for k in ("config", "batch", "heads", "seq", "d_head", "dtype", "causal")}
        reason = skip_reason(provider, cell, on_cuda, args)
        if reason is not None:
            results = {mode: (None, None, reason) for mode in cell["modes"]}
        else:
            try:
                attn = make_provider(provider, on_cuda, impl)
            except Exception as exc:  # e.g. a student module that does not import
                results = {mode: (None, None, failure(exc)) for mode in cell["modes"]}
            else:
                results = measure(attn, cell, device, args.cpu_iters)
        for mode, (ms, peak, status) in results.items():
            flops = attention_flops(cell["batch"] * cell["heads"], cell["seq"], cell["seq"], cell["d_head"],
                                    causal=cell["causal"], mode=mode)
            executed = executed_flops(provider, cell, mode, on_cuda)
            rows.append({**base, "provider": provider, "mode": mode, "ms": ms,
                         "tflops": None if ms is None else flops / (ms * 1e-3) / 1e12,
                         "model_gflop": flops / 1e9, "executed_gflop": None if executed is None else executed / 1e9,
                         "peak_mib": peak, "status": status})

    title = "Attention: forward / backward / forward+backward (TFLOP/s on model FLOPs)"
    if not on_cuda:
        title += " — CPU run (Triton interpreted); GPU figures must be measured on a GPU"
    bench.save("bench_attention", rows, args, columns=COLUMNS, title=title, notes=notes)

    grid = [r for r in rows if r["config"] == "grid" and r["mode"] == "forward_backward" and r["ms"] is not None]
    if grid:
        d_plot = max(r["d_head"] for r in grid)
        dtypes = sorted({r["dtype"] for r in grid})
        fig, axes = bench.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4), squeeze=False)
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
        fig.suptitle(f"bench_attention on {'CUDA' if on_cuda else 'CPU (Triton interpreted: not a GPU speed)'}")
        bench.save_figure(fig, "bench_attention", args)
    print("\n" + "\n".join(goal_report(rows, on_cuda, torch.cuda.get_device_name(0) if on_cuda else "")))
    return rows


if __name__ == "__main__":
    main()
