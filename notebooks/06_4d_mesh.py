# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 6 — the 4D mesh, pipeline schedules and what they cost
#
# This notebook draws the rank layout of a dp × tp × pp × ep mesh, the GPipe and 1F1B schedules
# with their bubbles, trains the tiny MoE Transformer on two CPU ranks, and runs the accounting
# for a 405B model. It runs your implementation (`LLMSYS_IMPL`, default `student`). Handout:
# `handout/06-4d-parallelism.md`.

# %%
import matplotlib.pyplot as plt

import kit  # noqa: F401 — first: sets TRITON_INTERPRET on CPU machines
import kit.impl

impl = kit.impl.load()
mesh, pp, acc, t4 = (impl.parallel.mesh, impl.parallel.pipeline_parallel, impl.parallel.accounting,
                     impl.parallel.train_4d)
print(impl)

# %% [markdown]
# ## 1. The mesh: tensor parallel innermost
# Rank = ((pp·dp + d)·ep + e)·tp + t. Neighbouring ranks share a tp group (one node's fast links).

# %%
layouts = [dict(dp=2, tp=2, pp=2, ep=1), dict(dp=1, tp=2, pp=2, ep=2)]
for layout in layouts:
    print(layout)
    print(mesh.format_mesh(**layout), "\n")

fig, axes = plt.subplots(1, 2, figsize=(10, 4))
for ax, layout in zip(axes, layouts):
    grid = mesh.rank_grid(**layout)[:, :, :, 0]  # (pp, dp, ep, cp, tp) → (pp, dp, ep, tp): cp = 1 here
    p_, d_, e_, t_ = grid.shape
    for p in range(p_):
        for d in range(d_):
            for e in range(e_):
                for t in range(t_):
                    row = p * d_ * e_ + d * e_ + e
                    ax.add_patch(plt.Rectangle((t, -row), 0.95, 0.95, color=plt.cm.tab10(p), alpha=0.35 + 0.3 * t))
                    ax.text(t + 0.47, -row + 0.47, str(int(grid[p, d, e, t])), ha="center", va="center", fontsize=14)
                    if t == 0:
                        ax.text(-0.1, -row + 0.47, f"pp{p} dp{d} ep{e}", ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.6, t_)
    ax.set_ylim(-(p_ * d_ * e_) + 0.8, 1.1)
    ax.set_xticks([t + 0.47 for t in range(t_)], [f"tp={t}" for t in range(t_)])
    ax.set_yticks([])
    ax.set_title("dp×tp×pp×ep = " + "×".join(str(layout[k]) for k in ("dp", "tp", "pp", "ep")))
fig.tight_layout()
fig.savefig("06_mesh.png", dpi=110)

# %% [markdown]
# ## 2. GPipe and 1F1B on ideal hardware
# `simulate_schedule` runs each stage's order of F/B operations with a backward twice as long as a
# forward and free communication. Both schedules idle for (p−1)/(m+p−1) of the step; 1F1B holds at
# most p − s micro-batches on stage s.

# %%
p, m = 4, 8
fig, axes = plt.subplots(2, 1, figsize=(11, 5), sharex=True)
for ax, kind in zip(axes, ("gpipe", "1f1b")):
    timeline = pp.simulate_schedule(kind, p, m, 1.0, 2.0)
    for s, ops in enumerate(timeline):
        for op, i, t0, t1 in ops:
            ax.barh(s, t1 - t0, left=t0, color=plt.cm.tab10(i % 10), alpha=1.0 if op == "F" else 0.55,
                    edgecolor="black")
            ax.text((t0 + t1) / 2, s, f"{op}{i}", ha="center", va="center", fontsize=7)
    end = max(e[3] for stage in timeline for e in stage)
    idle = 1 - sum(e[3] - e[2] for e in timeline[0]) / end
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.invert_yaxis()
    ax.set_title(f"{kind}: p={p}, m={m} — bubble {idle:.3f} (formula {pp.bubble_fraction(p, m):.3f})")
axes[-1].set_xlabel("time (forward = 1)")
fig.tight_layout()
fig.savefig("06_schedules.png", dpi=110)

for kind, order_fn in (("gpipe", pp.gpipe_order), ("1f1b", pp.one_f_one_b_order)):
    peaks = []
    for s in range(p):
        alive, peak = set(), 0
        for op, i in order_fn(p, s, m):
            (alive.add if op == "F" else alive.remove)(i)
            peak = max(peak, len(alive))
        peaks.append(peak)
    print(f"{kind}: micro-batches alive at once per stage = {peaks}")

# %% [markdown]
# ## 3. Train on two CPU ranks
# A two-stage pipeline (pp = 2) of the tiny MoE Transformer, 1F1B over 4 micro-batches. The same entry
# point runs any mesh: `python -m student.parallel.train_4d --dp 2 --tp 2 --pp 2` uses 8 ranks.

# %%
cfg = t4.Train4DConfig(dp=1, tp=1, pp=2, ep=1, global_batch_size=8, micro_batch_size=2, grad_accum_steps=4,
                       steps=4, seq_len=16)
results = t4.train_on_ranks(cfg, timeout=240)
losses = results[0]["losses"]
print("loss per step:", [round(x, 4) for x in losses])
fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(losses, "o-")
ax.set(xlabel="step", ylabel="cross-entropy", title="tiny MoE Transformer, pp=2 on CPU")
fig.tight_layout()
fig.savefig("06_loss.png", dpi=110)

# %% [markdown]
# ## 4. Accounting: a 405B model on 80 GB devices

# %%
for mp in (1, 16):
    row = {f"ZeRO-{z}": acc.devices_needed(405e9, 80e9, zero_stage=z, model_parallel=mp) for z in range(4)}
    print(f"tp·pp = {mp:2d}:", row)

stages = range(4)
fig, ax = plt.subplots(figsize=(6, 3.5))
bottom = [0.0] * 4
for part in ("weights", "gradients", "optimizer"):
    vals = [acc.training_state_bytes(405e9 / 16, zero_stage=z, dp=64)[part] / 1e9 for z in stages]
    ax.bar([f"ZeRO-{z}" for z in stages], vals, bottom=bottom, label=part)
    bottom = [b + v for b, v in zip(bottom, vals)]
ax.axhline(80, color="k", ls=":", label="80 GB")
ax.set(ylabel="GB per device", title="405B, tp·pp = 16, dp = 64 (1024 devices)")
ax.legend()
fig.tight_layout()
fig.savefig("06_memory.png", dpi=110)

bound = acc.fsdp_tp_compute_bound(peak_flops=989e12, fsdp_bandwidth=50e9, tp_bandwidth=450e9, d_ff=28672, fsdp=64)
print({k: round(v, 1) for k, v in bound.items()})
