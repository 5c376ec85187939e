"""Stage 7 benchmark: the LM-head loss, naive against fused — time and peak memory of forward + backward by V.

    python -m benchmarks.bench_fused_loss                       # CPU: 128 tokens, d = 32, V = 256 … 4096, fp32
    python -m benchmarks.bench_fused_loss --smoke               # seconds, any machine (into bench-output/smoke/)
    python -m benchmarks.bench_fused_loss --dtype bf16          # a GPU: 8192 tokens, d = 4096, V up to 151,936
    python -m benchmarks.bench_fused_loss --impl reference --save   # the committed benchmarks/results/ table

Run it from the repository root. For each vocabulary size V and each loss — ``naive`` (``naive_linear_cross_entropy``:
the ``(tokens, V)`` logits in the input dtype, upcast to fp32, ``F.cross_entropy``) and ``fused``
(``fused_linear_cross_entropy``, the Triton kernels) — one forward + backward of ``tokens`` tokens:

* ``ms`` — the median wall time of ``--repeat`` runs after one warm-up (CUDA: synchronised);
* ``peak_MiB`` — ``peak_memory_bytes`` of one run: the most bytes allocated by the step and alive at once (CUDA: the
  allocator's peak; CPU: every allocation watched through a dispatch mode);
* ``logits_MiB`` — what the fp32 logits alone would take, ``4 · tokens · V`` bytes;
* ``loss`` and ``loss_diff`` — the loss, and |fused − naive| (they must agree to rounding).

On a CPU the fused kernels run in Triton's *interpreter*: their times say that the harness works and nothing about a
GPU (where they are unmeasured: no GPU was available when this was written). The memory column is meaningful
anywhere. Writes ``fused_loss.{md,csv,json,png}`` into ``bench-output/`` unless ``--out DIR`` or ``--save`` says
otherwise.
"""

from __future__ import annotations

import importlib
import statistics
import time

import torch

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit import bench
from kit.impl import load

MiB = 2**20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_one(fce, name: str, tokens: int, vocab: int, d: int, dtype: torch.dtype, repeat: int,
            device: torch.device) -> dict:
    """Time and peak memory of one loss (``naive`` or ``fused``) at one size."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, d, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(vocab, d, generator=g) / d**0.5).to(device=device, dtype=dtype)
    t = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    fn = fce.naive_linear_cross_entropy if name == "naive" else fce.fused_linear_cross_entropy
    leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    losses = []

    def step() -> None:
        for leaf in leaves:
            leaf.grad = None
        loss = fn(leaves[0], leaves[1], t)
        loss.backward()
        losses.append(loss.item())

    step()  # warm-up: compiles the kernels on a GPU
    times = []
    for _ in range(repeat):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = fce.peak_memory_bytes(step)
    return {"loss_fn": name, "tokens": tokens, "vocab": vocab, "d": d, "dtype": str(dtype).removeprefix("torch."),
            "ms": 1e3 * statistics.median(times), "peak_MiB": peak / MiB, "logits_MiB": 4 * tokens * vocab / MiB,
            "loss": losses[-1]}


def main(argv: list[str] | None = None) -> list[dict]:
    p = bench.parser(__doc__)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--d", type=int, default=None)
    p.add_argument("--vocab", nargs="+", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--repeat", type=int, default=None, help="timed runs per cell (the median is reported)")
    args = bench.parse(p, argv)
    if args.smoke:
        tokens, d, vocabs, repeat = 32, 16, [64, 256], 1
    elif kit.triton_interpreted():  # the interpreter takes seconds per tile sweep: small, one timed run
        tokens, d, vocabs, repeat = 128, 32, [256, 1024, 4096], 1
    else:
        tokens, d, vocabs, repeat = 8192, 4096, [4096, 32768, 151936], 5
    tokens, d = args.tokens or tokens, args.d or d
    vocabs, repeat = args.vocab or vocabs, args.repeat or repeat
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fce = importlib.import_module(f"{load(args.impl).package}.whole_step.fused_cross_entropy")
    dtype = DTYPES[args.dtype]
    notes = bench.bf16_notes(args.dtype == "bf16")
    rows = []
    for vocab in bench.progress(vocabs, "vocabulary sizes"):
        pair = [run_one(fce, name, tokens, vocab, d, dtype, repeat, device) for name in ("naive", "fused")]
        for row in pair:
            row["loss_diff"] = abs(pair[1]["loss"] - pair[0]["loss"])
        rows += pair
    bench.save("fused_loss", rows, args, notes=notes,
               title=f"LM-head loss, naive vs fused: forward + backward, {tokens} tokens, d = {d}, {args.dtype}, "
                     f"{device.type}" + (" (Triton interpreted: times are not GPU times)" if kit.triton_interpreted()
                                         else ""))
    fig, (ax_mem, ax_time) = bench.subplots(1, 2, figsize=(10, 4))
    for name, marker in (("naive", "o"), ("fused", "s")):
        sel = [r for r in rows if r["loss_fn"] == name]
        ax_mem.loglog([r["vocab"] for r in sel], [r["peak_MiB"] for r in sel], marker=marker, label=name)
        ax_time.loglog([r["vocab"] for r in sel], [r["ms"] for r in sel], marker=marker, label=name)
    ax_mem.loglog(vocabs, [4 * tokens * v / MiB for v in vocabs], "k:", label="fp32 logits")
    ax_mem.set(xlabel="vocabulary size V", ylabel="peak MiB (forward + backward)", title="memory")
    ax_time.set(xlabel="vocabulary size V", ylabel="ms (median)",
                title="time" + (" — interpreted, not GPU" if kit.triton_interpreted() else ""))
    ax_mem.legend()
    ax_time.legend()
    bench.save_figure(fig, "fused_loss", args)
    return rows


if __name__ == "__main__":
    main()
