"""Expert parallelism: a mixture-of-experts feed-forward whose experts live on different ranks (handout 06 §4).

A router scores every token against ``E`` experts and sends it to its ``top_k`` best. Each expert
accepts at most ``capacity = ceil(capacity_factor · N · top_k / E)`` of the ``N`` tokens of a batch;
assignments beyond that are **dropped** (the token skips that expert; its residual connection carries
it on). Assignments are served in priority order: every token's first choice before any second
choice, and within a choice in token order.

With expert parallelism the ``E`` experts are split over the ``ep`` ranks (``E / ep`` each). Every
rank routes its own tokens, packs them into a fixed-size buffer ``(E, capacity, d)``, and one
``all_to_all_single`` delivers each expert's slice to the rank that owns it; a second all-to-all brings
the results back (**dispatch** and **combine**). Because the buffer is fixed-size, both all-to-alls
have equal splits and the layer's output — dropped tokens included — equals the same layer run on one
process over the same tokens.

The load-balancing auxiliary loss (Switch Transformer): ``aux = E · Σ_e f_e · P_e`` with ``f_e`` the
fraction of the ``N · top_k`` assignments routed to expert ``e`` (before dropping) and ``P_e`` the mean
router probability of ``e``; it is ``1`` for perfectly uniform routing and grows as routing collapses.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kit.validate import instance, positive_int, positive_number


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Slots per expert: ``ceil(capacity_factor · num_tokens · top_k / num_experts)``, at least 1.

    ``capacity_factor=None`` means no dropping: ``num_tokens`` slots (a token picks an expert at most once).

    Raises:
        TypeError: a count that is not an int, or ``capacity_factor`` not a number (or None).
        ValueError: a count or ``capacity_factor`` that is not positive.
    """
    for name, value in (("num_tokens", num_tokens), ("num_experts", num_experts), ("top_k", top_k)):
        positive_int(name, value)
    if capacity_factor is None:
        return num_tokens
    positive_number("capacity_factor", capacity_factor)
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its own inverse, so the backward is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Chunk ``i`` of dim 0 goes to rank ``i`` of ``group``; chunk ``j`` of the result came from rank ``j``.

    ``x.shape[0]`` must be divisible by the group size. Differentiable.

    Raises:
        ValueError: dim 0 of ``x`` is not divisible by the group size.
    """
    size = dist.get_world_size(group)
    if x.shape[0] % size:
        raise ValueError(f"all_to_all: dim 0 of size {x.shape[0]} is not divisible by the group size {size}")
    return _AllToAll.apply(x, group)


class MoEFeedForward(nn.Module):
    """Top-k mixture of SwiGLU experts with a capacity limit; drop-in for a kit ``Block.ffn``.

    Parameters: ``router`` (``nn.Linear(d_model, num_experts)``), and the experts' stacked weights
    ``w1``, ``w3`` of shape ``(E_local, d_model, d_ff)`` and ``w2`` of shape ``(E_local, d_ff, d_model)``
    with ``E_local = num_experts`` until :func:`parallelize_moe` keeps this rank's ``num_experts / ep``.

    ``forward(x (..., d_model))`` returns the same shape and dtype. After each forward:
    ``self.aux_loss`` (0-dim fp32 tensor, differentiable) and ``self.dropped_tokens`` (int: token-choice
    assignments over capacity, on this rank). ``aux_grad_scale`` > 0 adds ``aux_grad_scale · ∂aux`` to
    the backward without returning the loss (used by pipeline training; 0 by default).
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, *, top_k: int = 2,
                 capacity_factor: float | None = 1.25):
        super().__init__()
        for name, value in (("d_model", d_model), ("d_ff", d_ff), ("num_experts", num_experts), ("top_k", top_k)):
            positive_int(name, value)
        if top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) must be ≤ num_experts ({num_experts})")
        if capacity_factor is not None:
            positive_number("capacity_factor", capacity_factor)
        self.d_model, self.d_ff = d_model, d_ff
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.router = nn.Linear(d_model, num_experts, bias=False)
        std_in, std_out = math.sqrt(2.0 / (d_model + d_ff)), math.sqrt(2.0 / (d_ff + d_model))
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w3 = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        for w, std in ((self.w1, std_in), (self.w3, std_in), (self.w2, std_out)):
            nn.init.trunc_normal_(w, std=std, a=-3 * std, b=3 * std)
        std_r = math.sqrt(2.0 / (d_model + num_experts))
        nn.init.trunc_normal_(self.router.weight, std=std_r, a=-3 * std_r, b=3 * std_r)
        self.ep_group: dist.ProcessGroup | None = None
        self.ep_size = 1
        self.aux_grad_scale = 0.0
        self.aux_loss: torch.Tensor | None = None
        self.dropped_tokens = 0

    def expert_parameters(self) -> list[nn.Parameter]:
        """The weights that differ across ep ranks (their gradients are averaged over dp only)."""
        return [self.w1, self.w2, self.w3]

    def _experts(self, h: torch.Tensor) -> torch.Tensor:
        """SwiGLU of each local expert on its tokens: ``h (E_local, n, d)`` → ``(E_local, n, d)``."""
        return torch.bmm(F.silu(torch.bmm(h, self.w1)) * torch.bmm(h, self.w3), self.w2)

    def _swiglu(self, h: torch.Tensor, j: int) -> torch.Tensor:
        """Local expert ``j`` on ``h (n, d)``."""
        return (torch.nn.functional.silu(h @ self.w1[j]) * (h @ self.w3[j])) @ self.w2[j]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.d_model:
            raise ValueError(f"MoEFeedForward expects (..., {self.d_model}) inputs, got {tuple(x.shape)}")
        shape = x.shape
        x = x.reshape(-1, self.d_model)
        n, e, k = x.shape[0], self.num_experts, self.top_k
        capacity = expert_capacity(n, e, k, self.capacity_factor)
        probs = torch.softmax(self.router(x).float(), dim=-1)  # (N, E)
        top_p, top_e = probs.topk(k, dim=-1)  # (N, k)
        gates = top_p / top_p.sum(dim=-1, keepdim=True)
        # Priority order: choice-major, then token. A stable sort by expert keeps that order inside each expert,
        # so an assignment's slot is its index in the sorted list minus where its expert's run starts.
        flat_e = top_e.t().reshape(-1)
        flat_gate = gates.t().reshape(-1)
        token = torch.arange(n, device=x.device).repeat(k)
        order = torch.sort(flat_e, stable=True).indices
        sorted_e = flat_e[order]
        counts = torch.bincount(flat_e, minlength=e)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(order.numel(), device=x.device) - starts[sorted_e]
        kept = position < capacity
        self.dropped_tokens = int(counts.clamp(min=capacity).sum() - capacity * e)
        chosen = order[kept]  # indices into the flat assignment list
        slot = sorted_e[kept] * capacity + position[kept]
        buffer = x.new_zeros(e * capacity, self.d_model).index_put((slot,), x[token[chosen]])
        if self.ep_size > 1:
            local = e // self.ep_size
            received = all_to_all(buffer, self.ep_group).view(self.ep_size, local, capacity, self.d_model)
            outs = []
            for j in range(local):  # one local expert at a time, on the tokens of every ep rank
                h = received[:, j].reshape(self.ep_size * capacity, self.d_model)
                outs.append(self._swiglu(h, j).view(self.ep_size, capacity, self.d_model))
            out = all_to_all(torch.stack(outs, dim=1).reshape(e * capacity, self.d_model), self.ep_group)
        else:
            out = torch.cat([self._swiglu(buffer[j * capacity:(j + 1) * capacity], j) for j in range(e)])
        weighted = out[slot] * flat_gate[chosen, None].to(x.dtype)
        y = x.new_zeros(n, self.d_model).index_add(0, token[chosen], weighted)
        self.aux_loss = e * (counts.float() / (n * k) * probs.mean(dim=0)).sum()
        if self.aux_grad_scale and torch.is_grad_enabled():
            y = _AuxLossGrad.apply(y, self.aux_loss, self.aux_grad_scale)
        return y.view(shape)


