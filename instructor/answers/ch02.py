"""Numbers for the chapter 02 key (mixed precision, activations, checkpointing)."""

from __future__ import annotations

import math

import torch

import reference.precision as precision
from instructor import answer_key as answers
from kit import model


def finfo(dtype: str) -> torch.finfo:
    return torch.finfo(getattr(torch, dtype))


def smallest_subnormal(dtype: str) -> float:
    """2^(min_exp − mantissa bits): fp16 5.96e-8, bf16 9.2e-41."""
    f = finfo(dtype)
    return f.tiny * f.eps


def residual_mib(preset: str = "xl", batch: int = 4, context: int = 1024) -> float:
    c = model.PRESETS[preset]
    return batch * context * c.d_model * 4 / 2**20


def top_items(preset: str = "xl", batch: int = 4, context: int = 1024, n: int = 3,
              dtype: str = "bf16") -> list[tuple[str, float]]:
    """The n largest per-layer items of the estimate (CUDA; bf16 autocast or fp32), in MiB."""
    per = precision.activation_memory_estimate(preset, batch, context, dtype)["per_layer"]
    return [(k, v / 2**20) for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:n]]


def top_items_table(**kw) -> str:
    return "\n".join(f"* {name}: {mib:,.0f} MiB" for name, mib in top_items(**kw))


def softmax_passes_mlp(preset: str = "xl", batch: int = 4, dtype: str = "bf16") -> int:
    """Smallest context (multiple of 16) at which the estimate's attention-softmax item exceeds its MLP item
    (4·B·T·d_ff·c: the SwiGLU's saved intermediates, c bytes each)."""
    for t in range(16, 8193, 16):
        per = precision.activation_memory_estimate(preset, batch, t, dtype)["per_layer"]
        if per["attention softmax"] > per["mlp"]:
            return t
    raise ValueError("no crossing below 8192")


def a_over_s(preset: str, context: int = 1024, batch: int = 4, dtype: str = "bf16") -> float:
    """One block's saved bytes A over its fp32 input s = B·T·d·4 (the estimate's layer_total)."""
    e = precision.activation_memory_estimate(preset, batch, context, dtype)
    return e["layer_total"] / (batch * context * model.PRESETS[preset].d_model * 4)


def k_star(preset: str, context: int = 1024) -> float:
    """Continuous optimum of L/k·s + k·A: k* = √(L·s/A)."""
    return math.sqrt(model.PRESETS[preset].num_layers / a_over_s(preset, context))


def fewest_slots(blocks: int, t: int) -> int:
    """Binomial checkpointing with block 1's input free (revolve's convention): the fewest extra slots c with
    C(c + t, t) ≥ blocks."""
    c = 0
    while math.comb(c + t, t) < blocks:
        c += 1
    return c


def reversible_blocks(slots: int, t: int) -> int:
    """The longest chain reversible with ``slots`` slots (the chain's input counted) and each block run forward at
    most ``t`` times: C(slots + t − 1, t) (revolve's C(s + t, t) with s = slots − 1 besides the input)."""
    return math.comb(slots + t - 1, t)


def fewest_slots_counted(blocks: int, t: int) -> int:
    """The fewest slots, block 1's input counted (the handout's rule), that reverse ``blocks`` with ``t`` runs."""
    c = 1
    while reversible_blocks(c, t) < blocks:
        c += 1
    return c


def single_level_slots(blocks: int, input_free: bool = False) -> tuple[int, int]:
    """(best k, slots) of single-level checkpointing with equal segments of k: ⌈L/k⌉ checkpoints, and while the
    last segment is recomputed its k − 1 other inputs (its first is a checkpoint): ⌈L/k⌉ + k − 1, one less when
    block 1's input is free. Ties go to the smallest k."""
    return min(((k, math.ceil(blocks / k) + k - 1 - int(input_free)) for k in range(1, blocks + 1)),
               key=lambda kv: (kv[1], kv[0]))


def ckpt_rows() -> list[dict]:
    return answers.results("checkpoint")["rows"]


def ckpt_best() -> dict:
    return min((r for r in ckpt_rows() if r["k"]), key=lambda r: r["peak_saved_MiB"])


