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


def top_items(preset: str = "xl", batch: int = 4, context: int = 1024, n: int = 3) -> list[tuple[str, float]]:
    """The n largest per-layer items of the estimate (bf16, CUDA), in MiB."""
    per = precision.activation_memory_estimate(preset, batch, context, "bf16")["per_layer"]
    return [(k, v / 2**20) for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:n]]


def top_items_table(**kw) -> str:
    return "\n".join(f"* {name}: {mib:,.0f} MiB" for name, mib in top_items(**kw))


def softmax_passes_mlp(preset: str = "xl", batch: int = 4, c: int = 2) -> int:
    """Smallest context (multiple of 16) at which the estimate's attention-softmax item exceeds 4·B·T·d_ff·c."""
    cfg = model.PRESETS[preset]
    for t in range(16, 8193, 16):
        per = precision.activation_memory_estimate(preset, batch, t, "bf16")["per_layer"]
        if per["attention softmax"] > 4 * batch * t * cfg.d_ff * c:
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
    """Binomial checkpointing: the fewest slots c with C(c + t, t) ≥ blocks."""
    c = 0
    while math.comb(c + t, t) < blocks:
        c += 1
    return c


def single_level_slots(blocks: int) -> tuple[int, int]:
    """(best k, slots ⌈L/k⌉ + k) of single-level checkpointing in the slot model."""
    return min(((k, math.ceil(blocks / k) + k) for k in range(1, blocks + 1)), key=lambda kv: kv[1])


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
