"""Numbers for the chapter 04 key (DDP): bucket sizes from the overhead model, α and β fitted to the results."""

from __future__ import annotations

import math

from instructor import answer_key as answers


def small_grad_bytes() -> int:
    """fp32 gradient bytes of the `small` preset (every parameter trains, the embedding included)."""
    return answers.num_params("small") * 4


def b_star(S: float, alpha: float, beta: float) -> float:
    """The additive model's optimum: d/db (S·α/b + b/β) = 0 → b* = √(S·α·β)."""
    return math.sqrt(S * alpha * beta)


def exposed_additive(S: float, alpha: float, beta: float, b: float) -> float:
    """The additive model's exposed time for buckets of b bytes, as Problem 4.8(a) writes it: (S/b)·α + α + b/β
    (every bucket's latency, plus the last bucket's whole all-reduce)."""
    return S / b * alpha + alpha + b / beta


def b_cross(S: float, alpha: float, beta: float, T: float) -> float:
    """Where the max form's two terms cross: α + b/β = S·α/b + S/β − T, i.e. b²/β + b·(α + T − S/β) − S·α = 0."""
    a, bb, c = 1 / beta, alpha + T - S / beta, -S * alpha
    return (-bb + math.sqrt(bb * bb - 4 * a * c)) / (2 * a)


def b_fit(S: float, alpha: float, beta: float, T: float) -> float:
    """The smallest b whose communication fits in the backward: S·α/b + S/β = T (needs T > S/β)."""
    return S * alpha / (T - S / beta)


def exposed_max(S: float, alpha: float, beta: float, T: float, b: float) -> float:
    """§4's model: max(α + b/β, (S/b)·α + S/β − T)."""
    return max(alpha + b / beta, S / b * alpha + S / beta - T)


def fit_alpha_beta(world_size: int = 2) -> tuple[float, float]:
    """Least-squares α (s) and β (bytes/s, algorithm bandwidth) of time = α + S/β over the committed
    collectives results of one world size."""
    rows = [r for r in answers.results("collectives")["rows"] if r["world_size"] == world_size]
    xs = [r["size_bytes"] for r in rows]
    ys = [r["time_ms"] / 1e3 for r in rows]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, 1 / slope


def ddp_grad_bytes() -> float:
    """The gradient bytes of the model bench_ddp measured (from its committed results)."""
    return answers.results("ddp")["rows"][0]["grad_mib"] * 2**20


def fastest_bucketed() -> dict:
    rows = [r for r in answers.results("ddp")["rows"] if r["method"] == "bucketed"]
    return min(rows, key=lambda r: r["step_ms"])


def fastest_method() -> dict:
    rows = [r for r in answers.results("ddp")["rows"] if r["method"] != "torch DDP"]
    return min(rows, key=lambda r: r["step_ms"])


def describe(row: dict) -> str:
    """``"bucketed, 1 MB buckets"`` or ``"individual"``: a bench_ddp row's method as the key names it."""
    return f"{row['method']}, {row['bucket_mb']:g} MB buckets" if row["bucket_mb"] is not None else row["method"]
