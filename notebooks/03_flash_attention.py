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
# # Stage 3 — FlashAttention-2
#
# This notebook uses your `student/flash_attention/` (or the reference when `LLMSYS_IMPL=reference`).
# It runs at CPU sizes in well under a minute — the Triton kernels run in the interpreter there.
#
# 1. The online softmax, by hand (handout §1).
# 2. Both implementations against naive attention.
# 3. Which tiles a causal kernel computes, masks and skips (§4).
# 4. The roofline of §7, and the benchmark's results.

# %%
import math

import matplotlib.pyplot as plt
import numpy as np
import torch

import kit  # noqa: F401 — first: sets TRITON_INTERPRET on machines without CUDA
from kit.flops import memory_bandwidth, peak_flops
from kit.impl import load
from kit.model import naive_attention
from kit.results import RESULTS_DIR

impl = load()
fa = impl.flash_attention
device = "cuda" if torch.cuda.is_available() else "cpu"
print(f"implementation: {impl.package}, device: {device}, Triton interpreted: {kit.triton_interpreted()}")

# %% [markdown]
# ## 1. The online softmax
# Stream a row of scores in blocks, keeping the running maximum `m`, the running sum `l` and the running
# output `acc`; rescale by `exp(m_old − m_new)` whenever the maximum grows. The result equals the
# softmax-weighted sum computed in one go.

# %%
torch.manual_seed(0)
scores = torch.randn(200, dtype=torch.float64) * 3
values = torch.randn(200, 4, dtype=torch.float64)
m, l, acc = -math.inf, 0.0, torch.zeros(4, dtype=torch.float64)
history = []
for start in range(0, 200, 32):
    s, v = scores[start:start + 32], values[start:start + 32]
    m_new = max(m, s.max().item())
    alpha = math.exp(m - m_new)
    p = torch.exp(s - m_new)
    l, acc, m = alpha * l + p.sum().item(), alpha * acc + p @ v, m_new
    history.append(m)
exact = torch.softmax(scores, 0) @ values
print("online :", (acc / l).numpy().round(6))
print("exact  :", exact.numpy().round(6))
print("log-sum-exp: online", round(m + math.log(l), 10), " exact", round(torch.logsumexp(scores, 0).item(), 10))
print("running maximum after each block:", [round(x, 3) for x in history])

# %% [markdown]
# ## 2. Both implementations against naive attention
# Odd lengths, Nq ≠ Nk, causal: the maximum absolute difference to float64 for each dtype, next to the
# error of naive attention run in the same dtype (the tests allow twice that).

# %%
def max_err(fn, q, k, v, causal):
    exact = naive_attention(q.double(), k.double(), v.double(), causal)
    return (fn(q, k, v, causal).double() - exact).abs().max().item()


rows = []
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    q = torch.randn(2, 97, 32, device=device).to(dtype)
    k, v = (torch.randn(2, 131, 32, device=device).to(dtype) for _ in range(2))
    rows.append((str(dtype).split(".")[-1],
                 max_err(naive_attention, q, k, v, True),
                 max_err(lambda *a: fa.flash_attention(*a, backend="pytorch"), q, k, v, True),
                 max_err(lambda *a: fa.flash_attention(*a, backend="triton"), q, k, v, True)))
print(f"{'dtype':>9} {'naive':>10} {'pytorch':>10} {'triton':>10}")
for name, *errs in rows:
    print(f"{name:>9} " + " ".join(f"{e:10.2e}" for e in errs))

# %% [markdown]
# ## 3. Tiles: computed, masked, skipped
# For a causal kernel with query tiles of `BLOCK_M` rows and key tiles of `BLOCK_N` columns, colour each
# (query tile, key tile) pair: fully visible (no mask), on the diagonal (element mask), or skipped (every
# score is masked, so the tile contributes exactly zero and is never loaded).

# %%
def tile_kinds(nq, nk, block_m, block_n):
    kinds = np.zeros((math.ceil(nq / block_m), math.ceil(nk / block_n)))
    for i in range(kinds.shape[0]):
        m0, m1 = i * block_m, min((i + 1) * block_m, nq) - 1
        for j in range(kinds.shape[1]):
            n0, n1 = j * block_n, min((j + 1) * block_n, nk) - 1
            kinds[i, j] = 2 if n1 <= m0 else (0 if n0 > m1 else 1)
    return kinds


fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
for ax, (nq, nk, bm, bn) in zip(axes, [(1024, 1024, 128, 64), (640, 1024, 64, 32)]):
    kinds = tile_kinds(nq, nk, bm, bn)
    ax.imshow(kinds, cmap=plt.matplotlib.colors.ListedColormap(["#eeeeee", "#f4a261", "#2a9d8f"]), vmin=0, vmax=2)
    ax.set(title=f"Nq={nq}, Nk={nk}, BLOCK_M={bm}, BLOCK_N={bn}\n"
                 f"computed {int((kinds > 0).sum())} of {kinds.size} tiles, masked {int((kinds == 1).sum())}",
           xlabel="key tile", ylabel="query tile (one program each)")
handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ["#2a9d8f", "#f4a261", "#eeeeee"]]
fig.legend(handles, ["full (no mask)", "diagonal (masked)", "skipped"], loc="lower center", ncol=3)
fig.tight_layout(rect=(0, 0.08, 1, 1))
fig.savefig("03_causal_tiles.png", dpi=120)
plt.show()

# %% [markdown]
# ## 4. The roofline, and the benchmark
# Arithmetic intensity (FLOP per byte of HBM traffic) of naive attention is about D/2 and that of a
# FlashAttention forward about BLOCK_M (handout §7). Against an H100's 989 TFLOP/s bf16 and 3.35 TB/s,
# the ridge point sits at ≈ 295 FLOP/byte.

# %%
peak, bandwidth = peak_flops("H100", "bf16"), memory_bandwidth("H100")  # kit/flops.py: 989e12, 3.35e12
intensity = np.logspace(0, 3.5, 200)
fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
ax = axes[0]
ax.plot(intensity, np.minimum(peak, bandwidth * intensity) / 1e12, color="black", label="H100 SXM roofline (bf16)")
for (label, x), marker in zip([("naive, D=64", 64 / 2), ("naive, D=128", 128 / 2), ("flash, BLOCK_M=64", 64),
                               ("flash, BLOCK_M=128", 128)], ["o", "s", "x", "^"]):
    bound = min(peak, bandwidth * x) / 1e12
    ax.scatter([x], [bound], zorder=3, s=60, marker=marker, label=f"{label}: ≤ {bound:.0f} TFLOP/s")
ax.set(xscale="log", yscale="log", xlabel="FLOP / byte of HBM traffic", ylabel="attainable TFLOP/s",
       title="H100 roofline, HBM traffic only (L2 reuse lifts flash)")
ax.legend(fontsize=8)

ax = axes[1]
csv = RESULTS_DIR / "bench_attention.csv"
if csv.exists():
    import csv as csvlib

    lines = [line for line in csv.read_text().splitlines() if not line.startswith("#")]
    table = list(csvlib.DictReader(lines))
    stamp = next((line[2:] for line in csv.read_text().splitlines() if line.startswith("# device")), "")
    grid = [r for r in table if r["config"] == "grid" and r["mode"] == "forward_backward" and r["ms"]]
    d_plot = max(int(r["d_head"]) for r in grid) if grid else 0
    dtype_plot = "bf16" if any(r["dtype"] == "bf16" for r in grid) else "fp32"
    for provider in sorted({r["provider"] for r in grid}):
        pts = sorted((int(r["seq"]), float(r["ms"])) for r in grid
                     if r["provider"] == provider and int(r["d_head"]) == d_plot and r["dtype"] == dtype_plot)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=provider)
    ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="ms, forward+backward",
           title=f"benchmarks/results ({stamp}), D={d_plot}, {dtype_plot}")
    ax.legend(fontsize=8)
else:
    ax.text(0.5, 0.5, "run python -m benchmarks.bench_attention\nto fill this panel", ha="center", va="center")
fig.tight_layout()
fig.savefig("03_roofline_and_benchmark.png", dpi=120)
plt.show()

# %% [markdown]
# On a CPU the Triton kernels above ran in the interpreter, so their times say nothing about a GPU:
# measure GPU figures on a GPU (`python -m benchmarks.bench_attention` there runs the full grid and the
# goal rows; `--goals` runs only the goal rows).
