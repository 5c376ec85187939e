# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 1 — Benchmarking and profiling
#
# This notebook uses your `student/benchmarking.py` (or the reference when `LLMSYS_IMPL=reference`).
# It runs at CPU sizes in well under a minute; on a GPU, raise `PRESET` and `CONTEXTS`.
#
# 1. Why warm-up matters: the first calls are slow.
# 2. How step time grows with context length, per mode.
# 3. Where the time goes, from torch.profiler.

# %%
import matplotlib.pyplot as plt
import torch

import kit  # noqa: F401 — sets TRITON_INTERPRET on machines without CUDA
from kit.impl import load
from kit.model import TransformerLM, get_config

impl = load()
bench = impl.benchmarking
device = "cuda" if torch.cuda.is_available() else "cpu"
PRESET = "small" if device == "cuda" else "tiny"
CONTEXTS = [128, 256, 512, 1024] if device == "cuda" else [16, 32, 64]
print(f"implementation: {impl.package}, device: {device}, preset: {PRESET}")

# %% [markdown]
# ## 1. The first calls are slow
# Time each call separately, with no warm-up, and look at the first few samples.

# %%
torch.manual_seed(0)
model = TransformerLM(get_config(PRESET, context_length=max(CONTEXTS))).to(device)
result = bench.benchmark_model(PRESET, context_length=CONTEXTS[-1], batch_size=2, mode="forward_backward",
                               warmup=0, iters=12, device=device, model=model)
samples_ms = [1e3 * s for s in result["timing"].samples]
print("per-call ms:", [f"{s:.1f}" for s in samples_ms])
print(f"first call / median of the rest: {samples_ms[0] / sorted(samples_ms[1:])[len(samples_ms[1:]) // 2]:.2f}×")

# %% [markdown]
# ## 2. Step time against context length

# %%
rows = []
for mode in ("forward", "forward_backward", "train_step"):
    for context in CONTEXTS:
        r = bench.benchmark_model(PRESET, context_length=context, batch_size=2, mode=mode, warmup=2, iters=3,
                                  device=device)
        rows.append((mode, context, 1e3 * r["timing"].mean, 1e3 * r["timing"].std))

fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
axes[0].plot(range(len(samples_ms)), samples_ms, marker="o")
axes[0].set(xlabel="call number", ylabel="ms", title="No warm-up: the first calls")
for mode in ("forward", "forward_backward", "train_step"):
    pts = [(c, m, s) for md, c, m, s in rows if md == mode]
    axes[1].errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", label=mode)
axes[1].set(xlabel="context length", ylabel="ms per step", title=f"{PRESET} on {device}")
axes[1].legend()
fig.tight_layout()
fig.savefig("01_benchmarking.png", dpi=100)

# %% [markdown]
# Backward costs about twice the forward (it computes gradients for both the activations and the weights),
# so `forward_backward` should sit near 3× `forward` once the sizes are large enough for the matmuls to dominate.
#
# ## 3. Where the time goes

# %%
x = torch.randint(0, model.config.vocab_size, (2, CONTEXTS[-1]), device=device)
top = bench.profile_step(lambda: model(x), row_limit=8, trace_path="01_forward_trace.json")
for row in top:
    print(f"{row['name']:<40} {row['calls']:>5} calls {row['self_time_us'] / 1e3:>8.2f} ms self")
# Open 01_forward_trace.json in https://ui.perfetto.dev to see the timeline.

# %% [markdown]
# ## 4. The memory of a train step over time (handout 01 §6, Problem 1.10)
# torch.profiler with `profile_memory=True` classifies every byte alive: parameters, optimizer state,
# gradients, activations. Two AdamW steps: the first creates the optimizer's state in its optimizer phase.

# %%
from kit import memory_timeline
from kit.model import cross_entropy

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
tokens = torch.randint(0, model.config.vocab_size, (2, CONTEXTS[-1] + 1), device=device)
step = memory_timeline.train_step_fn(model, optimizer, (tokens[:, :-1], tokens[:, 1:]), cross_entropy)


def two_steps():
    step()
    step()


timeline = memory_timeline.record(two_steps, device=device)
fig, ax = plt.subplots(figsize=(9, 3.5))
memory_timeline.plot(timeline, ax, title=f"{PRESET}: two AdamW train steps")
fig.tight_layout()
fig.savefig("01_memory_timeline.png", dpi=100)
for peak in timeline.phase_peaks():
    print(f"step {peak['range'] // 3 + 1} {peak['phase']:<15} peak {peak['total'] / 2**20:6.2f} MiB "
          f"(activations {peak['activation'] / 2**20:.2f}, gradients {peak['gradient'] / 2**20:.2f}, "
          f"optimizer state {peak['optimizer_state'] / 2**20:.2f})")
