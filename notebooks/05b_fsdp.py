# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 5, part two — FSDP: the schedule and the memory of one step
#
# Companion to `handout/05b-fsdp.md`. Runs on a CPU in under a minute: two gloo ranks on this machine,
# started by `kit.spawn.run_on_ranks`. It uses your implementation (`student`) unless
# `LLMSYS_IMPL=reference` is set.
#
# 1. The accounting: bytes per rank and bytes per step for data parallelism, ZeRO-1 and FSDP, against
#    the number of ranks (the 2Ψ versus 3Ψ of handout §7).
# 2. A timeline of one FSDP step from torch.profiler, at prefetch 0, 1 and 2: when each all-gather
#    is issued and finishes, against the matmuls it should overlap (§3–§4).
# 3. The memory of each rank over the same step, measured, against the accounting's prediction.

# %%
import matplotlib.pyplot as plt

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit.impl import load
from kit.model import TransformerLM
from kit.spawn import run_on_ranks

impl = load()
print("implementation:", impl.package)

# %% [markdown]
# ## §7 The accounting, on paper
# A 7 B-parameter model with bf16 weights on the wire, fp32 master weights, gradients and AdamW state, in
# units the size of the kit's `2.7B` preset's matrices. `fsdp_accounting` gives the bytes one rank holds
# between steps and the bytes each collective moves; `zero_memory_accounting` the same for plain data
# parallelism (stage 0) and ZeRO-1.

# %%
import torch  # noqa: E402

with torch.device("meta"):
    model = TransformerLM("2.7B")
units = [[tuple(p.shape) for p in m.parameters(recurse=False)] for m in model.modules()
         if any(p.dim() >= 2 for p in m.parameters(recurse=False))]
replicated = [tuple(p.shape) for m in model.modules() for p in m.parameters(recurse=False) if p.dim() < 2]
psi = sum(p.numel() for p in model.parameters())
print(f"2.7B preset: Ψ = {psi / 1e9:.2f} B parameters, {len(units)} units, {len(replicated)} replicated vectors")

ranks = [2, 4, 8, 16, 32, 64, 128]
held = {"DDP": [], "ZeRO-1": [], "FSDP": []}
sent = {"DDP": [], "FSDP (reshard)": [], "FSDP (keep)": []}
for n in ranks:
    for name, stage in (("DDP", 0), ("ZeRO-1", 1)):
        held[name].append(impl.zero.zero_memory_accounting(psi, n, stage, param_bytes=4, grad_bytes=4,
                                                            optimizer_bytes_per_param=8).total_bytes / 2**30)
    acc = impl.fsdp.fsdp_accounting(units, replicated, n, compute_bytes=2)
    keep = impl.fsdp.fsdp_accounting(units, replicated, n, compute_bytes=2, reshard_after_forward=False)
    held["FSDP"].append(acc.total_bytes / 2**30)
    sent["DDP"].append(2 * (n - 1) / n * psi * 2 / 2**30)  # a ring all-reduce of bf16 gradients
    sent["FSDP (reshard)"].append(acc.sent_bytes / 2**30)
    sent["FSDP (keep)"].append(keep.sent_bytes / 2**30)

fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
for name, values in held.items():
    left.plot(ranks, values, marker="o", label=name)
left.set(xscale="log", yscale="log", xlabel="ranks N", ylabel="GiB per rank",
         title="params + grads + AdamW state (fp32)")
for name, values in sent.items():
    right.plot(ranks, values, marker="o", label=name)
right.set(xscale="log", xlabel="ranks N", ylabel="GiB sent per rank per step",
          title="ring traffic (bf16 on the wire, fp32 reductions)")
for ax in (left, right):
    ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig("fsdp_accounting.png", dpi=120)
plt.show()

# %% [markdown]
# Questions. (a) Why does the DDP curve on the left not move with N, and what is FSDP's slope? (b) On the
# right, FSDP sends more than DDP although its reductions are fp32 only once: which terms add up to the
# difference, and how much of it does `reshard_after_forward=False` remove? (c) Where does ZeRO-1 sit?

