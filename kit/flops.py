"""FLOP counts and accelerator peaks, for model FLOP utilisation (MFU) in the benchmarks.

MFU = achieved model FLOP/s ÷ the device's dense peak for the dtype. "Model FLOPs" count the maths the
model needs, not what a kernel happened to execute (recomputation does not count), following PaLM
(Chowdhery et al. 2022, appendix B): per token, a train step costs 6·N for the weights (2 forward,
4 backward) plus 12·L·d·T for attention scores and their use (non-causal count).
"""

from __future__ import annotations

from .model import ModelConfig

# Dense (no sparsity) peak throughput in FLOP/s from the vendors' data sheets, by dtype.
# fp32 means plain fp32 (no TF32), which is what the kit asks of its fp32 matmuls.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},  # SXM; PCIe is ~756e12 bf16
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30e12},
    "RTX 4090": {"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
}

MODE_MULTIPLIER = {"forward": 1.0, "forward_backward": 3.0, "train_step": 3.0}


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s for a device name (as ``torch.cuda.get_device_name`` prints it), or None if unknown."""
    for key, table in PEAK_FLOPS.items():
        if key.lower() in device_name.lower():
            return table.get(dtype)
    return None


def transformer_flops(config: ModelConfig, batch_size: int, context_length: int, mode: str,
                      num_params: int | None = None) -> float:
    """Model FLOPs for one forward (``mode="forward"``) or forward+backward (``"forward_backward"``,
    ``"train_step"``) pass over ``batch_size × context_length`` tokens.

    ``num_params`` defaults to the non-embedding parameter count of ``config`` (embedding lookups are
    not matmuls; the LM head is).
    """
    if mode not in MODE_MULTIPLIER:
        raise ValueError(f"mode must be one of {sorted(MODE_MULTIPLIER)}, got {mode!r}")
    d, L = config.d_model, config.num_layers
    if num_params is None:
        per_layer = 4 * d * d + 3 * d * config.d_ff + 2 * d
        num_params = L * per_layer + d + d * config.vocab_size
    tokens = batch_size * context_length
    forward = 2 * num_params * tokens + 4 * L * d * context_length * tokens
    return MODE_MULTIPLIER[mode] * forward
