"""Numbers for the chapter 06b key (context parallelism): bytes per ring step, overlap thresholds, memory per rank,
the causal imbalance.

The model is handout 06b §7's Llama-3-8B-shaped one (``MODEL``); the H100's peak comes from ``kit.flops`` and the
link bandwidths from chapter 05b's key (the same NVLink and InfiniBand figures as Problems 5.19 and 6.9), so the keys
cannot drift apart. Every formula below is the handout's; the tests in ``tests/kit/test_answers.py`` recompute each
printed figure independently.
"""

from __future__ import annotations

import importlib.util
from fractions import Fraction
from pathlib import Path
from types import ModuleType

import reference.parallel.accounting as accounting
from kit import flops

#: Handout 06b §7: d_model, layers, query heads, key/value heads (GQA), head dim, sequence, micro-batch, cp, bytes.
MODEL = dict(h=4096, layers=32, heads=32, kv_heads=8, d_head=128, seq=131_072, b=1, cp=8, c=2)
GRAD_BYTES = 4  # the dK/dV accumulators travel in fp32 (handout 06b §4)
BWD_FLOPS_RATIO = Fraction(10, 4)  # backward 10·n²·d per head (S, dV, dP, dQ, dK: five matmuls) vs forward 4·n²·d


def _ch05b() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_answer_key_ch05b_links", Path(__file__).with_name("ch05b.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_LINKS = _ch05b()
NVLINK: float = _LINKS.NVLINK  # bytes/s per direction per GPU
IB: float = _LINKS.IB  # 400 Gb/s InfiniBand per GPU


def h100_bf16() -> float:
    """The H100 SXM's dense bf16 peak, from kit.flops."""
    return flops.peak_flops("H100", "bf16")


def local_len(seq: int | None = None, cp: int | None = None) -> int:
    """n = s/cp: the tokens each rank holds."""
    return (seq or MODEL["seq"]) // (cp or MODEL["cp"])


def kv_block_bytes(n: int | None = None, c: int | None = None) -> int:
    """One K/V block on the ring: 2·n·H_kv·d_head·c bytes (K and V of n tokens)."""
    n = local_len() if n is None else n
    return 2 * n * MODEL["kv_heads"] * MODEL["d_head"] * (c or MODEL["c"])


# ------------------------------------------------------------------------------------------------ Problem 6.20

def comm_bytes(seq: int | None = None, cp: int | None = None) -> dict[str, dict[str, float]]:
    """Bytes one rank sends in one layer's attention, ``{"ring" | "allgather" | "ulysses": {"fwd", "bwd"}}``.

    ring: cp − 1 hops of a K/V block forward; backward the K/V blocks hop cp − 1 times again and the fp32 dK/dV
    accumulators cp times (the last hop takes them home). all-gather: a ring all-gather of K/V sends the same
    (cp − 1) blocks; its backward gathers K/V again and reduce-scatters dK/dV in fp32, (cp − 1) blocks' worth.
    Ulysses: an all-to-all sends (cp − 1)/cp of this rank's n·(H + 2·H_kv)·d·c bytes of q, k, v and (cp − 1)/cp of
    its n·H·d·c output; the backward runs the same exchanges on dO and dq, dk, dv (bf16).
    """
    seq, cp = seq or MODEL["seq"], cp or MODEL["cp"]
    n, d, c, hq, hkv = local_len(seq, cp), MODEL["d_head"], MODEL["c"], MODEL["heads"], MODEL["kv_heads"]
    kv, dkv = kv_block_bytes(n), kv_block_bytes(n, GRAD_BYTES)
    alltoall = (cp - 1) / cp * n * d * c * (2 * hq + 2 * hkv)
    return {"ring": {"fwd": (cp - 1) * kv, "bwd": (cp - 1) * kv + cp * dkv},
            "allgather": {"fwd": (cp - 1) * kv, "bwd": (cp - 1) * kv + (cp - 1) * dkv},
            "ulysses": {"fwd": alltoall, "bwd": alltoall}}


def comm_mb(scheme: str, direction: str, cp: int | None = None) -> float:
    """``comm_bytes`` of one layer in MB (10⁶)."""
    return comm_bytes(cp=cp)[scheme][direction] / 1e6