# %% [markdown]
# ## §3–§4 A timeline of one step: prefetch 0, 1 and 2
# `impl.fsdp_profile.profile_fsdp_steps((0, 1, 2))` profiles one AdamW step of a small Transformer
# wrapped in your `FSDP` on each rank, for each prefetch value, and returns spans: the phases, each
# matmul on the main thread (compute), each all-gather and each reduction from launch to completion on
# gloo's threads. Rank 0's are drawn.

# %%
per_rank = run_on_ranks(impl.fsdp_profile.profile_fsdp_steps, 2, args=((0, 1, 2),), timeout=240)
runs = {prefetch: [r[prefetch] for r in per_rank] for prefetch in (0, 1, 2)}

lanes = ["phase", "compute", "gather", "reduce"]
colors = {"forward": "#8c8c8c", "backward": "#4c72b0", "finish_gradient_synchronization": "#c44e52",
          "optimizer.step": "#937860", "gather": "#dd8452", "reduce": "#55a868", "compute": "#64b5cd"}
fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.4 * len(runs)), sharex=True)
for ax, (prefetch, profiles) in zip(axes, runs.items()):
    spans = profiles[0]["spans"]
    for lane, name, start, end in spans:
        color = colors.get(name, colors.get(lane))
        ax.broken_barh([(start, max(end - start, 0.01))], (lanes.index(lane), 0.8), color=color)
    gathers = sum(1 for s in spans if s[0] == "gather")
    step_ms = max(e for lane, n, s, e in spans if lane == "phase")
    ax.set_yticks([i + 0.4 for i in range(len(lanes))], lanes)
    ax.set_title(f"prefetch={prefetch}: {gathers} all-gathers, step {step_ms:.0f} ms (rank 0)", fontsize=9)
axes[-1].set_xlabel("ms since the step started")
fig.tight_layout()
fig.savefig("fsdp_timeline.png", dpi=120)
plt.show()

# %% [markdown]
# Questions. (a) With prefetch 0, where does each all-gather start relative to the previous unit's
# matmuls, and with prefetch 1? (b) Count the all-gathers: why twice the number of units? (c) On this
# machine gloo's threads share the two cores with the compute, so an all-gather in flight slows the
# matmul it overlaps; what changes on GPUs, where NCCL has its own stream and its own links?

# %% [markdown]
# ## §4, §7 Memory over the step, measured and predicted
# The same profiles hold every allocation and free on each rank. The curves start at what is live before
# the step (shards and AdamW state); the dashed line is `fsdp_accounting`'s bytes held between steps with
# the gradients, the dotted line that plus the accounting's peak of gathered weights. Activations come on
# top: the prediction does not include them.

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
for rank, ax in enumerate(axes):
    for prefetch, profiles in runs.items():
        memory = profiles[rank]["memory"]
        ax.plot([t for t, _ in memory], [b / 2**20 for _, b in memory], label=f"prefetch={prefetch}", lw=1)
    predicted = runs[1][rank]["predicted"]
    ax.axhline(predicted["with_gradients"] / 2**20, color="k", ls="--", lw=1, label="accounting: state + grads")
    for profiles in runs.values():
        p = profiles[rank]["predicted"]
        ax.axhline((p["with_gradients"] + p["peak_gathered_bytes"]) / 2**20, color="k", ls=":", lw=0.8)
    ax.set(xlabel="ms since the step started", title=f"rank {rank}")
axes[0].set_ylabel("MiB allocated")
axes[0].legend(fontsize=8)
fig.tight_layout()
fig.savefig("fsdp_memory.png", dpi=120)
plt.show()
for prefetch, profiles in runs.items():
    for rank, r in enumerate(profiles):
        peak = max(b for _, b in r["memory"]) / 2**20
        p = r["predicted"]
        print(f"prefetch={prefetch} rank {rank}: measured peak {peak:6.2f} MiB; accounting: state + grads "
              f"{p['with_gradients'] / 2**20:6.2f} MiB, + gathered weights {p['peak_gathered_bytes'] / 2**20:5.2f} MiB")

# %% [markdown]
# Questions. (a) How much higher is the peak at prefetch 2 than at prefetch 0, and how does it compare
# with the accounting's `peak_gathered_bytes`? (b) Where in the step is the peak: forward, backward or the
# optimizer step, and what is allocated then? (c) Rerun with `reshard_after_forward=False`
# (`profile_fsdp_steps((1,), reshard_after_forward=False)`): where does the curve rise, and by how much?
