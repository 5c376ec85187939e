"""Stage 6 benchmark: pipeline schedules measured — bubble fraction vs (p−1)/(m+p−1), peak activation memory.

    python -m benchmarks.bench_pipeline            # p ∈ {2, 4}, m ∈ {1, 2, 4, 8}, GPipe and 1F1B
    python -m benchmarks.bench_pipeline --smoke    # p = 2, m ∈ {2, 4}: a few seconds (into bench-output/smoke/)
    python -m benchmarks.bench_pipeline --impl reference --save   # the committed benchmarks/results/ tables
    torchrun --nproc-per-node 4 -m benchmarks.bench_pipeline      # one depth: p = the launcher's WORLD_SIZE

One spawn per pipeline depth p; inside it every (schedule, m) runs a warm-up step and timed steps. The
measured bubble is 1 − (time stage 0 spent computing) / (step time). On a CPU with fewer cores than
stages the stages also compete for cores, so expect the measurement to sit above the formula. Run it from
the repository root. Writes ``bench_pipeline.{md,csv,json,png}`` into ``bench-output/`` unless ``--out
DIR`` or ``--save`` (full reference runs only) says otherwise.
"""

from __future__ import annotations

import kit  # noqa: F401 — sets TRITON_INTERPRET first
import kit.impl
from kit import bench, launch


def _rank(impl_name: str, p: int, ms: list[int], d_model: int, seq: int, mbs: int, iters: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from kit.model import ModelConfig, TransformerLM

    pp = kit.impl.load(impl_name).parallel.pipeline_parallel
    cfg = ModelConfig(vocab_size=256, context_length=seq, d_model=d_model, d_ff=4 * d_model, num_layers=2 * p,
                      num_heads=4)
    torch.manual_seed(0)
    stage = pp.PipelineStage(TransformerLM(cfg), dist.get_rank(), p)
    rows = []
    for kind in ("gpipe", "1f1b"):
        run = pp.gpipe if kind == "gpipe" else pp.one_f_one_b
        for m in ms:
            tokens = torch.randint(0, 256, (m, mbs, seq + 1), generator=torch.Generator().manual_seed(m))
            batches = [(tokens[i, :, :-1], tokens[i, :, 1:]) for i in range(m)]
            results = []
            for it in range(iters + 1):  # the first is a warm-up
                dist.barrier()
                res = run(stage, batches, group=None, activation_shape=(mbs, seq, d_model))
                stage.zero_grad(set_to_none=True)
                if it:
                    results.append(res)
            busy = sum(r.busy_s for r in results) / iters
            total = sum(r.total_s for r in results) / iters
            rows.append({"schedule": kind, "m": m, "stage": dist.get_rank(), "busy_s": busy, "total_s": total,
                         "peak_act_MiB": results[-1].peak_activation_bytes / 2**20,
                         "in_flight": results[-1].peak_in_flight})
    return rows


@launch.exit_on_launch_error("bench_pipeline")
def main(argv: list[str] | None = None) -> list[dict]:
    args = bench.parse(bench.parser(__doc__), argv)
    pp = kit.impl.load(args.impl).parallel.pipeline_parallel
    if args.smoke:
        depths, ms, d_model, seq, mbs, iters = [2], [2, 4], 32, 16, 2, 1
    else:
        depths, ms, d_model, seq, mbs, iters = [2, 4], [1, 2, 4, 8], 128, 64, 4, 3
    depths = launch.world_sizes(None, depths, option="pipeline depth")
    rows = []
    for p in bench.progress(depths, "pipeline depth", unit="depth"):
        per_rank = launch.on_ranks(_rank, p, args=(args.impl, p, ms, d_model, seq, mbs, iters), timeout=600,
                                   backend="gloo", what="bench_pipeline")
        if not launch.is_main():
            return per_rank[launch.launched().rank]  # under torchrun, rank 0 writes the tables
        for kind in ("gpipe", "1f1b"):
            for m in ms:
                stages = [next(r for r in rank_rows if r["schedule"] == kind and r["m"] == m) for rank_rows in per_rank]
                total = max(s["total_s"] for s in stages)
                rows.append({
                    "p": p, "m": m, "schedule": kind, "step_ms": 1e3 * total,
                    "bubble_measured": 1 - stages[0]["busy_s"] / total,
                    "bubble_formula": pp.bubble_fraction(p, m),
                    "in_flight_stage0": stages[0]["in_flight"],
                    "peak_act_MiB_stage0": stages[0]["peak_act_MiB"],
                    "peak_act_MiB_last": stages[-1]["peak_act_MiB"],
                })
    bench.save("bench_pipeline", rows, args, title="Pipeline bubble (stage 0) and peak activation memory per stage")

    fig, (ax1, ax2) = bench.subplots(1, 2, figsize=(10, 4))
    for p in sorted({r["p"] for r in rows}):
        for kind, style in (("gpipe", "o-"), ("1f1b", "s--")):
            sel = [r for r in rows if r["p"] == p and r["schedule"] == kind]
            ms = [r["m"] for r in sel]
            ax1.plot(ms, [r["bubble_measured"] for r in sel], style, label=f"{kind} p={p} measured")
            ax2.plot(ms, [r["peak_act_MiB_stage0"] for r in sel], style, label=f"{kind} p={p}")
        sel = [r for r in rows if r["p"] == p and r["schedule"] == "gpipe"]
        ax1.plot([r["m"] for r in sel], [r["bubble_formula"] for r in sel], "k:", label=f"(p−1)/(m+p−1), p={p}")
    ax1.set(xlabel="micro-batches m", ylabel="bubble fraction (stage 0)", xscale="log", title="Bubble")
    ax2.set(xlabel="micro-batches m", ylabel="peak saved activations, stage 0 (MiB)", xscale="log",
            title="Activation memory")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    bench.save_figure(fig, "bench_pipeline", args)
    return rows


if __name__ == "__main__":
    main()
