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
# # Stage 7 — the fused LM head and cross-entropy
#
# Companion to `handout/07-fused-loss.md`. It uses your `student/whole_step/fused_cross_entropy.py` (or the
# reference when `LLMSYS_IMPL=reference`) and runs at CPU sizes in well under a minute — the Triton kernels run in
# the interpreter there, so every time below is an interpreter time and says nothing about a GPU.
#
# 1. The logits of the 8B task, on paper (§1).
# 2. The online log-sum-exp, by hand (§2).
# 3. The fused loss equals the naive one (and float64).
# 4. The memory saved: peak bytes of forward + backward, naive against fused, by vocabulary size.

# %%
import importlib
import math

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import kit  # noqa: F401 — first: sets TRITON_INTERPRET on machines without CUDA
from kit.impl import load

impl = load()
fce = importlib.import_module(f"{impl.package}.whole_step.fused_cross_entropy")
device = "cuda" if torch.cuda.is_available() else "cpu"
print(f"implementation: {impl.package}, device: {device}, Triton interpreted: {kit.triton_interpreted()}")

# %% [markdown]
# ## 1. The logits of the 8B task
# Batch 2 × 32,768 tokens and a vocabulary of 151,936 (Qwen's): how big are the logits, and how do they compare
# with the largest activation of a layer (the MLP's `tokens × d_ff`) and with the weights?

# %%
tokens, vocab, d_model, d_ff, layers = 2 * 32_768, 151_936, 4096, 11_008, 34
MB = 1e6
logits = tokens * vocab
params = 2 * vocab * d_model + layers * (4 * d_model**2 + 3 * d_model * d_ff)
rows = [
    ("logits, bf16", 2 * logits),
    ("logits upcast to fp32", 4 * logits),
    ("naive loss, forward peak (bf16 + fp32 copy + fp32 log-softmax)", (2 + 4 + 4) * logits),
    ("naive loss, backward peak (log-softmax + 2 fp32 gradients)", (4 + 4 + 4) * logits),
    ("largest activation of a layer: MLP tokens × d_ff, bf16", 2 * tokens * d_ff),
    ("the residual stream tokens × d, bf16", 2 * tokens * d_model),
    ("all weights, bf16", 2 * params),
    ("fused loss: lse, fp32", 4 * tokens),
]
for name, size in rows:
    print(f"{name:>62}: {size / MB:12,.1f} MB")

# %% [markdown]
# ## 2. The online log-sum-exp
# One row of logits streamed in tiles of 32: keep the running maximum `m` and the running sum `s = Σ exp(z − m)`,
# rescale `s` by `exp(m_old − m_new)` when the maximum grows. After the last tile `m + log s` is the log-sum-exp,
# and the target's logit was met in exactly one tile.

# %%
torch.manual_seed(0)
row = torch.randn(300, dtype=torch.float64) * 4
target = 217
m, s, z_target, history = -math.inf, 0.0, 0.0, []
for start in range(0, row.numel(), 32):
    z = row[start:start + 32]
    m_new = max(m, z.max().item())
    s = s * math.exp(m - m_new) + torch.exp(z - m_new).sum().item()
    m = m_new
    if start <= target < start + 32:
        z_target = z[target - start].item()
    history.append((start, m, m + math.log(s)))
print(f"online lse {m + math.log(s):.12f}  torch.logsumexp {torch.logsumexp(row, 0).item():.12f}")
print(f"loss of this token: lse − z_target = {m + math.log(s) - z_target:.6f}; "
      f"F.cross_entropy: {F.cross_entropy(row[None], torch.tensor([target])).item():.6f}")

# %% [markdown]
# ## 3. Fused against naive
# A ragged problem (37 tokens, V = 101, d = 40, every 5th token ignored): the loss and both gradients, fused and
# naive (`naive_linear_cross_entropy`: full logits, fp32 upcast, `F.cross_entropy`), against float64.

# %%
g = torch.Generator().manual_seed(0)
h = torch.randn(37, 40, generator=g).to(device)
w = (torch.randn(101, 40, generator=g) / 40**0.5).to(device)
t = torch.randint(0, 101, (37,), generator=g).to(device)
t[::5] = -100
results = {}
for name, fn in (("naive", fce.naive_linear_cross_entropy), ("fused", fce.fused_linear_cross_entropy)):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(hh, ww, t)
    loss.backward()
    results[name] = (loss.detach(), hh.grad, ww.grad)
h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
loss64 = F.cross_entropy(h64 @ w64.T, t)
loss64.backward()
for name, (loss, dh, dw) in results.items():
    err_dh = (dh.double() - h64.grad).abs().max().item()
    err_dw = (dw.double() - w64.grad).abs().max().item()
    print(f"{name}: loss {loss.item():.7f} (float64 {loss64.item():.7f}), |ΔdH| {err_dh:.2e}, |ΔdW| {err_dw:.2e}")

# %% [markdown]
# ## 4. The memory saved
# `peak_memory_bytes` runs forward + backward and reports the most bytes alive at once that the step allocated
# (on a CPU it watches every allocation through a dispatch mode; on CUDA it reads the allocator's peak). The naive
# loss holds several `tokens × V` tensors (the logits, their fp32 log-softmax, its gradient); the fused loss holds
# per-token statistics and the fp32 gradient accumulators, `tokens × d` and `V × d`.

# %%
n_tokens, d = 128, 16
sizes = [128, 256, 1024]
memory = {"naive": [], "fused": []}
for vocab_size in sizes:
    g = torch.Generator().manual_seed(1)
    h = torch.randn(n_tokens, d, generator=g).to(device)
    w = (torch.randn(vocab_size, d, generator=g) / d**0.5).to(device)
    t = torch.randint(0, vocab_size, (n_tokens,), generator=g).to(device)
    for name, fn in (("naive", fce.naive_linear_cross_entropy), ("fused", fce.fused_linear_cross_entropy)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        memory[name].append(fce.peak_memory_bytes(lambda fn=fn, hh=hh, ww=ww, t=t: fn(hh, ww, t).backward()))
    print(f"V = {vocab_size:5d}: naive {memory['naive'][-1] / 1024:8.1f} KiB, fused {memory['fused'][-1] / 1024:8.1f} "
          f"KiB; fp32 logits alone {4 * n_tokens * vocab_size / 1024:8.1f} KiB")

fig, ax = plt.subplots(figsize=(6, 4))
for name, marker in (("naive", "o"), ("fused", "s")):
    ax.loglog(sizes, [b / 1024 for b in memory[name]], marker=marker, label=name)
ax.loglog(sizes, [4 * n_tokens * v / 1024 for v in sizes], "k:", label="fp32 logits (tokens × V × 4 B)")
ax.set(xlabel="vocabulary size V", ylabel="peak KiB, forward + backward",
       title=f"{n_tokens} tokens, d = {d}, fp32, {device}")
ax.legend()
fig.tight_layout()
fig.savefig("07_fused_loss_memory.png", dpi=120)
plt.show()

# %% [markdown]
# Both grow linearly in V — with different slopes: the naive loss pays about 12 bytes per token per vocabulary entry
# (three fp32 `tokens × V` tensors alive in the backward), the fused one `4·d` bytes per vocabulary entry for its
# fp32 dW accumulator, whatever the number of tokens (plus `4·d` per token for dH). At the 8B task's 65,536 tokens
# and d = 4096 that is ≈ 120 GB against 2.5 GB for dW and 1.1 GB for dH (§1 and Problem 7.4).
