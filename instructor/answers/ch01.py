"""Numbers for the chapter 01 key (benchmarking): FLOP shares, AdamW's bytes, kernel counts, memory of an xl train
step, the memory timeline and torch.compile rows, measured rows."""

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


# ------------------------------------------------------------------------------------------ AdamW's traffic

# torch.optim.AdamW(foreach=True) (torch._functional._multi_tensor_adamw, not capturable, fp32): one pass over every
# tensor per foreach op, bytes read + written per parameter element (4 bytes each).
FOREACH_ADAMW_PASSES = (
    ("_foreach_mul_(params, 1 − lr·wd)", "p", "p"),
    ("_foreach_lerp_(exp_avgs, grads, 1 − β₁)", "m, g", "m"),
    ("_foreach_mul_(exp_avg_sqs, β₂)", "v", "v"),
    ("_foreach_addcmul_(exp_avg_sqs, grads, grads, 1 − β₂)", "v, g", "v"),
    ("denom = _foreach_sqrt(exp_avg_sqs)", "v", "denom"),
    ("_foreach_div_(denom, √(bias correction₂))", "denom", "denom"),
    ("_foreach_add_(denom, ε)", "denom", "denom"),
    ("_foreach_addcdiv_(params, exp_avgs, denom, −step size)", "p, m, denom", "p"),
)


def adamw_bytes_per_param(kind: str = "foreach") -> int:
    """Bytes AdamW reads and writes per fp32 parameter in one step: ``fused`` (one kernel: read p, g, m, v; write p,
    m, v) or ``foreach`` (the passes of :data:`FOREACH_ADAMW_PASSES`)."""
    if kind == "fused":
        return 4 * (4 + 3)
    return sum(4 * (len(reads.split(", ")) + len(writes.split(", "))) for _, reads, writes in FOREACH_ADAMW_PASSES)


def foreach_adamw_table() -> str:
    lines = ["| pass | reads | writes | bytes per parameter |", "|---|---|---|---|"]
    for op, reads, writes in FOREACH_ADAMW_PASSES:
        lines.append(f"| `{op}` | {reads} | {writes} | {4 * (len(reads.split(', ')) + len(writes.split(', ')))} |")
    lines.append(f"| **total** | | | **{adamw_bytes_per_param('foreach')}** |")
    return "\n".join(lines)


def adamw_ms(preset: str = "small", kind: str = "foreach", device: str = "H100") -> float:
    """AdamW's step at the device's full HBM bandwidth (a lower bound), ms."""
    return adamw_bytes_per_param(kind) * answers.num_params(preset) / flops.memory_bandwidth(device) * 1e3


def fwd_bwd_ms(preset: str = "small", mfu: float = 0.4, context: int = 512, batch: int = 4,
               device: str = "H100", dtype: str = "bf16") -> float:
    """Forward + backward of a train step at a given MFU (kit.flops model FLOPs), ms."""
    work = flops.transformer_flops(model.PRESETS[preset], batch, context, "train_step")
    return work / (mfu * flops.peak_flops(device, dtype)) * 1e3


def adamw_share(preset: str = "small", kind: str = "foreach", mfu: float = 0.4, **kw) -> float:
    """AdamW's share of a train step: its time over (its time + the forward and backward at ``mfu``)."""
    opt = adamw_ms(preset, kind)
    return opt / (opt + fwd_bwd_ms(preset, mfu, **kw))


def measured_optimizer_share(preset: str = "mini", context: int = 128, dtype: str = "fp32") -> float:
    """(train_step − forward_backward) / train_step from the committed bench_model rows (CPU)."""
    rows = {r["mode"]: r["mean_ms"] for r in answers.results("bench_model")["rows"]
            if r["preset"] == preset and r["context"] == context and r["dtype"] == dtype}
    return (rows["train_step"] - rows["forward_backward"]) / rows["train_step"]


# ------------------------------------------------------------------------------------------ kernel invocations

def gemm_launches(preset: str = "small") -> dict[str, int]:
    """Matmul calls per forward and per backward of the kit's Transformer (one GEMM launch each on a GPU): per
    layer q, k, v, output projections (d × d), w1, w3 (d → d_ff) and w2 (d_ff → d), plus the LM head; attention's
    two batched matmuls per layer. The backward needs two per linear (input and weight gradients) and four per
    attention (dV, dP, dQ, dK)."""
    layers = model.PRESETS[preset].num_layers
    return {"d×d projections": 4 * layers, "w1 and w3": 2 * layers, "w2": layers, "LM head": 1,
            "linear, forward": 7 * layers + 1, "attention bmm, forward": 2 * layers,
            "linear, backward": 2 * (7 * layers + 1), "attention bmm, backward": 4 * layers}


# ------------------------------------------------------------------------------------------ memory timeline

def memory_rows() -> list[dict]:
    return answers.results("bench_memory")["rows"]


def memory_row(step: int, phase: str) -> dict:
    return next(r for r in memory_rows() if r["step"] == step and r["phase"] == phase)


def memory_peak(step: int) -> dict:
    """The phase row with the largest total of one step."""
    return max((r for r in memory_rows() if r["step"] == step), key=lambda r: r["total_MiB"])


def memory_psi_mib() -> float:
    """4Ψ in MiB for the model bench_memory profiled."""
    return 4 * memory_rows()[0]["params_M"] * 1e6 / 2**20


def optimizer_temporaries_mib(step: int) -> float:
    """What the optimizer phase's peak holds beyond the parameters (4Ψ), AdamW's state, the gradients and the
    inputs, MiB: torch's per-tensor AdamW temporaries, whatever category the profiler filed them under."""
    r = memory_row(step, "optimizer_step")
    return r["total_MiB"] - memory_psi_mib() - r["optimizer_state_MiB"] - r["gradient_MiB"] - r["input_MiB"]


def largest_tensor_mib() -> float:
    """The profiled model's largest parameter tensors, the LM head and the embedding (vocab × d_model fp32), MiB."""
    cfg = model.get_config(memory_rows()[0]["preset"])
    return cfg.vocab_size * cfg.d_model * 4 / 2**20


def memory_estimate_mib() -> float:
    """Stage 2's saved-activation estimate for bench_memory's configuration (fp32, CPU), MiB."""
    r = memory_rows()[0]
    return precision.activation_memory_estimate(r["preset"], r["batch"], r["context"], "fp32",
                                                device_type="cpu")["total"] / 2**20


# ------------------------------------------------------------------------------------------ torch.compile

def compile_rows() -> list[dict]:
    return answers.results("bench_model_compile")["rows"]


def compile_row(mode: str, compiled: bool) -> dict:
    return next(r for r in compile_rows() if r["mode"] == mode and (r["compile"] != "eager") == compiled)


def compile_break_even(mode: str) -> float:
    """Steps after which the compiled model has paid for its first call: (first compiled call − one eager step)
    / (eager step − compiled step)."""
    eager, comp = compile_row(mode, False), compile_row(mode, True)
    saved_per_step = (eager["median_ms"] - comp["median_ms"]) / 1e3
    return float("inf") if saved_per_step <= 0 else (comp["first_call_s"] - eager["median_ms"] / 1e3) / saved_per_step
