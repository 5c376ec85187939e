"""Numbers for the chapter 07b key (the fused AdamW, the whole step, the leaderboard, the 8 B task): bytes an
optimizer step moves, the 8 B model's parameters, model states, activations and logits, a step-time estimate, and
the committed leaderboard baselines."""

from __future__ import annotations

import json

import torch

import reference.precision as precision
from instructor import answer_key as answers
from kit import flops
from kit.leaderboard import TASKS
from kit.model import TransformerLM

# The eight foreach operations of AdamW (handout 07b §4) and the fp32 bytes each reads and writes per parameter.
FOREACH_OPS = [
    ("_foreach_mul_(p, 1 − lr·λ)", 4, 4),
    ("_foreach_lerp_(m, g, 1 − β₁)", 8, 4),
    ("_foreach_mul_(v, β₂)", 4, 4),
    ("_foreach_addcmul_(v, g, g, 1 − β₂)", 8, 4),
    ("d = _foreach_sqrt(v)", 4, 4),
    ("_foreach_div_(d, √(1 − β₂ᵗ))", 4, 4),
    ("_foreach_add_(d, ε)", 4, 4),
    ("_foreach_addcdiv_(p, m, d, −lr/(1 − β₁ᵗ))", 12, 4),
]


def foreach_bytes() -> int:
    """Bytes per fp32 parameter through memory for the eight foreach operations."""
    return sum(r + w for _, r, w in FOREACH_OPS)


def foreach_table() -> str:
    lines = ["| operation | reads | writes |", "|---|---|---|"]
    lines += [f"| `{op}` | {r} | {w} |" for op, r, w in FOREACH_OPS]
    lines.append(f"| **total** | {sum(r for _, r, _ in FOREACH_OPS)} | {sum(w for _, _, w in FOREACH_OPS)} |")
    return "\n".join(lines)


def fused_bytes(master: bool = False) -> int:
    """One fused kernel: read p, g, m, v and write p, m, v (fp32); with master weights read the bf16 gradient and
    the fp32 master, m, v, and write the master, m, v and the bf16 weight."""
    if master:
        return (2 + 4 + 4 + 4) + (4 + 4 + 4 + 2)
    return 4 * 4 + 3 * 4


def model_8b() -> TransformerLM:
    with torch.device("meta"):
        return TransformerLM(TASKS["gpu2-8b"].model)


def params_8b() -> int:
    return sum(p.numel() for p in model_8b().parameters())


def tensors_8b() -> int:
    return len(list(model_8b().parameters()))


def optimizer_ms(bytes_per_param: int, bandwidth: float = 3.35e12) -> float:
    """The least time an optimizer step over the 8 B model takes at ``bandwidth`` bytes/s (H100: 3.35 TB/s)."""
    return params_8b() * bytes_per_param / bandwidth * 1e3


def states_gb(per_gpu_bytes_per_param: float) -> float:
    return params_8b() * per_gpu_bytes_per_param / 1e9


STATE_PLANS = {"data parallel": 16.0, "ZeRO-1 (2 GPUs)": 2 + 2 + 12 / 2, "FSDP (2 GPUs)": 16 / 2}


def states_table() -> str:
    lines = ["| plan | bytes per parameter per GPU | GB per GPU |", "|---|---|---|"]
    lines += [f"| {k} | {v:g} | {states_gb(v):.0f} |" for k, v in STATE_PLANS.items()]
    return "\n".join(lines)


def activations(policy: str) -> dict:
    """handout 02's estimate for one 32,768-token sequence of the 8 B model in bf16 autocast."""
    return precision.activation_memory_estimate(TASKS["gpu2-8b"].model, 1, 32_768, "bf16", checkpoint_policy=policy)


def attention_terms_gb() -> float:
    """Per layer: the softmax probabilities and the causal mask, what FlashAttention never stores."""
    per_layer = activations("none")["per_layer"]
    return (per_layer["attention softmax"] + per_layer["causal mask"]) / 1e9


def flash_layer_gb() -> float:
    """A block's saved activations without the attention matrix (what remains with FlashAttention)."""
    return activations("none")["layer_total"] / 1e9 - attention_terms_gb()


def logits_gb(dtype_bytes: int) -> float:
    model = TASKS["gpu2-8b"].model
    return 32_768 * model.vocab_size * dtype_bytes / 1e9


def step_seconds(mfu: float = 0.4, gpus: int = 2, peak: float = 2.25e15) -> float:
    task = TASKS["gpu2-8b"]
    total = flops.transformer_flops(task.model, task.batch, task.model.context_length, "train_step")
    return total / (gpus * peak * mfu)


def baseline(name: str) -> dict:
    """A committed leaderboard baseline entry (``benchmarks/results/leaderboard/<name>.json``)."""
    path = answers.ROOT / "benchmarks" / "results" / "leaderboard" / f"{name}.json"
    if not path.exists():
        raise answers.AnswerKeyError(f"the key reads {path.relative_to(answers.ROOT)}, which does not exist")
    return json.loads(path.read_text())


def baseline_line(name: str) -> str:
    e = baseline(name)
    t = e["timing"]
    return (f"{e['name']} ({', '.join(f'{k}={v}' for k, v in sorted(e['options'].items())) or 'naive'}): median "
            f"{t['median_s'] * 1e3:.0f} ms per step (IQR {t['iqr_s'] * 1e3:.0f} ms, {t['steps']} steps), "
            f"{t['tokens_per_s']:.0f} tokens/s, wall {e['wall_s']:.0f} s; measured on {e['environment']['device']}, "
            f"load {e['environment']['load']}, {e['environment']['date']}")
