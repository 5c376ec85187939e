"""Stage 1 benchmark: the memory timeline of two AdamW train steps, by category (handout 01 §6, Problem 1.10).

    python -m benchmarks.bench_memory                          # CPU: mini, context 128, batch 4, fp32
    python -m benchmarks.bench_memory --preset small --context 512   # larger (a GPU: --device cuda)
    python -m benchmarks.bench_memory --smoke                  # seconds, into bench-output/smoke/
    python -m benchmarks.bench_memory --impl reference --save  # the committed benchmarks/results/ table

Run it from the repository root. torch.profiler (``profile_memory=True``) records every allocation of two
train steps of the kit's Transformer, the first with a fresh AdamW (its state is created in that step's
optimizer phase), and ``kit.memory_timeline`` classifies the bytes alive over time: parameters, optimizer
state, gradients, activations, temporaries. Writes the picture ``bench_memory.png`` and a table of each
phase's peak by category (``bench_memory.{md,csv,json}``), stamped as every benchmark; the model has
Ψ parameters, so the parameter band should read 4Ψ bytes, the gradients 4Ψ and AdamW's state 8Ψ.
The step is the kit's own (no student code runs), so ``--impl`` changes nothing here.
"""

from __future__ import annotations

import torch

import kit  # noqa: F401 — sets TRITON_INTERPRET before triton loads
from kit import bench
from kit import memory_timeline as mt
from kit.model import TransformerLM, cross_entropy, get_config

MiB = 2**20


def main(argv: list[str] | None = None) -> list[dict]:
    p = bench.parser(__doc__)
    p.add_argument("--preset", default="mini")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = bench.parse(p, argv)
    if args.smoke:
        args.preset, args.context, args.batch_size = "tiny", 32, 2

    torch.manual_seed(0)
    config = get_config(args.preset, context_length=max(args.context, get_config(args.preset).context_length))
    model = TransformerLM(config).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, config.vocab_size, (args.batch_size, args.context + 1), device=args.device)
    step = mt.train_step_fn(model, optimizer, (tokens[:, :-1], tokens[:, 1:]), cross_entropy)
    psi = sum(p.numel() for p in model.parameters())

    def two_steps() -> None:
        for _ in bench.progress(range(2), "train steps", unit="step"):
            step()

    timeline = mt.record(two_steps, device=args.device)
    rows = []
    for peak in timeline.phase_peaks():
        rows.append({"preset": args.preset, "context": args.context, "batch": args.batch_size,
                     "params_M": psi / 1e6, "step": peak["range"] // len(mt.PHASES) + 1, "phase": peak["phase"],
                     "peak_ms": peak["time_ms"], "total_MiB": peak["total"] / MiB,
                     **{f"{c}_MiB": peak[c] / MiB for c in mt.CATEGORIES}})
    bench.save("bench_memory", rows, args,
               title=f"Stage 1 — memory timeline of two AdamW train steps ({args.preset}, context {args.context}, "
                     f"batch {args.batch_size}, fp32): each phase's peak by category ({timeline.source})")

    fig, ax = bench.subplots(figsize=(9, 4.5))
    mt.plot(timeline, ax, title=f"{args.preset}, context {args.context}, batch {args.batch_size}: two AdamW steps "
                                f"(Ψ = {psi / 1e6:.2f} M: 4Ψ = {4 * psi / MiB:.1f} MiB)")
    bench.save_figure(fig, "bench_memory", args)
    return rows


if __name__ == "__main__":
    main()
