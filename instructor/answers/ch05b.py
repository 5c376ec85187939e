"""Numbers for the chapter 05b key (FSDP): thresholds from kit.flops peaks, the TP × FSDP split, activations."""

from __future__ import annotations

import math

import reference.parallel.accounting as accounting
from kit import flops

NVLINK = 450e9  # bytes/s per direction per GPU (H100 SXM, NVLink 4)
IB = 50e9  # 400 Gb/s InfiniBand per GPU


def F() -> float:
    """H100 SXM dense bf16 peak (kit.flops)."""
    return flops.peak_flops("H100", "bf16")


def fwd_threshold(beta: float, c: int = 2, peak: float | None = None) -> float:
    """Tokens per rank below which the forward is communication-bound (large N): c·F/(2β)."""
    return c * (peak or F()) / (2 * beta)


def bwd_threshold(beta: float, c: int = 2, g: int = 4, reshard: bool = True, peak: float | None = None) -> float:
    """Backward: (c + g)·F/(4β) with resharding, g·F/(4β) without."""
    return ((c if reshard else 0) + g) * (peak or F()) / (4 * beta)


def sequences(tokens: float, seq: int = 4096) -> int:
    return math.ceil(tokens / seq)


def overlap_split(d: int = 8192, b: int = 4096, c: int = 2, beta_t: float = NVLINK, beta_f: float = IB):
    """Problem 5.20 with the two links concurrent: minimise max(T_fsdp, T_tp). T_fsdp falls and T_tp rises with t,
    so the minimum is where they are equal: 36·d²·c/(t·β_f) = 8·(t − 1)·b·d·c/β_t, i.e. t(t − 1) = 4.5·d·β_t/(b·β_f).
    Returns (t_eq, max at t = 8, max at t = 16, max at the integer t nearest t_eq)."""
    k = 4.5 * d * beta_t / (b * beta_f)
    t_eq = (1 + math.sqrt(1 + 4 * k)) / 2
    t_fsdp = lambda t: 36 * d * d * c / (t * beta_f)  # noqa: E731
    t_tp = lambda t: 8 * (t - 1) * b * d * c / beta_t  # noqa: E731
    worst = lambda t: max(t_fsdp(t), t_tp(t))  # noqa: E731
    return t_eq, worst(8), worst(16), worst(round(t_eq))


def split(d: int = 8192, b: int = 4096, c: int = 2, beta_t: float = NVLINK, beta_f: float = IB):
    """Problem 5.20: (t*, T_fsdp(8), T_tp(8), T_fsdp(1), compute per layer at peak, T_fsdp(9) + T_tp(9)) in
    seconds, t* minimising the sum."""
    t_star = math.sqrt(4.5 * d * beta_t / (b * beta_f))
    t_fsdp = lambda t: 36 * d * d * c / (t * beta_f)  # noqa: E731
    t_tp = lambda t: 8 * (t - 1) * b * d * c / beta_t  # noqa: E731
    return t_star, t_fsdp(8), t_tp(8), t_fsdp(1), 72 * b * d * d / F(), t_fsdp(9) + t_tp(9)


def llama7b_activations_gb(seq: int = 4096, micro_batch: int = 1, flash: bool = False) -> tuple[float, float]:
    """(per layer, 32 layers) GB of activations of a Llama-2-7B-shaped model with sequence parallelism off,
    tp = 1 (Korthikanti: s·b·h·(34 + 5·a·s/h)), from Stage 6's activation_bytes_per_layer. With ``flash`` the
    5·a·s/h term — the attention scores, softmax and its dropout mask, which FlashAttention (Stage 3) never
    stores — is left out: s·b·h·34."""
    per_layer = accounting.activation_bytes_per_layer(seq, micro_batch, 4096, 32)
    if flash:
        per_layer -= 5 * 32 * seq * seq * micro_batch  # s·b·h · 5·a·s/h = 5·a·s²·b
    return per_layer / 1e9, 32 * per_layer / 1e9


def row(impl: str) -> dict:
    """One implementation's row of the committed bench_fsdp results."""
    from instructor import answer_key as answers

    return next(r for r in answers.results("bench_fsdp")["rows"] if r["impl"] == impl)


def fsdp_ratios() -> tuple[float, float]:
    """The range of vs_fully_shard over the kit's FSDP rows."""
    from instructor import answer_key as answers

    values = [r["vs_fully_shard"] for r in answers.results("bench_fsdp")["rows"] if r["vs_fully_shard"] is not None]
    return min(values), max(values)
