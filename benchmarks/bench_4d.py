"""Stage 6 benchmark: the same 8-rank job on several mesh shapes — step time, and communication time per axis.

    python -m benchmarks.bench_4d           # 8 ranks: dp8, dp4×tp2, dp2×tp2×pp2, dp2×pp2×ep2, tp2×pp2×ep2
    python -m benchmarks.bench_4d --smoke   # 2 ranks: dp2, tp2, pp2, ep2 (into bench-output/smoke/)
    python -m benchmarks.bench_4d --impl reference --save   # the committed benchmarks/results/ tables
    torchrun --nnodes 2 --nproc-per-node 4 … -m benchmarks.bench_4d   # the same 8 ranks on two nodes

One spawn runs every shape (each builds its own mesh in the same process group), all with the same global
batch (4 sequences per rank; micro-batch 2, accumulation fills the rest). Step time is the median
of the timed steps of :func:`train_4d.train`. Communication per axis is *replayed*: the collectives that
``accounting.comm_volume_per_step`` lists for this rank's stage — same kind, message size and count —
run alone on that axis's group and are timed (``kit.bench.step_time``: the slowest rank counts), so each
axis's cost is seen without compute to hide it. Run it from the repository root. Writes
``bench_4d.{md,csv,json,png}`` into ``bench-output/`` unless ``--out DIR`` or ``--save`` (full reference
runs only) says otherwise.
"""

from __future__ import annotations

import statistics

import kit  # noqa: F401 — sets TRITON_INTERPRET first
from kit import bench, launch

FULL = [(8, 1, 1, 1), (4, 2, 1, 1), (2, 2, 2, 1), (2, 1, 2, 2), (1, 2, 2, 2)]  # (dp, tp, pp, ep)
SMOKE = [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)]
AXES = ("tp", "pp", "ep", "dp_ep", "dp")


def _axis_times(mesh, cfg, stage: int, impl) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    acc = impl.parallel.accounting

    dense = acc.stage_parameter_counts(cfg, stage)
    b, t, d, m = cfg.micro_batch_size, cfg.seq_len, cfg.model.d_model, cfg.grad_accum_steps
    start, end = impl.parallel.pipeline_parallel.split_layers(cfg.model.num_layers, cfg.pp)[stage]
    layers = end - start
    act = torch.randn(b, t, d)
    times: dict[str, float] = {}

    def timed(axis: str, fn) -> None:
        times[axis] = bench.step_time(fn)

    if cfg.tp > 1:
        g = mesh.get_group("tp")
        timed("tp", lambda: [dist.all_reduce(act.clone(), group=g) for _ in range(2 * layers * m)])
    if cfg.ep > 1:
        g = mesh.get_group("ep")
        cap = impl.parallel.expert_parallel.expert_capacity(b * t, cfg.num_experts, cfg.top_k, cfg.capacity_factor)
        buf = torch.randn(cfg.num_experts, cap, d)

        def a2a() -> None:
            for _ in range(4 * layers * m):
                dist.all_to_all_single(torch.empty_like(buf), buf, group=g)
        timed("ep", a2a)
    if cfg.pp > 1:
        g = mesh.get_group("pp")
        s, p = dist.get_rank(g), cfg.pp

        def p2p() -> None:
            # Every activation forward, then every gradient back, as the step moves them (without compute).
            for direction in (1, -1):
                for _ in range(m):
                    ops = []
                    if 0 <= s + direction < p:
                        ops.append(dist.P2POp(dist.isend, act, dist.get_global_rank(g, s + direction), g))
                    if 0 <= s - direction < p:
                        peer = dist.get_global_rank(g, s - direction)
                        ops.append(dist.P2POp(dist.irecv, torch.empty_like(act), peer, g))
                    for w in dist.batch_isend_irecv(ops) if ops else []:
                        w.wait()
        timed("pp", p2p)
    if cfg.dp * cfg.ep > 1:
        g = impl.parallel.mesh.dense_grad_group(mesh)
        timed("dp_ep", lambda: dist.all_reduce(torch.randn(dense["dense"]), group=g))
    if cfg.dp > 1 and dense["expert"]:
        g = mesh.get_group("dp")
        timed("dp", lambda: dist.all_reduce(torch.randn(dense["expert"]), group=g))
    return times


