"""Model FLOPs and accelerator peaks: the one FLOP convention of the kit, for TFLOP/s and MFU.

MFU = model FLOPs per second ÷ the device's dense peak for the dtype. **Model FLOPs** count the
matmul maths the model needs, once, whatever a kernel happens to execute:

* the weights: 2 FLOPs per parameter per token forward (one multiply-add), twice that backward
  (input and weight gradients), so 6·N per token for a train step — N the non-embedding parameters,
  LM head included (embedding lookups are not matmuls);
* attention: the two matmuls q·kᵀ and P·v, 4·Nq·Nk·D per batch·head forward, counting only the
  **causal half** (Nq·Nk/2 score pairs) when the attention is causal. For the kit's causal
  Transformer that is 2·L·d·T per token forward and 6·L·d·T per token for a train step;
* backward = 2 × forward, forward+backward = 3 × forward, for the weights and attention alike;
* not counted: recomputation (activation checkpointing, FlashAttention recomputing P), softmax,
  norms, element-wise work and the optimizer.

How it differs from the two common alternatives:

* PaLM (Chowdhery et al. 2022, appendix B) counts 6·N + 12·L·d·T per token: the full T × T score
  matrix, as if attention were not causal. For the same run its MFU is ours × (1 + 6·L·d·T / (6·N +
  6·L·d·T)) — the same for short contexts, up to 2× ours when attention dominates.
* The 6·N rule (Kaplan et al. 2020) leaves attention out: it undercounts long contexts.
* FlashAttention papers and the Triton tutorial report backward TFLOP/s on 2.5 × the forward
  (the recomputation of P counted): their backward and forward+backward TFLOP/s are 1.25× and
  3.5/3 ≈ 1.17× ours for the same time. The benchmarks report what a design actually executes in a
  separate column (``bench_attention``'s ``executed_tflop``).

Everything that reports TFLOP/s or MFU (benchmarks, notebooks, handout chapters 01 and 03) uses
:func:`transformer_flops` and :func:`attention_flops`.
"""

from __future__ import annotations

from .model import ModelConfig

# Dense (no 2:4 sparsity) peak throughput in FLOP/s by dtype, and HBM bandwidth in bytes/s, keyed by the
# data sheet's name of the part. Data sheets quote tensor-core figures with sparsity; the dense figure is half
# of that. fp32 means plain fp32 (no TF32), which is what the kit asks of its fp32 matmuls.
#   H100 (SXM), H100 PCIe, H100 NVL: NVIDIA H100 Tensor Core GPU data sheet, one column each.
#   H200 (SXM), H200 NVL: NVIDIA H200 Tensor Core GPU data sheet.
#   B200: NVIDIA HGX B200 data sheet, per GPU (÷ 8): 2.25 PFLOP/s dense bf16. The 2.5 PFLOP/s that some texts
#         (CS336 2026 among them) quote for "a B200" is the GB200 superchip's B200, which runs at a higher
#         power limit: the GB200 row. The B200's plain-fp32 figure differs between revisions of the data
#         sheet (75–80 TFLOP/s), so it is left out: fp32 MFU on a B200 is not reported.
#   GB200: NVIDIA GB200 NVL72 data sheet, per GPU (÷ 72).
#   A100 (SXM4) and A100 PCIe, L4, L40S, RTX 4090, V100: their data sheets (RTX 4090: fp32 accumulation). The
#         A100 rows are the 80 GB parts (HBM2e: 2,039 GB/s SXM4, 1,935 GB/s PCIe); the 40 GB parts (HBM2) have the
#         same peaks and 1,555 GB/s, both forms (NVIDIA A100 Tensor Core GPU data sheet): rows of their own.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "GB200": {"bf16": 2.5e15, "fp16": 2.5e15, "fp8": 5e15, "fp32": 90e12},
    "B200": {"bf16": 2.25e15, "fp16": 2.25e15, "fp8": 4.5e15},
    "H200 NVL": {"bf16": 835e12, "fp16": 835e12, "fp8": 1670e12, "fp32": 60e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "fp32": 67e12},
    "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "fp8": 1670e12, "fp32": 60e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp8": 1513e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "fp32": 67e12},  # SXM
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},  # SXM4
    "A100 PCIe": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "A100 40GB": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},  # SXM4
    "A100 PCIe 40GB": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp8": 733e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp8": 242e12, "fp32": 30e12},
    "RTX 4090": {"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},  # SXM2
    "V100 PCIe": {"fp16": 112e12, "fp32": 14e12},
}
HBM_BANDWIDTH: dict[str, float] = {
    "GB200": 8e12, "B200": 8e12, "H200 NVL": 4.8e12, "H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12,
    "H100": 3.35e12, "A100": 2.039e12, "A100 PCIe": 1.935e12, "A100 40GB": 1.555e12, "A100 PCIe 40GB": 1.555e12,
    "L40S": 0.864e12, "L4": 0.3e12, "RTX 4090": 1.008e12, "V100": 0.9e12, "V100 PCIe": 0.9e12,
}
# The names ``torch.cuda.get_device_name()`` reports, each mapped to its row above. Matching is exact: a
# substring rule read "NVIDIA L40S" as an L4 and "NVIDIA H100 NVL" as an H100 SXM. A name missing here is an
# unknown device (None: no MFU), never a guess; add the exact string when a new card shows up.
DEVICE_NAMES: dict[str, str] = {
    "NVIDIA GB200": "GB200",
    "NVIDIA B200": "B200",
    "NVIDIA H200 NVL": "H200 NVL",
    "NVIDIA H200": "H200",
    "NVIDIA H100 NVL": "H100 NVL",
    "NVIDIA H100 PCIe": "H100 PCIe",
    "NVIDIA H100 80GB HBM3": "H100",
    "NVIDIA A100-SXM4-80GB": "A100",
    "NVIDIA A100-SXM4-40GB": "A100 40GB",
    "NVIDIA A100 80GB PCIe": "A100 PCIe",
    "NVIDIA A100-PCIE-40GB": "A100 PCIe 40GB",
    "NVIDIA L40S": "L40S",
    "NVIDIA L4": "L4",
    "NVIDIA GeForce RTX 4090": "RTX 4090",
    "Tesla V100-SXM2-16GB": "V100",
    "Tesla V100-SXM2-32GB": "V100",
    "Tesla V100-PCIE-16GB": "V100 PCIe",
    "Tesla V100-PCIE-32GB": "V100 PCIe",
}