def comm_table() -> str:
    """Problem 6.20's table: MB per rank per layer for cp = 2, 4, 8 and each scheme, forward and backward."""
    lines = ["| cp | ring fwd | ring bwd | all-gather fwd | all-gather bwd | Ulysses fwd | Ulysses bwd |",
             "|---|---|---|---|---|---|---|"]
    for cp in (2, 4, 8):
        b = comm_bytes(cp=cp)
        cells = [f"{b[s][d] / 1e6:.0f}" for s in ("ring", "allgather", "ulysses") for d in ("fwd", "bwd")]
        lines.append(f"| {cp} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ Problem 6.21

def min_block(link: float, *, causal: bool = False, backward: bool = False, peak: float | None = None) -> float:
    """The smallest local block n for which one ring step's compute covers its transfer (handout 06b §3).

    forward: 4·n²·d·H / F ≥ 2·n·d·H_kv·c / W ⇔ n ≥ (H_kv/H)·c·F/(2·W). Causal (zig-zag: half a block per step)
    doubles it. Backward: 10·n²·d·H FLOPs against K/V (c) plus fp32 dK/dV (4) bytes: n ≥ (H_kv/H)·(c + 4)·F/(5·W).
    """
    f = peak or h100_bf16()
    ratio = MODEL["kv_heads"] / MODEL["heads"]
    if backward:
        n = ratio * (MODEL["c"] + GRAD_BYTES) * f / (2 * float(BWD_FLOPS_RATIO) * link)
    else:
        n = ratio * MODEL["c"] * f / (2 * link)
    return 2 * n if causal else n


def step_times(link: float, *, causal: bool = True, seq: int | None = None, cp: int | None = None
               ) -> dict[str, float]:
    """One forward ring step at the model's size, seconds: compute at peak (half a block if causal) and transfer."""
    n = local_len(seq, cp)
    compute = 4 * n * n * MODEL["d_head"] * MODEL["heads"] / h100_bf16()
    return {"compute": compute / 2 if causal else compute, "comm": kv_block_bytes(n) / link}


def largest_hidden_cp(link: float, *, backward: bool = False, power_of_two: bool = False) -> int:
    """The largest cp at s = 131,072 whose causal ring steps stay hidden (n = s/cp ≥ the threshold)."""
    bound = min_block(link, causal=True, backward=backward)
    cp = 1
    while (local_len(cp=(cp * 2 if power_of_two else cp + 1))) >= bound:
        cp = cp * 2 if power_of_two else cp + 1
    return cp


# ------------------------------------------------------------------------------------------------ Problem 6.22

def activation_gb(seq: int, cp: int = 1, *, flash: bool = True) -> float:
    """Activation GB per rank for the 32 layers: handout 06 §6.2's s·b·h·(34 + 5·a·s/h) at s/cp tokens
    (Stage 6's ``activation_bytes_per_layer``), with FlashAttention's 5·a·s²·b scores replaced by its fp32 LSE,
    4·a·s·b. Without FlashAttention a rank's scores are its n queries against all s keys: 5·a·n·s·b."""
    h, a, b, n = MODEL["h"], MODEL["heads"], MODEL["b"], seq // cp
    per_layer = accounting.activation_bytes_per_layer(n, b, h, a, sequence_parallel=True) - 5 * a * n * n * b
    per_layer += 4 * a * n * b if flash else 5 * a * n * seq * b
    return MODEL["layers"] * per_layer / 1e9


SEQS = (8192, 32_768, 131_072, 1_048_576)
CPS = (1, 2, 4, 8)


def memory_table() -> str:
    lines = ["| s | " + " | ".join(f"cp = {cp}" for cp in CPS) + " |", "|---|" + "---|" * len(CPS)]
    for s in SEQS:
        lines.append(f"| {s:,} | " + " | ".join(f"{activation_gb(s, cp):.1f}" for cp in CPS) + " |")
    return "\n".join(lines)


def crossing(limit_gb: float = 80, cp: int = 1) -> int:
    """The longest sequence (tokens) whose activations per rank stay within ``limit_gb``, FlashAttention."""
    per_token = activation_gb(2**20, cp) / 2**20  # linear in s
    return int(limit_gb / per_token)


def ring_buffer_gb(seq: int | None = None, cp: int | None = None) -> float:
    """What the ring holds beyond the activations in one layer: two K/V blocks (the current one and the incoming)."""
    return 2 * kv_block_bytes(local_len(seq, cp)) / 1e9


def allgather_buffer_gb(seq: int | None = None) -> float:
    """What all-gathering K/V holds in one layer: K and V of the whole sequence."""
    return kv_block_bytes(seq or MODEL["seq"]) / 1e9


def scores_gb(seq: int | None = None, cp: int = 1) -> float:
    """The scores FlashAttention never stores, per layer and rank: 5·a·n·s·b bytes (n = s/cp queries, s keys)."""
    s = seq or MODEL["seq"]
    return 5 * MODEL["heads"] * (s // cp) * s * MODEL["b"] / 1e9


# ------------------------------------------------------------------------------------------------ Problem 6.23

def work(seq: int, cp: int, layout: str) -> list[int]:
    """Per-rank causal work from the reference's ``causal_work``."""
    import reference.parallel.context_parallel as context_parallel

    return context_parallel.causal_work(seq, cp, layout)


def imbalance(cp: int, layout: str, seq: int | None = None) -> float:
    """max/min of the causal work per rank."""
    w = work(seq or MODEL["seq"], cp, layout)
    return max(w) / min(w)


def ring_time_blocks(cp: int, layout: str, seq: int | None = None) -> float:
    """A causal forward's time in block-times (one block = n² pairs): at each step the slowest rank's pairs.

    contiguous: the diagonal step n(n+1)/2, then cp − 1 steps in which some rank computes a full block (n²).
    zigzag: the diagonal step 2c² + c (two causal chunks and one full pair, c = n/2), then cp − 1 steps of 2c².
    """
    n = local_len(seq, cp)
    if layout == "contiguous":
        pairs = n * (n + 1) // 2 + (cp - 1) * n * n
    else:
        c = n // 2
        pairs = 2 * c * c + c + (cp - 1) * 2 * c * c
    return pairs / (n * n)


def speedup(cp: int) -> float:
    """Zig-zag's speed-up of the causal ring forward over contiguous, in slowest-rank pairs."""
    return ring_time_blocks(cp, "contiguous") / ring_time_blocks(cp, "zigzag")
