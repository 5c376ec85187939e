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
# # Stage 7 — the whole step: master weights, the fused optimizer, the gate
#
# Companion to `handout/07b-whole-step.md`. Runs on a CPU in under a minute. It uses your implementation
# (`student`) unless `LLMSYS_IMPL=reference` is set.
#
# 1. Why master weights (§4): bf16 parameters updated in bf16 stop moving; with an fp32 master copy they follow
#    fp32 training.
# 2. `FusedAdamW` against `torch.optim.AdamW`: how close, after many steps.
# 3. The whole step (§5): the loss over 15 steps for the naive step and for your pieces, fp32 and bf16, and the
#    time of a step.
# 4. The leaderboard's gate (§6) on the cpu task: your step against the naive one, in 2 gloo ranks.

# %%
import importlib
import time

import matplotlib.pyplot as plt
import torch

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit import leaderboard
from kit.data import random_batch
from kit.impl import load

impl = load()
fused_adamw = importlib.import_module(f"{impl.package}.whole_step.fused_adamw")
train_step = importlib.import_module(f"{impl.package}.whole_step.train_step")
torch.set_num_threads(1)
print("implementation:", impl.package)

# %% [markdown]
# ## §4 Master weights
# 4096 weights of magnitude [0.5, 1], random gradients, AdamW at lr 1e-3 for 60 steps, three ways: fp32 (the
# reference), bf16 weights updated in bf16 (`torch.optim.AdamW` on bf16 tensors), and bf16 weights with
# `FusedAdamW(master_weights=True)`. Near |p| = 0.5 bf16's spacing is 2⁻⁸ ≈ 0.0039: an update of 0.001 is less
# than half of it and rounds away.

# %%
g = torch.Generator().manual_seed(0)
start = torch.randn(4096, generator=g).sign() * (0.5 + 0.5 * torch.rand(4096, generator=g))
grads = [torch.randn(4096, generator=g) for _ in range(60)]


def train(param, optimizer):
    moved = []
    for grad in grads:
        param.grad = grad.to(param.dtype)
        optimizer.step()
        moved.append((param.detach().double() - start.double()).abs().mean().item())
    return moved


options = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
p32 = start.clone().requires_grad_()
fp32 = train(p32, torch.optim.AdamW([p32], **options))
p16 = start.to(torch.bfloat16).requires_grad_()
bf16_update = train(p16, torch.optim.AdamW([p16], **options))
pm = start.to(torch.bfloat16).requires_grad_()
master = train(pm, fused_adamw.FusedAdamW([pm], **options, master_weights=True))

fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(fp32, label="fp32")
ax.plot(bf16_update, label="bf16, update in bf16")
ax.plot(master, "--", label="bf16, FusedAdamW master weights")
ax.set(xlabel="step", ylabel="mean |p − p₀|", title="How far the weights travel (lr 1e-3, |p| in [0.5, 1])")
ax.legend()
fig.tight_layout()
fig.savefig("07b_master_weights.png", dpi=120)
plt.show()
print(f"after 60 steps: fp32 moved {fp32[-1]:.4f}, bf16-updated {bf16_update[-1]:.4f}, master-weighted "
      f"{master[-1]:.4f} on average")
print(f"largest |bf16 with master − fp32|: {(pm.detach().double() - p32.detach().double()).abs().max().item():.2e} "
      "(bf16 spacing: 0.0039 in [0.5, 1), 0.0078 in [1, 2))")

# %% [markdown]
# ## §4 `FusedAdamW` and `torch.optim.AdamW`
# 50 steps on the parameters of the kit's tiny Transformer, fp32, the same gradients. Written in torch's order,
# the two agree bit for bit; another correct order differs by a few fp32 roundings per step.

# %%
from kit.model import TransformerLM  # noqa: E402

torch.manual_seed(0)
model_a = TransformerLM("tiny")
model_b = TransformerLM("tiny")
model_b.load_state_dict(model_a.state_dict())
opt_a = torch.optim.AdamW(model_a.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
opt_b = fused_adamw.FusedAdamW(model_b.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
g = torch.Generator().manual_seed(1)
for _ in range(50):
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        pa.grad = torch.randn(pa.shape, generator=g)
        pb.grad = pa.grad.clone()
    opt_a.step()
    opt_b.step()
worst = max((pa - pb).abs().max().item() for pa, pb in zip(model_a.parameters(), model_b.parameters()))
print(f"after 50 steps, the largest |FusedAdamW − torch.optim.AdamW| over {len(list(model_a.parameters()))} "
      f"tensors: {worst:.3g}")

# %% [markdown]
# ## §5 The whole step
# 15 steps on the cpu leaderboard task's gate model (d 32, 2 layers, vocabulary 96), 8 sequences of 16 tokens a
# step, one process. The naive step, your pieces in fp32 (PyTorch FlashAttention, FusedAdamW, 2 micro-batches,
# checkpointing), bf16 autocast, and bf16 weights with master weights. The curves should lie on top of each other:
# a correct step is the same training, only faster (or leaner).

# %%
model = leaderboard.TASKS["cpu"].gate_model
data = [random_batch(8, model.context_length, model.vocab_size, seed=100 + s) for s in range(15)]
configs = {
    "naive": {},
    "fp32 pieces": {"attention": "flash_pytorch", "optimizer": "fused_adamw", "micro_batches": 2,
                    "activation_checkpointing": True},
    "bf16 autocast": {"dtype": "bf16_autocast", "optimizer": "fused_adamw"},
    "bf16 weights + master": {"dtype": "bf16", "optimizer": "fused_adamw"},
}
curves, times = {}, {}
for name, choices in configs.items():
    step = train_step.build_train_step(train_step.StepConfig(model=model, lr=3e-3, **choices))
    start_time = time.perf_counter()
    curves[name] = [step(x, y) for x, y in data]
    times[name] = (time.perf_counter() - start_time) / len(data)

fig, ax = plt.subplots(figsize=(7, 4))
for name, losses in curves.items():
    ax.plot(losses, label=f"{name} ({1e3 * times[name]:.0f} ms/step)")
ax.set(xlabel="step", ylabel="loss", title="The same training, four ways")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig("07b_whole_step.png", dpi=120)
plt.show()
for name, losses in curves.items():
    print(f"{name:24s} final loss {losses[-1]:.4f}  (naive {curves['naive'][-1]:.4f})  "
          f"{1e3 * times[name]:.0f} ms/step")

# %% [markdown]
# ## §6 The gate
# What `make leaderboard TASK=cpu` does before it times anything: your step (with your `leaderboard_options`) runs 3
# steps on the task's small instance in 2 gloo ranks and sends back its losses, gradients and parameters; this
# process computes the naive step and compares, with tolerances derived from the dtypes.

# %%
task = leaderboard.TASKS["cpu"]
options = train_step.leaderboard_options("cpu", "cpu")
result = leaderboard.gate(task, options)
print("options:", options)
print("gate passed:", result.passed)
print("tolerances:", result.tolerances["why"])
print("losses:   ", [f"{x:.6f}" for x in result.losses])
print("reference:", [f"{x:.6f}" for x in result.reference_losses])
for failure in result.failures:
    print(" -", failure)
