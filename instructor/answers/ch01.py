"""Numbers for the chapter 01 key (benchmarking): FLOP shares, memory of an xl train step, measured rows."""

from __future__ import annotations

import reference.precision as precision
from instructor import answer_key as answers
from kit import flops, model


def attention_share(preset: str, context: int = 512, batch: int = 4) -> float:
    """Fraction of the model FLOPs (kit.flops, causal) that are attention's q·kᵀ and P·v."""
    c = model.PRESETS[preset]
    total = flops.transformer_flops(c, batch, context, "forward")
    att = c.num_layers * flops.attention_flops(batch * c.num_heads, context, context, c.d_head, causal=True,
                                               mode="forward")
    return att / total


def non_matmul_ops_per_token(preset: str, context: int = 512) -> float:
    """A rough count of the element-wise and reduction operations per token and layer (norms, RoPE, softmax,
    SwiGLU, residual adds: about 30·d + 5·H·T/2 for the causal softmax), for comparison with the matmuls'
    2·12·d² + … FLOPs: a few percent at most."""
    c = model.PRESETS[preset]
    return c.num_layers * (30 * c.d_model + 5 * c.num_heads * context / 2 + 3 * c.d_ff)


def matmul_flops_per_token(preset: str, context: int = 512) -> float:
    return flops.transformer_flops(model.PRESETS[preset], 1, context, "forward") / context


def xl_train_memory_gib(batch: int = 4, context: int = 256) -> dict[str, float]:
    """fp32 xl train step: weights, gradients, AdamW state (2 × fp32), saved activations (Stage 2's estimate)."""
    n = answers.num_params("xl")
    act = precision.activation_memory_estimate("xl", batch, context, "fp32")["total"]
    gib = 2**30
    return {"weights": 4 * n / gib, "gradients": 4 * n / gib, "adam": 8 * n / gib, "activations": act / gib}


def bench_rows(mode: str = "train_step") -> list[dict]:
    return [r for r in answers.results("bench_model")["rows"] if r["mode"] == mode]


def bwd_over_fwd(preset: str, context: int, dtype: str = "fp32") -> float:
    """(forward_backward − forward) / forward from the committed bench_model rows."""
    rows = {r["mode"]: r["mean_ms"] for r in answers.results("bench_model")["rows"]
            if r["preset"] == preset and r["context"] == context and r["dtype"] == dtype}
    return (rows["forward_backward"] - rows["forward"]) / rows["forward"]
