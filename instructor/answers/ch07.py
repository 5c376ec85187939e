"""Numbers for the chapter 07 key (the fused loss): the 8B task's logits and memory, FLOPs, tiles and traffic.

The task's shape is CS336's (issue 30); the parameter count comes from the kit's TransformerLM built on the meta
device; the naive loss's bytes per logit are measured on the reference (``peak_memory_bytes`` at a small size);
the tile sizes are the reference's ``GPU_BLOCKS``; peaks and bandwidths come from ``kit.flops``; the whole step's
FLOPs from ``kit.flops.transformer_flops`` (the kit's convention: non-embedding parameters, causal attention).
"""

from __future__ import annotations

import torch

from kit import flops, model
from reference.whole_step import fused_cross_entropy as fce

TOKENS, VOCAB, D_MODEL, D_FF, LAYERS, HEADS, CONTEXT = 2 * 32_768, 151_936, 4096, 11_008, 34, 32, 32_768
GPUS = 2
H100_SMS, H100_L2_MB = 132, 50  # streaming multiprocessors and L2 cache of an H100 SXM (NVIDIA's data sheet)
# The H100's L2 bandwidth: NVIDIA publishes none. Third-party microbenchmarks report roughly 5.5 TB/s (an H100 PCIe,
# 114 SMs) to ~12 TB/s (the SXM part); Problem 7.6 states this range as its assumption, and the key uses it.
H100_L2_TBPS = (5.5, 12.0)


def task_config() -> model.ModelConfig:
    """The 8B task's model as a kit ModelConfig."""
    return model.get_config("small", vocab_size=VOCAB, context_length=CONTEXT, d_model=D_MODEL, d_ff=D_FF,
                            num_layers=LAYERS, num_heads=HEADS)


def params(embedding: bool = True) -> int:
    """Parameters of the 8B task's TransformerLM (LM head included; the token embedding too unless
    ``embedding=False``, the convention of kit.flops), counted on the meta device."""
    with torch.device("meta"):
        m = model.TransformerLM(task_config())
    total = sum(p.numel() for p in m.parameters())
    return total if embedding else total - m.token_embeddings.weight.numel()


def logits() -> int:
    """Elements of the task's logits, N · V."""
    return TOKENS * VOCAB


def naive_bytes_per_logit(phase: str = "backward", dtype: torch.dtype = torch.bfloat16) -> float:
    """The naive loss's peak bytes per logit, measured on the reference at 64 tokens × V = 512 (d = 16):
    ``phase`` "forward" (the loss alone) or "backward" (forward + backward)."""
    n, v, d = 64, 512, 16
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    w = torch.randn(v, d, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)

    def step() -> None:
        loss = fce.naive_linear_cross_entropy(h, w, t)
        if phase == "backward":
            loss.backward()

    return fce.peak_memory_bytes(step) / (n * v)


def naive_peak_gb(phase: str = "backward", tokens: int = TOKENS) -> float:
    """The naive loss's peak at the task's size (bf16), GB, from the measured bytes per logit."""
    return naive_bytes_per_logit(phase) * tokens * VOCAB / 1e9


def tokens_filling(gpu_bytes: float = 80e9) -> float:
    """Tokens per GPU whose naive loss alone (backward peak, bf16) fills ``gpu_bytes``."""
    return gpu_bytes / (naive_bytes_per_logit("backward") * VOCAB)


def fused_bytes(tokens: int = TOKENS) -> dict[str, float]:
    """What the reference's fused loss allocates at the task's size (bf16 inputs), bytes: what it saves beyond its
    inputs, its fp32 accumulators, and their casts to bf16."""
    return {"saved": 4 * tokens + 8, "dh_fp32": 4 * tokens * D_MODEL, "dw_fp32": 4 * VOCAB * D_MODEL,
            "casts": 2 * (tokens + VOCAB) * D_MODEL}


def optimizer_gb() -> dict[str, float]:
    """bf16 weights and gradients, fp32 master weights and AdamW's m and v, GB (whole model, not sharded)."""
    p = params()
    return {"weights": 2 * p / 1e9, "grads": 2 * p / 1e9, "master": 4 * p / 1e9, "adam": 8 * p / 1e9,
            "total": 16 * p / 1e9}


def lm_head_flops(design: str) -> float:
    """Matmul FLOPs of the LM head + loss, forward + backward, at the task's size: ``naive`` 6NVd, ``atomics``
    (recompute once) 8NVd, ``reference`` (recompute in each backward kernel) 10NVd."""
    sweeps = {"naive": 3, "atomics": 4, "reference": 5}[design]
    return sweeps * 2 * TOKENS * VOCAB * D_MODEL