def ckpt_row(k: int) -> dict:
    return next(r for r in ckpt_rows() if r["k"] == k)


def ckpt_config() -> tuple[str, int, int]:
    r = ckpt_rows()[0]
    return r["preset"], r["context"], r["batch"]


def ckpt_a_s() -> tuple[float, float]:
    """A and s in MiB for the benchmark's configuration, from the estimate (fp32, CPU)."""
    preset, context, batch = ckpt_config()
    e = precision.activation_memory_estimate(preset, batch, context, "fp32", device_type="cpu")
    s = batch * context * model.PRESETS[preset].d_model * 4
    return e["layer_total"] / 2**20, s / 2**20


def ckpt_predicted_k() -> int:
    preset = ckpt_config()[0]
    layers = model.PRESETS[preset].num_layers
    a, s = ckpt_a_s()
    return min(range(1, layers + 1), key=lambda k: math.ceil(layers / k) * s + k * a)


def precision_row(preset: str, context: int, dtype: str) -> dict:
    return next(r for r in answers.results("precision")["rows"]
                if r["preset"] == preset and r["context"] == context and r["dtype"] == dtype)


def spare_blocks(position: str = "middle") -> float:
    """Problem 2.12.3: how many blocks a budget of twice the k = 1 peak leaves un-checkpointed, from the committed
    rows (a₁ saved after the forward and A recomputed at k = 1, s = one block input). An un-checkpointed block keeps
    A instead of s. In the middle of the chain its activations are alive while later blocks are recomputed:
    a₁ + n(A − s) + A ≤ 2·p₁. As the last blocks, their backward runs first, before any recomputation:
    a₁ + n(A − s) ≤ 2·p₁. Returns the bound on n (not rounded)."""
    one = ckpt_row(1)
    preset, context, batch = ckpt_config()
    s = batch * context * model.PRESETS[preset].d_model * 4 / 2**20
    a1, big_a, p1 = one["after_forward_MiB"], one["recompute_MiB"], one["peak_saved_MiB"]
    extra = 0.0 if position == "last" else big_a
    return (2 * p1 - a1 - extra) / (big_a - s)


def precision_ratio(preset: str, context: int) -> float:
    """bf16's saved bytes over fp32's in the committed precision rows."""
    return precision_row(preset, context, "bf16")["saved_MiB"] / precision_row(preset, context, "fp32")["saved_MiB"]


def precision_configs() -> list[tuple[str, int]]:
    return sorted({(r["preset"], r["context"]) for r in answers.results("precision")["rows"]},
                  key=lambda pc: (model.PRESETS[pc[0]].d_model, pc[1]))


def precision_ratio_table() -> str:
    lines = ["| preset | context | fp32 saved MiB | bf16 saved MiB | bf16 / fp32 | bf16 weight copies MiB | "
             "bf16 linear inputs MiB (per layer) | fp32 linear inputs MiB (per layer) |",
             "|---|---|---|---|---|---|---|---|"]
    for preset, context in precision_configs():
        batch = precision_row(preset, context, "fp32")["batch"]
        e16 = precision.activation_memory_estimate(preset, batch, context, "bf16", device_type="cpu")
        e32 = precision.activation_memory_estimate(preset, batch, context, "fp32", device_type="cpu")
        lines.append(f"| {preset} | {context} | {precision_row(preset, context, 'fp32')['saved_MiB']:.2f} | "
                     f"{precision_row(preset, context, 'bf16')['saved_MiB']:.2f} | "
                     f"{precision_ratio(preset, context):.2f} | "
                     f"{e16['weight_copies'] / 2**20:.2f} | {e16['per_layer']['linear inputs'] / 2**20:.3f} | "
                     f"{e32['per_layer']['linear inputs'] / 2**20:.3f} |")
    return "\n".join(lines)


def accumulation() -> dict[str, float]:
    """The reference's accumulation_experiment(0.01, 1000)."""
    return precision.accumulation_experiment(0.01, 1000)


def fp16(x: float) -> float:
    """x rounded to fp16."""
    return torch.tensor(x, dtype=torch.float16).item()
