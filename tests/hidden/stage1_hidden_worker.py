"""Stage 1 hidden checks — the worker half: calls into the implementation, data back."""

from __future__ import annotations

import kit.impl


def time_fn_one_iteration() -> dict:
    ticks = iter([0.0, 0.25])
    stats = kit.impl.load().benchmarking.time_fn(lambda: None, warmup=0, iters=1, sync=lambda: None,
                                                 clock=lambda: next(ticks))
    return {"mean": stats.mean, "std": stats.std, "median": stats.median, "min": stats.min}


def attention(q, k, v, is_causal: bool):
    return kit.impl.load().benchmarking.annotated_scaled_dot_product_attention(q, k, v, is_causal=is_causal)
