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
# # Stage 5 — ZeRO-1: where the bytes go
#
# Companion to `handout/05-zero.md`. Runs on a CPU in under a minute: up to four gloo ranks on this
# machine, started by `kit.spawn.run_on_ranks`. It uses your implementation (`student`) unless
# `LLMSYS_IMPL=reference` is set.
#
# 1. The accounting: bytes per device for a 7.5 B-parameter model at each ZeRO stage, against the
#    number of data-parallel ranks (the paper's Table 1, as curves).
# 2. The measurement: a small Transformer trained one step with your `ShardedOptimizer` over 1, 2, 3
#    and 4 ranks; the optimizer state each rank really holds, next to the prediction.

# %%
import matplotlib.pyplot as plt

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit.impl import load
from kit.spawn import run_on_ranks

impl = load()
account = impl.zero.zero_memory_accounting
print("implementation:", impl.package)

# %% [markdown]
# ## §5 The accounting: 7.5 B parameters, mixed-precision Adam
# fp16 parameters and gradients (2 + 2 bytes) and fp32 master weights, momentum and variance (12 bytes):
# 16 Ψ bytes per device without ZeRO. Stage 1 shards the 12 Ψ, stage 2 the gradients too, stage 3
# everything. Only stage 3 keeps shrinking as N grows; stages 1 and 2 flatten at 4 Ψ and 2 Ψ.

# %%
psi = 7_500_000_000
world_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
mixed_adam = {"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes_per_param": 12}
fig, ax = plt.subplots(figsize=(7, 4))
for stage in range(4):
    gb = [account(psi, n, stage, **mixed_adam).total_bytes / 1e9 for n in world_sizes]
    ax.plot(world_sizes, gb, marker="o", label=f"stage {stage}" + (" (plain DP)" if stage == 0 else ""))
ax.axhline(80, color="gray", linestyle=":", label="one 80 GB GPU")
ax.set(xscale="log", yscale="log", xlabel="data-parallel ranks N", ylabel="model states per device (GB)",
       title="7.5 B parameters, mixed-precision Adam")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig("05_zero_accounting.png", dpi=120)
plt.show()

for n in (1, 4, 64, 1024):
    row = [account(psi, n, s, **mixed_adam) for s in range(4)]
    print(f"N={n:5d}: " + "  ".join(f"stage {s}: {m.total_bytes / 1e9:7.2f} GB" for s, m in enumerate(row))
          + f"   comm/step (stage 1): {row[1].comm_bytes_per_step / 1e9:.1f} GB")

# %% [markdown]
# ## §3 The measurement: per-rank memory against world size
# One 4-rank spawn; inside it, `ShardedOptimizer(..., process_group=...)` over the first N ranks for
# N = 1 … 4 (the other ranks wait). Each member trains one step on the same batch and reports its
# optimizer-state bytes (`exp_avg`, `exp_avg_sq`, `step`) and its parameters + gradients + state.
# fp32 Adam: 4 + 4 bytes per parameter for weights and gradients, 8 for the state.

# %%
config = {"vocab_size": 2048, "context_length": 32, "d_model": 128, "d_ff": 512, "num_layers": 4,
          "num_heads": 4}
group_sizes = [1, 2, 3, 4]
# Each rank runs the given `zero.state_bytes_by_group_size`, which drives your ShardedOptimizer.
per_rank = run_on_ranks(impl.zero.state_bytes_by_group_size, 4, args=(config, group_sizes), timeout=300,
                        backend="gloo")
rows = [row for rank_rows in per_rank for row in rank_rows]
params = rows[0]["params"]
fp32_adam = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes_per_param": 8}
print(f"{params / 1e6:.2f} M parameters")

measured_state = {n: [r["state_bytes"] / 2**20 for r in rows if r["world_size"] == n] for n in group_sizes}
measured_model = {n: max(r["model_bytes"] for r in rows if r["world_size"] == n) / 2**20 for n in group_sizes}
predicted = {n: account(params, n, 1, **fp32_adam) for n in group_sizes}
for n in group_sizes:
    print(f"N={n}: state per rank {[f'{s:.2f}' for s in measured_state[n]]} MiB, predicted "
          f"{predicted[n].optimizer_bytes / 2**20:.2f} MiB; largest rank's params+grads+state "
          f"{measured_model[n]:.2f} MiB, predicted {predicted[n].total_bytes / 2**20:.2f} MiB")

# %%
fig, (ax_state, ax_total) = plt.subplots(1, 2, figsize=(11, 4))
for n in group_sizes:
    ax_state.scatter([n] * len(measured_state[n]), measured_state[n], color="#dd8452",
                     label="measured, each rank" if n == 1 else None, zorder=3)
ax_state.plot(group_sizes, [predicted[n].optimizer_bytes / 2**20 for n in group_sizes], color="black",
              linestyle="--", label="predicted 8Ψ/N")
ax_state.set(xlabel="ranks N", ylabel="optimizer state (MiB)", title="optimizer state per rank")
ax_total.plot(group_sizes, [measured_model[n] for n in group_sizes], marker="o", color="#dd8452",
              label="measured (largest rank)")
ax_total.plot(group_sizes, [predicted[n].total_bytes / 2**20 for n in group_sizes], color="black",
              linestyle="--", label="predicted 4Ψ + 4Ψ + 8Ψ/N")
ax_total.plot(group_sizes, [account(params, n, 0, **fp32_adam).total_bytes / 2**20 for n in group_sizes],
              color="#4c72b0", linestyle=":", label="no ZeRO, 16Ψ")
ax_total.set(xlabel="ranks N", ylabel="MiB", title="parameters + gradients + optimizer state per rank",
             ylim=(0, None))
for ax in (ax_state, ax_total):
    ax.set_xticks(group_sizes)
    ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig("05_zero_measured.png", dpi=120)
plt.show()

# %% [markdown]
# The state falls as 1/N, but the total does not: parameters and gradients (8 Ψ here) are still
# replicated, so ZeRO-1 alone can never save more than the state's share. The measured points sit a
# hair above the line: Adam's `step` counters (4 bytes per tensor) and the imbalance of whole-parameter
# ownership — no rank can hold less than its largest parameter. Questions: handout 05 §5.
