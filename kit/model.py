"""The Transformer language model every stage trains, measures and parallelises.

A pre-norm decoder in the style of a first LLM assignment:

    tokens (B, T) int64
      └─ token embedding                      (B, T, d_model)
      └─ num_layers × Block:
            x = x + Attention(RMSNorm(x))     causal multi-head attention with RoPE
            x = x + SwiGLU(RMSNorm(x))        W2 · (SiLU(W1 x) ⊙ W3 x)
      └─ RMSNorm → LM head                    (B, T, vocab_size) logits

The attention kernel is pluggable: ``TransformerLM(config, attention_fn=f)`` or
``model.set_attention(f)`` with ``f(q, k, v, is_causal) -> o`` on ``(B, H, T, d_head)`` tensors. Stage 1
swaps in an NVTX-annotated attention, Stage 3 FlashAttention, Stage 6's context parallelism a ring over the
ranks that share the sequence (with ``model.set_positions(p)``, so that the rotary embedding rotates each
token by its position in the whole sequence). Layers keep separate q/k/v/output and w1/w2/w3 projections so
Stage 6 can split them across tensor-parallel ranks without touching this file.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from kit.validate import positive_int

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a :class:`TransformerLM`. ``d_model`` must divide by ``num_heads``."""

    vocab_size: int = 10_000
    context_length: int = 256
    d_model: int = 768
    d_ff: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        for field in ("vocab_size", "context_length", "d_model", "d_ff", "num_layers", "num_heads"):
            positive_int(f"ModelConfig.{field}", getattr(self, field))
        if self.d_model % self.num_heads:
            raise ValueError(
                f"ModelConfig.d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})"
            )
        if (self.d_model // self.num_heads) % 2:
            d_head = self.d_model // self.num_heads
            raise ValueError(f"head dimension d_model/num_heads = {d_head} must be even (RoPE)")

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads

    def with_(self, **changes) -> ModelConfig:
        """A copy with some fields changed, e.g. ``PRESETS["small"].with_(context_length=1024)``."""
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)


