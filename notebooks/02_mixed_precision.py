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
# # Stage 2 — mixed precision and activation memory
#
# Companion to `handout/02-mixed-precision.md`. Runs on a CPU in well under a minute: bf16 autocast
# works on CPUs, and autograd's saved-tensor hooks measure activation memory on any device.
# It uses your implementation (`student`) unless `LLMSYS_IMPL=reference` is set.

# %%
import matplotlib.pyplot as plt
import torch

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit.impl import load
from kit.model import TransformerLM, cross_entropy, get_config

impl = load()
P = impl.precision
print("implementation:", impl.package)

# %% [markdown]
# ## §1 Where accumulation loses precision
# Adding 0.01 a thousand times. Which of the four errors comes from the *sum's* dtype, and which from
# rounding 0.01 itself to fp16?

# %%
sums = P.accumulation_experiment()
for key, value in sums.items():
    print(f"{key:>24}: {value:.6f}   error {value - 10:+.2e}")

# %% [markdown]
# ## §2 What autocast does to each tensor
# The handout's ToyModel under bf16 autocast on this machine. On CUDA, `layer_norm` is on autocast's
# fp32 list; on a CPU it runs its bf16 kernel (accumulating in fp32 inside) and returns bf16.

# %%
report = P.autocast_dtype_report(P.ToyModel(), torch.randn(8, 20), torch.bfloat16)
for key, dtype in report.items():
    print(f"{key:>12}: {dtype}")

# %% [markdown]
# ## §3 Dynamic range: fp16 vs bf16

# %%
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    fi = torch.finfo(dtype)
    print(f"{str(dtype):>15}: max {fi.max:.3e}  smallest normal {fi.tiny:.3e}  eps {fi.eps:.3e}")
grads = torch.tensor([1e-3, 1e-5, 1e-7, 1e-9])
print("fp16 gradients:        ", grads.half().tolist())
print("bf16 gradients:        ", grads.bfloat16().tolist())
print("fp16 after scaling 2^16:", (grads * 2**16).half().float().div(2**16).tolist())

# %% [markdown]
# ## §4 The loss scaler at work
# Inject an overflow every 13 steps: the scale halves (and the step is skipped), then grows back after
# `growth_interval` clean steps.

# %%
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
scaler = P.DynamicLossScaler(init_scale=2.0**8, growth_interval=5)
scales = []
for step in range(60):
    opt.zero_grad()
    scaler.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
    if step % 13 == 12:
        model.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    scales.append(scaler.get_scale())
print("scale every 5 steps:", scales[::5])

# %% [markdown]
# ## §6 Saved activations against context length, measured and counted
# The kit's tiny Transformer, batch 2. The analytic count (`activation_memory_estimate`) should sit on
# the measurement (`saved_activation_bytes`). Attention's B·H·T² softmax makes the curve bend upward.

# %%
config = get_config("tiny", context_length=256)
contexts = [16, 32, 64, 128, 256]
B = 2
torch.manual_seed(0)
model = TransformerLM(config)
curves = {}
for dtype, policy in ((torch.float32, "none"), (torch.bfloat16, "none"), (torch.float32, "every_block")):
    P.checkpointed(model, policy)
    measured, counted = [], []
    for T in contexts:
        tokens = torch.randint(0, config.vocab_size, (B, T + 1))

        def fn(tokens=tokens, dtype=dtype):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                logits = model(tokens[:, :-1])
            return cross_entropy(logits, tokens[:, 1:])

        measured.append(P.saved_activation_bytes(fn) / 2**20)
        est = P.activation_memory_estimate(config, B, T, dtype, device_type="cpu", checkpoint_policy=policy)
        counted.append(est["total"] / 2**20)
    curves[f"{str(dtype).removeprefix('torch.')}, checkpoint {policy}"] = (measured, counted)
P.checkpointed(model, "none")

fig, ax = plt.subplots(figsize=(7, 4.5))
for label, (measured, counted) in curves.items():
    line, = ax.plot(contexts, measured, marker="o", label=f"{label}: measured")
    ax.plot(contexts, counted, linestyle="--", color=line.get_color(), label=f"{label}: analytic")
ax.set(xscale="log", yscale="log", xlabel="context length T", ylabel="MiB saved for backward",
       title="tiny Transformer, batch 2: saved activations")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig("02_saved_activations.png", dpi=120)
for label, (measured, counted) in curves.items():
    print(label, [f"{m:.2f}/{c:.2f}" for m, c in zip(measured, counted)])

# %% [markdown]
# ## §6–7 At full size, from the count alone
# The xl preset at context 1024, batch 1, in bf16 on a GPU: per layer, in total, and with checkpointing.

# %%
xl = get_config("xl", context_length=1024)
for policy in ("none", "every_block", 4):
    est = P.activation_memory_estimate(xl, 1, 1024, torch.bfloat16, device_type="cuda", checkpoint_policy=policy)
    print(f"policy {policy!r:>13}: stored {est['total'] / 2**30:6.2f} GiB, "
          f"+ recompute peak {est['recompute_peak'] / 2**30:5.2f} GiB")
per_layer = P.activation_memory_estimate(xl, 1, 1024, torch.bfloat16)["per_layer"]
for item, nbytes in per_layer.items():
    print(f"{item:>18}: {nbytes / 2**20:8.1f} MiB per layer")
