"""Numbers for the chapter 03 key (FlashAttention): naive memory, roofline ridge points per device."""

from __future__ import annotations

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
    lines = ["| device | bf16 peak TFLOP/s | HBM TB/s | ridge FLOP/byte | fused-forward N at the ridge (bf16) |",
             "|---|---|---|---|---|"]
    for dev in ("H100", "H200", "B200", "GB200"):
        r = ridge(dev)
        peak, hbm = flops.peak_flops(dev, "bf16"), flops.memory_bandwidth(dev)
        lines.append(f"| {dev} | {peak / 1e12:.0f} | {hbm / 1e12:.2f} | {r:.0f} | {2 * r:.0f} |")
    return "\n".join(lines)


def ok_rows() -> list[dict]:
    return [r for r in answers.results("bench_attention")["rows"] if r["status"] == "ok"]