# The model sizes of the benchmarking stage (vocab 10,000) plus tiny ones that train in seconds on a CPU.
# Names follow the 2024–25 course tables: our `xl` (d 1600, 48 layers) is *not* the `xl` of the 2026 course
# (d 2560, 32 layers), which is our `2.7B`. `10B` (d 4608, d_ff 12288, 50 layers, 36 heads: 12.8 B parameters
# with this SwiGLU, embeddings included) is for the accounting problems (handout 05, 06): build it on the
# `meta` device only.
PRESETS: dict[str, ModelConfig] = {
    "small": ModelConfig(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": ModelConfig(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": ModelConfig(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": ModelConfig(d_model=1600, d_ff=6400, num_layers=48, num_heads=25),
    "2.7B": ModelConfig(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
    "10B": ModelConfig(d_model=4608, d_ff=12288, num_layers=50, num_heads=36),
    "tiny": ModelConfig(vocab_size=512, context_length=64, d_model=64, d_ff=256, num_layers=2, num_heads=4),
    "mini": ModelConfig(vocab_size=1024, context_length=128, d_model=128, d_ff=512, num_layers=4, num_heads=4),
}


def get_config(preset: str | ModelConfig, **overrides) -> ModelConfig:
    """A preset by name (``tiny``, ``mini``, ``small`` … ``2.7B``) or a config, with fields overridden."""
    if isinstance(preset, ModelConfig):
        return preset.with_(**overrides) if overrides else preset
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    return PRESETS[preset].with_(**overrides) if overrides else PRESETS[preset]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """softmax(q kᵀ / √d) v, materialising the full score matrix.

    q: ``(..., Nq, D)``, k and v: ``(..., Nk, D)``; returns ``(..., Nq, D)`` in q's dtype. Causal masking
    aligns query i with key i.
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:
        nq, nk = scores.shape[-2:]
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


class RMSNorm(nn.Module):
    """x / RMS(x) · g, computed in fp32 whatever the input dtype (norms are precision-sensitive)."""

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x32 = x.float()
        rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * rms * self.weight.float()).to(in_dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding: rotates each (even, odd) feature pair by position · θ^(-2i/d)."""

    def __init__(self, d_head: int, context_length: int, theta: float):
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, d_head, 2, dtype=torch.float32) / d_head)
        angles = torch.outer(torch.arange(context_length, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: ``(B, H, T, d_head)``; positions: ``(T,)`` int64."""
        cos = self.cos[positions].to(x.dtype)
        sin = self.sin[positions].to(x.dtype)
        x_even, x_odd = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
        return rotated.flatten(-2)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, attention_fn: AttentionFn):
        super().__init__()
        self.num_heads = config.num_heads
        self.d_head = config.d_head
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.output_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.rope = rope
        self.attention_fn = attention_fn
        # The global positions of the T tokens this layer sees, int64 (T,); None: 0 … T−1. Context parallelism
        # (Stage 6, handout 06b §6) sets them: a rank holding a shard of the sequence must rotate each token by
        # its place in the whole sequence, not in the shard. Not a buffer: it differs between the ranks of a
        # context-parallel group, so nothing that broadcasts or compares buffers across ranks (DDP) may touch it.
        self.positions: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``(B, T, d)`` → ``(B, T, d)``. Head count comes from the q projection's width, so a
        tensor-parallel shard with fewer heads runs the same code."""
        b, t, _ = x.shape
        q, k, v = (
            proj(x).view(b, t, -1, self.d_head).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        positions = torch.arange(t, device=x.device) if self.positions is None else self.positions
        if positions.shape != (t,):
            raise ValueError(f"attention positions have shape {tuple(positions.shape)}, but the input holds {t} tokens "
                             "(set_positions: one global position per token this rank holds)")
        q, k = self.rope(q, positions), self.rope(k, positions)
        o = self.attention_fn(q, k, v, True)
        return self.output_proj(o.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One pre-norm Transformer block. ``ffn`` may be replaced (Stage 6 puts a mixture of experts there)."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, attention_fn: AttentionFn):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model)
        self.attn = CausalSelfAttention(config, rope, attention_fn)
        self.ffn_norm = RMSNorm(config.d_model)
        self.ffn = SwiGLU(config.d_model, config.d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class TransformerLM(nn.Module):
    """Decoder-only LM. ``forward(tokens (B, T) int64) -> logits (B, T, vocab_size)`` in the compute dtype."""

    def __init__(self, config: ModelConfig | str, attention_fn: AttentionFn | None = None):
        super().__init__()
        self.config = config = get_config(config)
        attention_fn = attention_fn or naive_attention
        self.token_embeddings = nn.Embedding(config.vocab_size, config.d_model)
        rope = RotaryEmbedding(config.d_head, config.context_length, config.rope_theta)
        self.layers = nn.ModuleList(Block(config, rope, attention_fn) for _ in range(config.num_layers))
        self.final_norm = RMSNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = math.sqrt(2.0 / (module.in_features + module.out_features))
            nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
        elif isinstance(module, nn.Embedding):
            nn.init.trunc_normal_(module.weight, std=1.0, a=-3.0, b=3.0)

    def set_attention(self, attention_fn: AttentionFn) -> None:
        """Use ``attention_fn(q, k, v, is_causal)`` in every block from now on."""
        if not callable(attention_fn):
            raise TypeError(f"attention_fn must be callable, got {type(attention_fn).__name__}")
        for block in self.layers:
            block.attn.attention_fn = attention_fn

    def set_positions(self, positions: torch.Tensor | None) -> None:
        """Rotate the tokens of every forward from now on by these global positions, int64 ``(T,)``, instead of
        0 … T−1 (``None`` restores that). Context parallelism: a rank holding tokens ``positions`` of a longer
        sequence (handout 06b §6)."""
        if positions is not None:
            if not isinstance(positions, torch.Tensor) or positions.dtype != torch.long or positions.dim() != 1:
                raise TypeError(f"positions must be an int64 tensor of shape (T,) or None, got {positions!r}")
            if len(positions) and int(positions.max()) >= self.config.context_length:
                raise ValueError(f"positions reach {int(positions.max())} ≥ context_length "
                                 f"{self.config.context_length}")
        for block in self.layers:
            block.attn.positions = positions

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden_states(tokens))

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final-normalised hidden states ``(B, T, d_model)``: what the LM head turns into logits. A loss
        that fuses the LM head with the cross-entropy (Stage 7) starts here, with ``self.lm_head.weight``."""
        if tokens.dtype != torch.long or tokens.dim() != 2:
            raise ValueError(
                f"tokens must be an int64 tensor of shape (batch, seq), got {tokens.dtype} {tuple(tokens.shape)}"
            )
        if tokens.shape[1] > self.config.context_length:
            raise ValueError(
                f"tokens has sequence length {tokens.shape[1]} > context_length {self.config.context_length}"
            )
        x = self.token_embeddings(tokens)
        for block in self.layers:
            x = block(x)
        return self.final_norm(x)

    def num_parameters(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.token_embeddings.weight.numel() if non_embedding else n


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; logits ``(B, T, V)`` any float dtype (computed in fp32), targets ``(B, T)``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def make_optimizer(model: nn.Module, lr: float = 1e-3, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """torch's AdamW with the usual LM defaults (betas 0.9/0.95)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