# Multiples of the forward pass: backward = 2 × forward (gradients w.r.t. inputs and weights).
MODE_MULTIPLIER = {"forward": 1.0, "backward": 2.0, "forward_backward": 3.0, "train_step": 3.0}


def device_spec(device_name: str) -> str | None:
    """The row of :data:`PEAK_FLOPS` for a device: ``device_name`` is either a name torch reports
    (``"NVIDIA H100 80GB HBM3"``, matched exactly, see :data:`DEVICE_NAMES`) or a row's own name
    (``"H100"``, ``"H100 NVL"``). None for an unknown device."""
    if not isinstance(device_name, str):
        raise TypeError(f"device_name must be a str, got {type(device_name).__name__}")
    name = device_name.strip()
    if name in PEAK_FLOPS:
        return name
    return DEVICE_NAMES.get(name)


def describe_device(device_name: str) -> str:
    """``"H100 NVL"`` for a known device, ``"unknown device 'X' (no peak: MFU not reported)"`` otherwise."""
    spec = device_spec(device_name)
    return spec if spec is not None else f"unknown device {device_name!r} (no peak: MFU not reported)"


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s for a device (a name as ``torch.cuda.get_device_name`` prints it, or a row name such
    as ``"H100"``) and a dtype (``"bf16"``, ``"fp16"``, ``"fp8"``, ``"fp32"``), or None when either is
    unknown: an unknown device is never matched to a similar name."""
    spec = device_spec(device_name)
    return None if spec is None else PEAK_FLOPS[spec].get(dtype)


def memory_bandwidth(device_name: str) -> float | None:
    """HBM bandwidth in bytes/s for a device (as for :func:`peak_flops`), or None when unknown."""
    spec = device_spec(device_name)
    return None if spec is None else HBM_BANDWIDTH.get(spec)


def _check_mode(mode: str) -> float:
    if mode not in MODE_MULTIPLIER:
        raise ValueError(f"mode must be one of {sorted(MODE_MULTIPLIER)}, got {mode!r}")
    return MODE_MULTIPLIER[mode]


def attention_flops(batch_heads: int, nq: int, nk: int, head_dim: int, *, causal: bool, mode: str) -> float:
    """Model FLOPs of one attention call on ``batch_heads`` independent (Nq × D, Nk × D) problems.

    Forward: q·kᵀ and P·v, 2·Nq·Nk·D each, so 4·BH·Nq·Nk·D, halved when ``causal`` (the causal half of
    the score matrix). ``mode``: ``"forward"`` (1×), ``"backward"`` (2×) or ``"forward_backward"`` (3×).
    """
    for name, value in (("batch_heads", batch_heads), ("nq", nq), ("nk", nk), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    forward = 4.0 * batch_heads * nq * nk * head_dim * (0.5 if causal else 1.0)
    return _check_mode(mode) * forward


def transformer_flops(config: ModelConfig, batch_size: int, context_length: int, mode: str,
                      num_params: int | None = None) -> float:
    """Model FLOPs of the kit's (causal) Transformer over ``batch_size × context_length`` tokens.

    ``mode``: ``"forward"``, ``"backward"``, ``"forward_backward"`` or ``"train_step"`` (the optimizer is
    not counted). ``num_params`` defaults to the non-embedding parameter count of ``config``, LM head
    included. Per token: 2·N + 2·L·d·T forward, 6·N + 6·L·d·T for a train step.
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    multiplier = _check_mode(mode)
    d, L = config.d_model, config.num_layers
    if num_params is None:
        per_layer = 4 * d * d + 3 * d * config.d_ff + 2 * d
        num_params = L * per_layer + d + d * config.vocab_size
    tokens = batch_size * context_length
    heads = config.num_heads
    attention = L * attention_flops(batch_size * heads, context_length, context_length, d // heads, causal=True,
                                    mode="forward")
    return multiplier * (2 * num_params * tokens + attention)
