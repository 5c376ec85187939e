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
# # Stage 6, part 2 — context parallelism: ring attention
#
# This notebook shards a sequence in both layouts and plots each rank's causal work, merges two attention
# blocks through their log-sum-exp (and watches the naive merge overflow), then runs ring attention on 4 CPU
# ranks, started by `kit.spawn.run_on_ranks`, and compares it with attention in one process. It runs your
# implementation (`LLMSYS_IMPL`, default `student`). Handout: `handout/06b-context-parallel.md`.

# %%
import math

import matplotlib.pyplot as plt
import torch

import kit  # noqa: F401 — first: sets TRITON_INTERPRET on CPU machines
import kit.impl
from kit.spawn import run_on_ranks

impl = kit.impl.load()
ctx = impl.parallel.context_parallel
api = impl.flash_attention.api
print(impl)

# %% [markdown]
# ## 1. Who holds which tokens (handout 06b §1, §5)
# Contiguous: rank r holds [r·n, (r+1)·n). Zig-zag: 2·cp chunks, rank r holds chunk r and chunk 2·cp−1−r.

# %%
seq, cp = 16, 4
for layout in ctx.LAYOUTS:
    print(f"{layout:>10}:", [ctx.shard_positions(seq, cp, r, layout).tolist() for r in range(cp)])

fig, axes = plt.subplots(1, 2, figsize=(11, 3))
for ax, layout in zip(axes, ctx.LAYOUTS):
    for r in range(cp):
        for p in ctx.shard_positions(seq, cp, r, layout).tolist():
            ax.add_patch(plt.Rectangle((p, 0), 0.95, 0.95, color=plt.cm.tab10(r)))
            ax.text(p + 0.47, 0.47, str(r), ha="center", va="center", color="white")
    ax.set(xlim=(0, seq), ylim=(0, 1), yticks=[], xlabel="global position (colour and label: the rank)",
           title=f"{layout}, s={seq}, cp={cp}")
fig.tight_layout()
fig.savefig("06b_layouts.png", dpi=110)

# %% [markdown]
# A causal row sees the keys at or before it, so the work of a rank is the number of (query, key) pairs
# under the diagonal in its rows. Contiguous gives the last rank about 2·cp − 1 times the first's; zig-zag
# gives every rank the same.

# %%
seq = 1024
fig, axes = plt.subplots(1, 3, figsize=(12, 3.2), sharey=False)
for ax, cp in zip(axes, (2, 4, 8)):
    width = 0.4
    for i, layout in enumerate(ctx.LAYOUTS):
        work = ctx.causal_work(seq, cp, layout)
        ax.bar([r + (i - 0.5) * width for r in range(cp)], work, width, label=layout)
        print(f"cp={cp} {layout:>10}: max/min = {max(work) / min(work):.3f}, total = {sum(work)}"
              f" (s(s+1)/2 = {seq * (seq + 1) // 2})")
    ax.set(xlabel="cp rank", ylabel="(query, key) pairs", title=f"causal work, s={seq}, cp={cp}")
    ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig("06b_causal_work.png", dpi=110)

# %% [markdown]
# ## 2. The log-sum-exp merge on two blocks (handout 06b §2)
# Split the keys into blocks A and B, attend to each with the block interface, and merge:
# `lse = max + log1p(exp(−|lse_A − lse_B|))`, `o = e^{lse_A − lse}·o_A + e^{lse_B − lse}·o_B`, in fp32.
# With scores in the hundreds, the naive `log(e^{lse_A} + e^{lse_B})` is infinite, both weights
# `e^{lse − inf}` are 0, and the output is silently wrong.

# %%
torch.manual_seed(0)
n, d = 64, 32
q, k, v = (torch.randn(1, n, d) for _ in range(3))


def exact(q, k, v):
    """Softmax attention in float64, and each row's log-sum-exp."""
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s, dim=-1) @ v.double(), torch.logsumexp(s, dim=-1)


def merge(o_a, lse_a, o_b, lse_b):
    lse = torch.maximum(lse_a, lse_b) + torch.log1p(torch.exp(-(lse_a - lse_b).abs()))
    o = torch.exp(lse_a - lse)[..., None] * o_a.float() + torch.exp(lse_b - lse)[..., None] * o_b.float()
    return o, lse


def naive_merge(o_a, lse_a, o_b, lse_b):
    lse = torch.log(torch.exp(lse_a) + torch.exp(lse_b))  # no maximum subtracted
    o = torch.exp(lse_a - lse)[..., None] * o_a.float() + torch.exp(lse_b - lse)[..., None] * o_b.float()
    return o, lse


half = n // 2
for scale in (1.0, 100.0):
    qs = q * scale  # large scores: a log-sum-exp far above fp32's exp limit of ≈ 88.7
    o_a, lse_a = api.attention_forward_with_lse(qs, k[:, :half], v[:, :half], False, backend="pytorch")
    o_b, lse_b = api.attention_forward_with_lse(qs, k[:, half:], v[:, half:], False, backend="pytorch")
    o_ref, lse_ref = exact(qs, k, v)
    for name, fn in (("stable merge", merge), ("naive merge ", naive_merge)):
        o, lse = fn(o_a, lse_a, o_b, lse_b)
        err = (o.double() - o_ref).abs().max().item()
        print(f"scale {scale:>5}: {name}: max |o − exact| = {err:.2e}, largest lse {lse_ref.max().item():6.1f}, "
              f"inf in the merged lse: {bool(lse.isinf().any())}")

# %% [markdown]
# ## 3. Ring attention on 4 ranks against one process (handout 06b §3–§5)
# `ring_attention_on_ranks` shards the full q, k, v over the ranks of the spawn, runs `ring_attention` and its
# backward, and gathers the output and the gradients back into sequence order.

# %%
torch.manual_seed(1)
seq, heads, d = 64, 2, 16
q, k, v, grad_out = (torch.randn(1, heads, seq, d) for _ in range(4))


def exact_grads(q, k, v, grad_out, is_causal):
    """Attention and its gradients in float64, in one process."""
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if is_causal:
        s = s.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.softmax(s, dim=-1) @ v64
    o.backward(grad_out.double())
    return {"out": o.detach(), "dq": q64.grad, "dk": k64.grad, "dv": v64.grad}


for is_causal, layout in ((False, "contiguous"), (True, "contiguous"), (True, "zigzag")):
    ref = exact_grads(q, k, v, grad_out, is_causal)
    got = run_on_ranks(ctx.ring_attention_on_ranks, 4, args=(q, k, v),
                       kwargs=dict(is_causal=is_causal, layout=layout, grad_out=grad_out), timeout=120)[0]
    errors = {name: (got[name].double() - ref[name]).abs().max().item() for name in ref}
    print(f"causal={is_causal!s:5} {layout:>10}: " + ", ".join(f"{k} {e:.1e}" for k, e in errors.items()))