def _rank(impl_name: str, shapes: list[tuple[int, int, int, int]], steps: int, model_kwargs: dict,
          global_batch: int) -> list[dict]:
    import torch.distributed as dist

    import kit.impl
    from kit.model import ModelConfig

    impl = kit.impl.load(impl_name)
    t4, acc = impl.parallel.train_4d, impl.parallel.accounting
    rows = []
    for dp, tp, pp, ep in bench.progress(shapes, f"mesh shapes on {dist.get_world_size()} ranks", unit="shape"):
        # The same job on every mesh: a fixed global batch; accumulation makes up for fewer data shards.
        mbs, ga = 2, global_batch // (2 * dp * ep)
        cfg = t4.Train4DConfig(dp=dp, tp=tp, pp=pp, ep=ep, micro_batch_size=mbs, grad_accum_steps=ga,
                               global_batch_size=mbs * ga * dp * ep, steps=steps,
                               seq_len=model_kwargs["context_length"], model=ModelConfig(**model_kwargs), num_experts=8)
        mesh = impl.parallel.mesh.build_mesh(dp=dp, tp=tp, pp=pp, ep=ep, device_type="cpu")
        out = t4.train(cfg, mesh)
        stage = out["coords"]["pp"]
        comm = _axis_times(mesh, cfg, stage, impl)
        volume = acc.comm_volume_per_step(cfg, stage)
        rows.append({"shape": (dp, tp, pp, ep), "rank": dist.get_rank(),
                     "step_s": statistics.median(out["step_s"][1:]),
                     "comm_s": comm,
                     "bytes": {a: sum(n for (ax, _), n in volume.items() if ax == a) for a, _ in volume},
                     "loss": out["losses"][-1]})
    return rows


@launch.exit_on_launch_error("bench_4d")
def main(argv: list[str] | None = None) -> list[dict]:
    args = bench.parse(bench.parser(__doc__), argv)
    if args.smoke:
        world, shapes, steps = 2, SMOKE, 2
        model = dict(vocab_size=128, context_length=16, d_model=32, d_ff=64, num_layers=2, num_heads=4)
    else:
        world, shapes, steps = 8, FULL, 4
        model = dict(vocab_size=512, context_length=64, d_model=128, d_ff=256, num_layers=4, num_heads=8)
    # One spawn runs every shape; rank 0 draws the progress bar.
    per_rank = launch.on_ranks(_rank, world, args=(args.impl, shapes, steps, model, 4 * world), timeout=600,
                               backend="gloo", what=f"bench_4d{' --smoke' if args.smoke else ''}'s meshes")
    if not launch.is_main():
        return per_rank[launch.launched().rank]  # under torchrun, rank 0 writes the tables
    rows = []
    for i, shape in enumerate(shapes):
        ranks = [r[i] for r in per_rank]
        row = {"dp×tp×pp×ep": "×".join(map(str, shape)),
               "step_ms": 1e3 * max(r["step_s"] for r in ranks), "loss": ranks[0]["loss"]}
        for axis in AXES:
            row[f"{axis}_comm_ms"] = 1e3 * max(r["comm_s"].get(axis, 0.0) for r in ranks)
            row[f"{axis}_MiB"] = max(r["bytes"].get(axis, 0) for r in ranks) / 2**20
        rows.append(row)
    bench.save("bench_4d", rows, args,
               title=f"One {world}-rank job, several meshes: step time and per-axis communication (replayed)")

    names = [r["dp×tp×pp×ep"] for r in rows]
    fig, ax = bench.subplots(figsize=(8, 4))
    bottom = [0.0] * len(rows)
    for axis in AXES:
        vals = [r[f"{axis}_comm_ms"] for r in rows]
        ax.bar(names, vals, bottom=bottom, label=f"{axis} comm (replayed)")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(names, [r["step_ms"] for r in rows], "ko-", label="step time")
    ax.set(xlabel="mesh dp×tp×pp×ep", ylabel="ms", title="Step time and communication per axis")
    ax.legend(fontsize=8)
    bench.save_figure(fig, "bench_4d", args)
    return rows


if __name__ == "__main__":
    main()
