"""Numbers for the chapter 06 key (4D parallelism): device counts, compute-bound thresholds, splits, rings."""

from __future__ import annotations

import math

import reference.parallel.accounting as accounting
from instructor import answer_key as answers
from kit import flops


def h100_bf16() -> float:
    """The H100 SXM's dense bf16 peak, from kit.flops."""
    return flops.peak_flops("H100", "bf16")


def devices(num_params: float, stage: int, model_parallel: int = 1) -> str:
    """``devices_needed`` as the key prints it: a count, or "impossible"."""
    n = accounting.devices_needed(num_params, 80e9, zero_stage=stage, model_parallel=model_parallel)
    return "impossible" if n is None else str(n)


def smallest_model_parallel(num_params: float, stage: int, power_of_two: bool = False) -> int:
    """The smallest tp·pp (any integer, or a power of two) for which ``devices_needed`` finds a count."""
    mp = 1
    while accounting.devices_needed(num_params, 80e9, zero_stage=stage, model_parallel=mp) is None:
        mp = mp * 2 if power_of_two else mp + 1
    return mp


def tp_divides(mp: int, preset: str = "10B") -> bool:
    """Whether tp = ``mp`` splits the preset's heads and d_ff evenly (pp = 1)."""
    from kit import model

    c = model.PRESETS[preset]
    return c.num_heads % mp == 0 and c.d_ff % mp == 0


def per_device_gb(num_params: float, model_parallel: int) -> float:
    """Stage 0's 16Ψ bytes per device with the model split ``model_parallel`` ways, GB."""
    return 16 * num_params / model_parallel / 1e9


def p10b() -> int:
    return answers.num_params("10B")


def bound(fsdp: int, d_ff: int = 28672, peak: float | None = None) -> dict[str, float]:
    """``fsdp_tp_compute_bound`` with Problem 6.8's cluster (50 GB/s IB per GPU, 450 GB/s NVLink)."""
    return accounting.fsdp_tp_compute_bound(peak_flops=peak or h100_bf16(), fsdp_bandwidth=50e9,
                                            tp_bandwidth=450e9, d_ff=d_ff, fsdp=fsdp)


def tp_split(d: int = 8192, b: int = 4096, beta_t: float = 450e9, beta_f: float = 50e9, c: int = 2):
    """Problem 6.10: T_fsdp(Y) = 36·d²·c/(Y·β_f), T_tp(Y) = 8·(Y−1)·b·d·c/β_t per layer and step.
    Returns (Y*, {Y: (T_fsdp, T_tp, sum)}) for Y = 1, 2, 4, 8, 9, 16."""
    y_star = math.sqrt(36 * d * d * c * beta_t / (8 * b * d * c * beta_f))

    def times(y: int) -> tuple[float, float, float]:
        f = 36 * d * d * c / (y * beta_f)
        t = 8 * (y - 1) * b * d * c / beta_t
        return f, t, f + t

    return y_star, {y: times(y) for y in (1, 2, 4, 8, 9, 16)}


def split_table(**kw) -> str:
    _, rows = tp_split(**kw)
    lines = ["| Y | FSDP ms | TP ms | sum ms |", "|---|---|---|---|"]
    lines += [f"| {y} | {f * 1e3:.1f} | {t * 1e3:.1f} | {s * 1e3:.1f} |" for y, (f, t, s) in rows.items()]
    return "\n".join(lines)


def ring_time(S: float, n: int, alpha: float, beta: float) -> float:
    """Ring all-reduce: 2(N−1) steps of S/N bytes."""
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * S / beta


def tree_time(S: float, n: int, alpha: float, beta: float) -> float:
    """Binary tree, reduce then broadcast, not pipelined: 2·log2(N) steps of S bytes."""
    return 2 * math.log2(n) * (alpha + S / beta)


def rabenseifner_time(S: float, n: int, alpha: float, beta: float) -> float:
    """Recursive halving (reduce-scatter) then recursive doubling (all-gather): 2·log2(N)·α + 2(N−1)/N·S/β."""
    return 2 * math.log2(n) * alpha + 2 * (n - 1) / n * S / beta


def tree_crossover(n: int, alpha: float, beta: float) -> float:
    """The message size below which the binary tree beats the ring."""
    lat = (2 * (n - 1) - 2 * math.log2(n)) * alpha
    per_byte = (2 * math.log2(n) - 2 * (n - 1) / n) / beta
    return lat / per_byte


def split_with_compute(b: int, y: int = 8, d: int = 8192, mfu: float = 0.5, c: int = 2, beta_t: float = 450e9,
                       beta_f: float = 50e9) -> dict[str, float]:
    """Problem 6.10(c): per layer and step, seconds: FSDP and TP communication (Problem 5.20's formulas), their
    max, and the compute 72·b·d² at ``mfu`` of the H100's bf16 peak."""
    fsdp = 36 * d * d * c / (y * beta_f)
    tp = 8 * (y - 1) * b * d * c / beta_t
    return {"fsdp": fsdp, "tp": tp, "max": max(fsdp, tp), "sum": fsdp + tp,
            "compute": 72 * b * d * d / (mfu * h100_bf16())}


def best_y(b: int, form: str = "sum", d: int = 8192, beta_t: float = 450e9, beta_f: float = 50e9) -> float:
    """Problem 6.10(a): the continuous Y minimising the sum (√k) or the max (t(t − 1) = k), k = 4.5·d·β_t/(b·β_f)."""
    k = 4.5 * d * beta_t / (b * beta_f)
    return math.sqrt(k) if form == "sum" else (1 + math.sqrt(1 + 4 * k)) / 2


def tp_mlp(n: int = 4096, d: int = 8192, f_mult: int = 4, t: int = 8, c: int = 2, beta: float = 450e9,
           mfu: float = 0.5) -> dict[str, float]:
    """Problem 6.13: per rank and layer of Z = σ(X A) B under t-way TP. FLOPs forward 2·(2·n·d·f/t), backward twice
    that; one all-reduce of n·d·c bytes in each direction, ring time 2(t − 1)/t·S/β; compute at ``mfu``."""
    f = f_mult * d
    fwd = 2 * 2 * n * d * f / t
    size = n * d * c
    ar = 2 * (t - 1) / t * size / beta
    peak = h100_bf16() * mfu
    return {"fwd_flops": fwd, "bwd_flops": 2 * fwd, "allreduce_bytes": size, "allreduce_s": ar,
            "fwd_s": fwd / peak, "bwd_s": 2 * fwd / peak, "share": 2 * ar / (3 * fwd / peak),
            # Sequence parallelism: a reduce-scatter or an all-gather of S bytes sends (t − 1)/t·S per rank.
            "half_s": (t - 1) / t * size / beta, "t": t}