def step_flops() -> float:
    """The whole train step's model FLOPs in the kit's convention (kit.flops.transformer_flops): 6·P·N for the
    weights, P the non-embedding parameters (LM head included), plus 6·L·d·T·N for causal attention."""
    return flops.transformer_flops(task_config(), TOKENS // CONTEXT, CONTEXT, "train_step")


def attention_step_flops() -> float:
    """The causal attention part of :func:`step_flops`: L layers × 3 (forward + backward) × kit.flops's forward."""
    cfg = task_config()
    return LAYERS * flops.attention_flops((TOKENS // CONTEXT) * HEADS, CONTEXT, CONTEXT, cfg.d_model // HEADS,
                                          causal=True, mode="forward_backward")


def naive_step_flops() -> float:
    """6·P·N with P counting the embedding and attention left out: the estimate Problem 7.5 no longer uses."""
    return 6 * params() * TOKENS


def gpu_tile(name: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """A tile size (or num_warps …) of the reference's GPU launch configuration."""
    return fce.GPU_BLOCKS[dtype][name]


def ridge(device: str = "H100") -> float:
    """FLOP per byte at which the device turns compute-bound (dense bf16 peak / HBM bandwidth)."""
    return flops.peak_flops(device, "bf16") / flops.memory_bandwidth(device)


def w_reads_per_program_gb() -> float:
    """Bytes of W one forward program reads (every vocabulary row, bf16), GB."""
    return 2 * VOCAB * D_MODEL / 1e9


def forward_programs() -> int:
    return -(-TOKENS // gpu_tile("BLOCK_T"))


def h_rereads_tb() -> float:
    """Bytes of h the forward grid reads: each program re-reads its BLOCK_T × d tile (bf16) for every vocabulary
    tile, TB."""
    bt, bv = gpu_tile("BLOCK_T"), gpu_tile("BLOCK_V")
    return forward_programs() * -(-VOCAB // bv) * 2 * bt * D_MODEL / 1e12


def forward_tile_intensity() -> float:
    """FLOP per byte of one d-chunk of a logits tile: 2·BT·BV·BD FLOPs for (BT + BV)·BD bf16 elements loaded."""
    bt, bv = gpu_tile("BLOCK_T"), gpu_tile("BLOCK_V")
    return bt * bv / (bt + bv)


def forward_compute_s(device: str = "H100") -> float:
    """The forward's one sweep of 2NVd FLOPs at the device's dense bf16 peak, s."""
    return 2 * TOKENS * VOCAB * D_MODEL / flops.peak_flops(device, "bf16")


def forward_l2_s(tbps: float) -> float:
    """The forward's W reads and h re-reads served at ``tbps`` TB/s (the L2's bandwidth), s."""
    return (w_reads_per_program_gb() * forward_programs() / 1e3 + h_rereads_tb()) / tbps


def h_tiles_in_flight_mb(sms: int = H100_SMS) -> float:
    """bf16 h tiles (BLOCK_T × d) of the forward programs resident at once (one per SM), MB."""
    return sms * 2 * gpu_tile("BLOCK_T") * D_MODEL / 1e6


def dh_accumulator_traffic_tb() -> float:
    """Bytes the dH kernel moves through its fp32 accumulators at the task's size (read + write of BLOCK_T × d per
    vocabulary tile per program), TB."""
    bt, bv = gpu_tile("BLOCK_T"), gpu_tile("BLOCK_V")
    programs, tiles = -(-TOKENS // bt), -(-VOCAB // bv)
    return programs * tiles * 2 * 4 * bt * D_MODEL / 1e12


def dh_kernel_seconds(device: str = "H100") -> dict[str, float]:
    """The dH kernel's time bounds at the task's size: its 4NVd FLOPs at peak, and its accumulator traffic at HBM
    bandwidth."""
    return {"compute": 4 * TOKENS * VOCAB * D_MODEL / flops.peak_flops(device, "bf16"),
            "traffic": dh_accumulator_traffic_tb() * 1e12 / flops.memory_bandwidth(device)}


def accumulators_in_flight_mb(sms: int = H100_SMS) -> float:
    """fp32 dH accumulator rows of the programs resident at once (one per SM), MB."""
    return sms * 4 * gpu_tile("BLOCK_T") * D_MODEL / 1e6


def accumulators_fit_l2_d(sms: int = H100_SMS, l2_mb: float = H100_L2_MB) -> float:
    """The largest d at which the resident dH programs' fp32 accumulators (one program per SM, BLOCK_T × d × 4 B
    each) fit in the L2 cache: sms · BLOCK_T · d · 4 ≤ L2 bytes."""
    return l2_mb * 1e6 / (sms * 4 * gpu_tile("BLOCK_T"))


def split_d_recompute(d: int, block_d: int | None = None) -> float:
    """Backward matmul sweeps (units of 2NVd) of the register-accumulator design: each of its two kernels
    recomputes the logits once per chunk of d, plus its own gradient matmul. ``block_d`` defaults to the
    reference's bf16 GPU tile (``GPU_BLOCKS``), the one Problem 7.6 names."""
    block_d = block_d or gpu_tile("BLOCK_D")
    return 2 * (-(-d // block_d)) + 2
