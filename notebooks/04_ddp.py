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
# # Stage 4 — distributed data parallel: seeing the overlap
#
# Companion to `handout/04-ddp.md`. Runs on a CPU in under a minute: two gloo ranks on this machine,
# started by `kit.spawn.run_on_ranks`. It uses your implementation (`student`) unless
# `LLMSYS_IMPL=reference` is set.

# %%
import math

import matplotlib.pyplot as plt
import torch

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit.impl import load
from kit.model import TransformerLM
from kit.spawn import run_on_ranks

impl = load()
print("implementation:", impl.package)

# %% [markdown]
# ## §4 How many buckets does a real model get?
# `assign_buckets` only needs sizes, so a model on the `meta` device (no memory) will do. Buckets go in
# reverse registration order: bucket 0 holds the LM head, the first gradient backward produces.

# %%
with torch.device("meta"):
    small = TransformerLM("small")
params = [p for p in small.parameters() if p.requires_grad]
total_mib = sum(p.numel() * p.element_size() for p in params) / 2**20
print(f"'small': {len(params)} parameter tensors, {total_mib:.0f} MiB of fp32 gradients")
for cap in (1, 10, 25, 100, 1000, None):
    buckets = impl.ddp.assign_buckets(params, cap)
    sizes = [sum(params[i].numel() * 4 for i in b) / 2**20 for b in buckets]
    print(f"cap {str(cap):>5} MiB: {len(buckets):3d} buckets, largest {max(sizes):6.1f} MiB, first {sizes[0]:6.1f} MiB")

# %% [markdown]
# ## §3–§4 A timeline of one step: individual vs bucketed
# `impl.ddp_profile.profile_ddp_step` profiles one training step on each rank with torch.profiler and
# returns spans: the phases, each backward autograd function (compute) and each all-reduce from launch
# to completion (communication, on gloo's own threads). Rank 0's spans are drawn below.

# %%
runs = {
    "DDPIndividualParameters": ("individual", None),
    "DDPBucketed (0.5 MiB)": ("bucketed", 0.5),
}
timelines = {}
for title, (kind, cap) in runs.items():
    timelines[title] = run_on_ranks(impl.ddp_profile.profile_ddp_step, 2, args=(kind, cap), timeout=120)[0]

lanes = ["phase", "compute", "comm"]
colors = {"forward": "#8c8c8c", "backward": "#4c72b0", "finish_gradient_synchronization": "#c44e52"}
fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 2.2 * len(timelines)))
for ax, (title, spans) in zip(axes, timelines.items()):
    comm_rows: list[float] = []  # stack overlapping all-reduces into sub-rows
    for lane, name, start, end in spans:
        if lane == "comm":
            row = next((i for i, last_end in enumerate(comm_rows) if last_end <= start), len(comm_rows))
            comm_rows[row:row + 1] = [end]
            y = 2 + 0.25 * row
            ax.broken_barh([(start, end - start)], (y, 0.22), color="#dd8452")
        else:
            y = lanes.index(lane)
            ax.broken_barh([(start, end - start)], (y, 0.8), color=colors.get(name, "#55a868"))
    exposed = sum(e - s for lane, n, s, e in spans if n == "finish_gradient_synchronization")
    ax.set_yticks([0.4, 1.4, 2.4], ["phases", "backward compute", "all-reduces"])
    ax.set_title(f"{title}: {sum(1 for s in spans if s[0] == 'comm')} all-reduces, "
                 f"{exposed:.1f} ms waiting after backward", fontsize=9)
for ax in axes:
    ax.set_xlabel("ms since the step started (rank 0)")
fig.tight_layout()
fig.savefig("ddp_timeline.png", dpi=120)
plt.show()

# %% [markdown]
# Questions. (a) Where does the first all-reduce start relative to the backward phase, for each class?
# (b) Count the all-reduces: how many messages does each class send, and what does each cost in fixed
# latency? (c) On this 2-core machine the gloo threads compete with the backward pass for the cores,
# so overlap is partial; what would change on GPUs, where NCCL runs on its own stream?

# %% [markdown]
# ## §4 The overhead model: latency vs overlap
# Gradients of `S` bytes appear evenly over a backward pass of `T` seconds. With buckets of `b` bytes
# there are `n = ⌈S/b⌉` all-reduces, each costing `α + b/β` (latency plus size over bandwidth); bucket
# `k` is ready at `(k+1)·T/n` and starts when it is ready *and* the previous one has finished. What is
# left after backward ends is the exposed communication.

# %%
def exposed_comm(S: float, b: float, T: float, alpha: float, beta: float) -> float:
    n = math.ceil(S / b)
    end = 0.0
    for k in range(n):
        size = min(b, S - k * b)
        end = max(end, (k + 1) * T / n) + alpha + size / beta
    return max(end - T, 0.0)


S, T = 1e9, 0.1  # 1 GB of gradients (250M fp32 parameters), 100 ms of backward
caps = [2**i * 1e6 for i in range(-2, 11)]
fig, ax = plt.subplots(figsize=(6, 3.5))
for alpha, beta in ((100e-6, 20e9), (20e-6, 20e9), (100e-6, 5e9)):
    ax.plot([c / 1e6 for c in caps], [1e3 * exposed_comm(S, c, T, alpha, beta) for c in caps], marker="o",
            label=f"α = {alpha * 1e6:g} µs, β = {beta / 1e9:g} GB/s")
ax.set(xscale="log", yscale="log", xlabel="bucket size (MB)", ylabel="exposed communication (ms)",
       title="Too small: latency adds up; too large: nothing overlaps")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig("ddp_bucket_model.png", dpi=120)
plt.show()
for alpha, beta in ((100e-6, 20e9), (20e-6, 20e9)):
    best = min(caps, key=lambda c: exposed_comm(S, c, T, alpha, beta))
    print(f"α = {alpha * 1e6:g} µs, β = {beta / 1e9:g} GB/s: best bucket {best / 1e6:g} MB, "
          f"exposed {1e3 * exposed_comm(S, best, T, alpha, beta):.2f} ms")
# %% [markdown]
# Questions. (d) Why does the third curve never reach zero? (e) Estimate α and β for gloo on this machine
# from `python -m benchmarks.bench_collectives` and find the best bucket size for the benchmark's model.
