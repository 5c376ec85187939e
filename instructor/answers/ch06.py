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


def smallest_model_parallel(num_params: float, stage: int) -> int:
    """The smallest power-of-two tp·pp for which ``devices_needed`` finds a count at this stage."""
    mp = 1
    while accounting.devices_needed(num_params, 80e9, zero_stage=stage, model_parallel=mp) is None:
        mp *= 2
    return mp


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