def parallelize_moe(moe: MoEFeedForward, ep_group: dist.ProcessGroup | None) -> MoEFeedForward:
    """Keep only this rank's experts — ``[r·E/ep, (r+1)·E/ep)`` for ep rank ``r`` — in place; returns ``moe``.

    The router stays whole (every rank routes its own tokens to all ``E`` experts). ``ep_group`` may be a
    ``ProcessGroup`` or a 1-D ``DeviceMesh``.

    Raises:
        ValueError: ``num_experts`` is not divisible by the ep size.
    """
    instance("moe", moe, MoEFeedForward, "a MoEFeedForward")
    group = ep_group.get_group() if hasattr(ep_group, "get_group") else ep_group
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"ep_group must be a ProcessGroup, a 1-D DeviceMesh or None, got {type(ep_group).__name__}")
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    if moe.num_experts % ep:
        raise ValueError(f"parallelize_moe: {moe.num_experts} experts are not divisible by the ep size {ep}")
    local = moe.num_experts // ep
    for name in ("w1", "w2", "w3"):
        full = getattr(moe, name)
        setattr(moe, name, nn.Parameter(full.detach()[rank * local:(rank + 1) * local].clone()))
    moe.ep_group, moe.ep_size = group, ep
    return moe


# ------------------------------------------------------------------------------------------------------
# Given: the auxiliary-loss gradient injector (MoEFeedForward.forward applies it when aux_grad_scale > 0).


class _AuxLossGrad(torch.autograd.Function):
    """Returns ``x`` unchanged; in the backward also sends ``scale`` as the gradient of ``aux``.

    This injects ``scale · ∂aux/∂θ`` into the backward pass without the auxiliary loss having to travel
    to the pipeline's last stage (Megatron's ``MoEAuxLossAutoScaler``).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=grad.device), None
