"""Numbers for the chapter 07 key (the fused loss): the 8B task's logits and memory, FLOPs, tiles and traffic.

The task's shape is CS336's (issue 30); the parameter count comes from the kit's TransformerLM built on the meta
device; the naive loss's bytes per logit are measured on the reference (``peak_memory_bytes`` at a small size);
the tile sizes are the reference's ``GPU_BLOCKS``; peaks and bandwidths come from ``kit.flops``.
"""

from __future__ import annotations

import torch

from kit import flops, model
from reference.whole_step import fused_cross_entropy as fce

TOKENS, VOCAB, D_MODEL, D_FF, LAYERS, HEADS, CONTEXT = 2 * 32_768, 151_936, 4096, 11_008, 34, 32, 32_768
GPUS = 2
H100_SMS, H100_L2_MB = 132, 50  # streaming multiprocessors and L2 cache of an H100 SXM (NVIDIA's data sheet)


def task_config() -> model.ModelConfig:
    """The 8B task's model as a kit ModelConfig."""
    return model.get_config("small", vocab_size=VOCAB, context_length=CONTEXT, d_model=D_MODEL, d_ff=D_FF,
                            num_layers=LAYERS, num_heads=HEADS)


def params() -> int:
    """Parameters of the 8B task's TransformerLM (embedding and LM head included), counted on the meta device."""
    with torch.device("meta"):
        m = model.TransformerLM(task_config())
    return sum(p.numel() for p in m.parameters())


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
    """The whole step's ≈ 6·P·N matmul FLOPs (attention's score FLOPs left out)."""
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


def split_d_recompute(d: int, block_d: int = 64) -> float:
    """Backward matmul sweeps (units of 2NVd) of the register-accumulator design: each of its two kernels
    recomputes the logits once per chunk of d, plus its own gradient matmul."""
    return 2 * (-(-d // block_d)) + 2
