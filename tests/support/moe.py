"""The judge's mixture of experts: the single-process reference of Stage 6's expert-parallel and 4D tests.

The Stage 6 tests compare what the implementation computes on its ranks with one process running the same
layer on the same tokens. That one process runs in the judge, so it cannot be the implementation's
``MoEFeedForward``: it is :class:`ReferenceMoE` below, the handout's routing rules (§4.1) written out
plainly — routing and capacity decided assignment by assignment in priority order (every token's first
choice before any second choice, each in token order), then each expert run on the tokens it kept. It is
differentiable, so outputs, balancing loss and every gradient can be compared, and it creates its weights
exactly as the given ``MoEFeedForward.__init__`` does: the same seed gives the same layer.

:func:`moe_transformer` is the model of ``train_4d.build_model`` built from these layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kit.model import ModelConfig, TransformerLM

__all__ = ["ReferenceMoE", "capacity", "moe_transformer"]


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Slots per expert (handout 06 §4.1): ``ceil(capacity_factor · N · k / E)``, at least 1; ``N`` without a factor."""
    if capacity_factor is None:
        return num_tokens
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


class ReferenceMoE(nn.Module):
    """Top-k mixture of SwiGLU experts with a capacity limit, on one process; parameters named and created as
    the given ``MoEFeedForward``'s (``router.weight``, ``w1``, ``w3`` ``(E, d, d_ff)``, ``w2`` ``(E, d_ff, d)``).

    After each forward: ``aux_loss`` (the Switch Transformer balancing loss, differentiable) and
    ``dropped_tokens`` (assignments over capacity).
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, *, top_k: int = 2,
                 capacity_factor: float | None = 1.25):
        super().__init__()
        self.d_model, self.d_ff = d_model, d_ff
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        # The given initialisation, draw for draw: router (Linear's own init), w1, w3, w2, then the router again.
        self.router = nn.Linear(d_model, num_experts, bias=False)
        std_in, std_out = math.sqrt(2.0 / (d_model + d_ff)), math.sqrt(2.0 / (d_ff + d_model))
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w3 = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        for w, std in ((self.w1, std_in), (self.w3, std_in), (self.w2, std_out)):
            nn.init.trunc_normal_(w, std=std, a=-3 * std, b=3 * std)
        std_r = math.sqrt(2.0 / (d_model + num_experts))
        nn.init.trunc_normal_(self.router.weight, std=std_r, a=-3 * std_r, b=3 * std_r)
        self.aux_loss: torch.Tensor | None = None
        self.dropped_tokens = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xs = x.reshape(-1, self.d_model)
        n, e, k = xs.shape[0], self.num_experts, self.top_k
        slots = capacity(n, e, k, self.capacity_factor)
        probs = torch.softmax(self.router(xs).float(), dim=-1)  # routing in fp32 (N, E)
        top_p, top_e = probs.topk(k, dim=-1)
        gates = top_p / top_p.sum(dim=-1, keepdim=True)  # renormalised over the k chosen
        choices = top_e.tolist()
        kept: list[list[tuple[int, int]]] = [[] for _ in range(e)]  # per expert: (token, choice), in priority order
        counts, dropped = [0] * e, 0
        for c in range(k):
            for i in range(n):
                j = choices[i][c]
                counts[j] += 1  # the balancing loss counts assignments before dropping
                if len(kept[j]) < slots:
                    kept[j].append((i, c))
                else:
                    dropped += 1
        y = xs.new_zeros(n, self.d_model)
        for j, assignments in enumerate(kept):
            if not assignments:
                continue
            tokens = torch.tensor([i for i, _ in assignments])
            which = torch.tensor([c for _, c in assignments])
            h = xs[tokens]
            out = (F.silu(h @ self.w1[j]) * (h @ self.w3[j])) @ self.w2[j]
            y = y.index_add(0, tokens, out * gates[tokens, which, None].to(xs.dtype))
        self.dropped_tokens = dropped
        fraction = torch.tensor(counts, dtype=torch.float32) / (n * k)
        self.aux_loss = e * (fraction * probs.mean(dim=0)).sum()
        return y.view(shape)


def moe_transformer(model: ModelConfig, *, seed: int, num_experts: int, top_k: int,
                    capacity_factor: float | None, moe_class: type[ReferenceMoE] = ReferenceMoE) -> TransformerLM:
    """``train_4d.build_model``'s model on one process: the kit's Transformer, seeded, each ``ffn`` a
    :class:`ReferenceMoE` (created in the same order, so with the same weights), or a subclass of it."""
    torch.manual_seed(seed)
    lm = TransformerLM(model)
    for block in lm.layers:
        block.ffn = moe_class(model.d_model, model.d_ff, num_experts, top_k=top_k, capacity_factor=capacity_factor)
    return lm
