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


def params_8b(embedding: bool = True) -> int:
    """The 8 B task's parameters (``embedding=False``: without the token embedding, kit.flops's N)."""
    m = model_8b()
    total = sum(p.numel() for p in m.parameters())
    return total if embedding else total - m.token_embeddings.weight.numel()


def tensors_8b() -> int:
    return len(list(model_8b().parameters()))


# PyTorch's multi-tensor apply (aten/src/ATen/native/cuda/MultiTensorApply.cuh): a launch covers at most
# MTA_MAX_BLOCKS blocks of MTA_CHUNK elements (4 KB of kernel arguments; 2,240 blocks with the 32 KB arguments of
# CUDA ≥ 12.1 and a driver that allows them) and MTA_MAX_TENSORS[depth − 1] tensors (4 KB: 110, 64, 48, 36, 30 for
# 1 … 5 tensor lists; ×7 with 32 KB).
MTA_CHUNK = 65_536
MTA_MAX_BLOCKS = {"4 KB": 320, "32 KB": 2_240}
MTA_MAX_TENSORS = {"4 KB": (110, 64, 48, 36, 30), "32 KB": (770, 448, 336, 252, 210)}


def foreach_launches(args: str = "4 KB", depth: int = 1) -> int:
    """Kernel launches of one ``_foreach`` operation over the 8 B model's parameters on CUDA: multi_tensor_apply's
    loop, which launches when the blocks or the tensors of a launch are full, and once more for what is left."""
    max_blocks, max_tensors = MTA_MAX_BLOCKS[args], MTA_MAX_TENSORS[args][depth - 1]
    launches = blocks = tensors = 0
    for p in model_8b().parameters():
        tensors += 1
        chunks = -(-p.numel() // MTA_CHUNK)
        for chunk in range(chunks):
            blocks += 1
            last = chunk == chunks - 1
            if blocks == max_blocks or (tensors == max_tensors and last):
                launches, blocks = launches + 1, 0
                tensors = 0 if last else 1
    return launches + (blocks > 0)


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


def step_seconds(mfu: float = 0.4, gpus: int = 2, peak: float = 2.25e15, embedding: bool = False) -> float:
    """The 8 B step at ``mfu`` of ``gpus`` × ``peak`` in the kit's FLOP convention; ``embedding=True`` counts the
    embedding's parameters in N too (the wrong answer the key names)."""
    task = TASKS["gpu2-8b"]
    total = flops.transformer_flops(task.model, task.batch, task.model.context_length, "train_step",
                                    num_params=params_8b(embedding=embedding))
    return total / (gpus * peak * mfu)


def step_row(config: str) -> dict:
    """A row of the committed ``bench_step`` table (one process, one thread)."""
    return next(r for r in answers.results("bench_step")["rows"] if r["config"] == config)


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
