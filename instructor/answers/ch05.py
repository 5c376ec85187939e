"""Numbers for the chapter 05 key (ZeRO): model-state tables from zero_memory_accounting, ownership balance."""

from __future__ import annotations

import reference.zero as zero
from instructor import answer_key as answers

MIXED = dict(param_bytes=2, grad_bytes=2, optimizer_bytes_per_param=12)
FP32 = dict(param_bytes=4, grad_bytes=4, optimizer_bytes_per_param=8)


def state_gb(num_params: int, n: int, stage: int, **dtypes) -> float:
    return zero.zero_memory_accounting(num_params, n, stage, **(dtypes or MIXED)).total_bytes / 1e9


def stage_table(presets=("xl", "2.7B", "10B"), sizes=(1, 8, 64), budget_gb: float = 60.0) -> str:
    """Model-state GB per GPU, mixed-precision Adam, stages 0–3; ✓ where it fits in ``budget_gb``."""
    lines = ["| preset | Ψ | N | stage 0 | stage 1 | stage 2 | stage 3 |", "|---|---|---|---|---|---|---|"]
    for p in presets:
        psi = answers.num_params(p)
        for n in sizes:
            cells = []
            for s in range(4):
                g = state_gb(psi, n, s)
                cells.append(f"{g:.1f}{' ✓' if g <= budget_gb else ''}")
            lines.append(f"| {p} | {psi / 1e9:.2f} B | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def megatron_bytes_per_param(n: int, stage: int) -> float:
    """bf16 params, fp32 gradients, 12 bytes of fp32 optimizer state: bytes per parameter per GPU."""
    psi = 10**9 * n
    m = zero.zero_memory_accounting(psi, n, stage, param_bytes=2, grad_bytes=4, optimizer_bytes_per_param=12)
    return m.total_bytes / psi


def comm(num_params: int, n: int, stage: int, **dtypes) -> int:
    return zero.zero_memory_accounting(num_params, n, stage, **(dtypes or MIXED)).comm_bytes_per_step


def llama_like_sizes(vocab: int = 128_256, d: int = 4096, d_ff: int = 14_336, layers: int = 32,
                     tied: bool = False) -> list[int]:
    """Parameter tensor sizes of a Llama-3-8B-shaped model in the kit's layout (no GQA: full-width k, v)."""
    per_layer = [d * d] * 4 + [d * d_ff] * 3 + [d, d]
    return [vocab * d] * (1 if tied else 2) + per_layer * layers + [d]


def imbalance(n: int = 8, tied: bool = False, **shape) -> tuple[int, int, float]:
    """(largest rank's elements, Ψ/N, ratio) under the greedy whole-parameter ownership of partition_by_size."""
    sizes = llama_like_sizes(tied=tied, **shape)
    _, loads = zero.partition_by_size(sizes, n)
    ideal = sum(sizes) / n
    return max(loads), int(ideal), max(loads) / ideal


SMALL_BODY = dict(d=2048, d_ff=8192, layers=16)  # a Llama-3.2-1B-shaped body with the same 128 k vocabulary


def fits_summary(presets=("xl", "2.7B", "10B"), sizes=(1, 8, 64), budget_gb: float = 60.0) -> str:
    """One line per preset: the (N, stage) pairs that fit in ``budget_gb``."""
    out = []
    for p in presets:
        psi = answers.num_params(p)
        ok = [f"N = {n}: stage ≥ {s}" for n in sizes
              for s in [next((s for s in range(4) if state_gb(psi, n, s) <= budget_gb), None)] if s is not None]
        out.append(f"`{p}`: " + ("; ".join(ok) if ok else "nowhere in this table"))
    return "; ".join(out) + "."
