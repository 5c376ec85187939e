"""Numbers for the chapter 03 key (FlashAttention): naive memory, roofline ridge points per device."""

from __future__ import annotations

import functools

from instructor import answer_key as answers
from kit import flops


def nxn_gib(n: int, bytes_per_element: int = 4, batch_heads: int = 1) -> float:
    """One (N × N) score-sized tensor, GiB."""
    return batch_heads * n * n * bytes_per_element / 2**30


def ridge(device: str = "H100", dtype: str = "bf16") -> float:
    """FLOP per byte at which the device turns compute-bound: peak / HBM bandwidth (kit.flops)."""
    return flops.peak_flops(device, dtype) / flops.memory_bandwidth(device)


def flash_intensity(n: int, bytes_per_element: int = 2, causal: bool = False) -> float:
    """Forward FLOPs / HBM bytes of a fused kernel that reads q, k, v once and writes o: 4N²D·(½) / (4·N·D·c)."""
    return n * (0.5 if causal else 1.0) / bytes_per_element


def ridge_table() -> str:
    lines = ["| device | bf16 peak TFLOP/s | HBM TB/s | ridge FLOP/byte | L2-model N at the ridge, non-causal (bf16) "
             "| L2-model N at the ridge, causal (bf16) |",
             "|---|---|---|---|---|---|"]
    for dev in ("H100", "H200", "B200", "GB200"):
        r = ridge(dev)
        peak, hbm = flops.peak_flops(dev, "bf16"), flops.memory_bandwidth(dev)
        # flash_intensity(N, 2, causal) = N·(½)/2 reaches r at N = 2r (non-causal) and 4r (causal).
        lines.append(f"| {dev} | {peak / 1e12:.0f} | {hbm / 1e12:.2f} | {r:.0f} | {2 * r:.0f} | {4 * r:.0f} |")
    return "\n".join(lines)


def ok_rows() -> list[dict]:
    return [r for r in answers.results("bench_attention")["rows"] if r["status"] == "ok"]


# ------------------------------------------------------------------------------------------ naive attention's peak

@functools.cache
def naive_peak_bytes(dtype: str, mode: str, n: int, d: int, batch_heads: int) -> int:
    """Peak bytes `kit.model.naive_attention` (causal) adds on top of its inputs, measured by torch.profiler's
    memory timeline on this CPU (exact byte counts), for ``batch_heads`` problems of N = ``n``, D = ``d``."""
    import torch

    from kit import memory_timeline
    from kit.model import naive_attention

    torch.manual_seed(0)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    q, k, v = (torch.randn(1, batch_heads, n, d, dtype=dt, requires_grad=mode != "forward") for _ in range(3))
    grad_out = torch.randn(1, batch_heads, n, d, dtype=dt)

    def call() -> None:
        if mode == "forward":
            with torch.no_grad():
                naive_attention(q, k, v, is_causal=True)
        else:
            naive_attention(q, k, v, is_causal=True).backward(grad_out)

    timeline = memory_timeline.record(call)
    total = timeline.total()
    return max(total) - total[0]


def naive_peak_per_nn(dtype: str = "fp32", mode: str = "forward", batch_heads: int = 1, n: int = 1024,
                      d: int = 16) -> float:
    """The N² coefficient of the peak, bytes per N², at ``batch_heads``.

    The peak is a·N² + b·N·D: the score-sized tensors and the masks, plus q, k, v, O and their gradients. At a
    small N the second term is not negligible — at N = 256, D = 64 one (N, D) tensor is 4D/N = 1 byte per N² in
    fp32, a quarter of a score tensor — and scaled by N² to N = 32768 it would add 16 GiB that does not exist. So
    measure at N and 2N: p(2N) − 2·p(N) = 2a·N² cancels the N·D part. (Both points peak at the same moment of
    the forward or backward: at D ≪ N the N² tensors decide it.)"""
    one, two = naive_peak_bytes(dtype, mode, n, d, batch_heads), naive_peak_bytes(dtype, mode, 2 * n, d, batch_heads)
    return (two - 2 * one) / (2 * n * n)


def naive_peak_split(dtype: str, mode: str) -> tuple[float, float]:
    """(bytes per N² per batch·head, bytes per N² shared by all batch·heads): the causal mask is built once,
    ``torch.ones(nq, nk)``, and broadcast over batch·heads, so it does not scale with them. From two measurements
    (batch·heads 1 and 2): the peak is linear in batch·heads."""
    one, two = naive_peak_per_nn(dtype, mode, batch_heads=1), naive_peak_per_nn(dtype, mode, batch_heads=2)
    return two - one, 2 * one - two


def naive_peak_gib(n: int, dtype: str, mode: str, batch_heads: int = 16) -> float:
    per_bh, shared = naive_peak_split(dtype, mode)
    return (per_bh * batch_heads + shared) * n**2 / 2**30


def naive_oom_table(seqs=(8192, 16384, 32768, 65536), batch_heads: int = 16, limit_gib: float = 79.1) -> str:
    """Predicted peak GiB of naive attention at batch·heads 16 per dtype and mode; OOM above ``limit_gib`` (an
    H100 80 GB's usable memory as torch reports it)."""
    lines = ["| dtype | mode | bytes per N² per batch·head | shared (the masks) | "
             + " | ".join(f"N = {n}" for n in seqs) + " |",
             "|---|---|---|---|" + "---|" * len(seqs)]
    for dtype in ("fp32", "bf16"):
        for mode in ("forward", "forward_backward"):
            cells = []
            for n in seqs:
                g = naive_peak_gib(n, dtype, mode, batch_heads)
                cells.append(f"{g:,.0f}" + (" **OOM**" if g > limit_gib else ""))
            per_bh, shared = naive_peak_split(dtype, mode)
            lines.append(f"| {dtype} | {mode} | {per_bh:.2f} | {shared:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def flash_hbm_intensity(block_m: int = 128, bytes_per_element: int = 2) -> float:
    """§7's model: FLOPs 4N²D per batch·head (non-causal), HBM bytes ≈ 2·N·D·c·N/B_M (K and V re-read once per query
    tile) for large N: 2·B_M/c FLOP per byte, independent of N and D (causal halves both)."""
    return 2 * block_m / bytes_per_element
