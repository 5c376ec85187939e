"""Tensor parallelism: split each layer's matrices across the ranks of the ``tp`` group (handout 06 §2).

Megatron's recipe for a two-matrix block ``y = B(σ(A x))``: split ``A`` by output columns
(:class:`ColumnParallelLinear`, each rank computes a slice of the hidden features, no communication) and
``B`` by input rows (:class:`RowParallelLinear`, each rank computes a partial sum of the output). One
all-reduce of the output completes the forward. Two conjugate operators place the communication:

* **f** — :func:`copy_to_tensor_parallel`: identity in the forward, all-reduce of the gradient in the
  backward (every rank's slice contributed to ∂L/∂x).
* **g** — :func:`reduce_from_tensor_parallel`: all-reduce in the forward (sum the partial outputs),
  identity in the backward (the summed output's gradient reaches every partial sum unchanged).

So a block costs one all-reduce forward and one backward. :func:`parallelize_block` applies this to
attention (heads split across ranks: q/k/v column-parallel, output projection row-parallel) and to the
SwiGLU feed-forward (w1, w3 column-parallel; w2 row-parallel) of the kit's unchanged ``Block``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kit.validate import instance


def copy_to_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Megatron's **f**: returns ``x`` unchanged; in the backward, all-reduces ∂L/∂x over ``group``."""
    _check_group(group)
    y = x.view_as(x)
    if y.requires_grad:
        # A tensor hook rewrites the gradient flowing back through y before it reaches x.
        def all_reduce_grad(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=group)
            return grad

        y.register_hook(all_reduce_grad)
    return y


def reduce_from_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Megatron's **g**: returns the sum of ``x`` over ``group``; the backward passes ∂L/∂y unchanged."""
    _check_group(group)
    total = x.detach().contiguous().clone()
    dist.all_reduce(total, group=group)
    if not x.requires_grad:
        return total
    # The straight-through trick: the value is the sum, the gradient w.r.t. x is the identity.
    return x + (total - x.detach())


class ColumnParallelLinear(nn.Module):
    """``y = x Aᵀ`` with ``A`` (out, in) split by rows of ``A`` — output features — across ``group``.

    This rank holds ``weight`` of shape ``(out_features / tp, in_features)``: rows
    ``[rank·out/tp, (rank+1)·out/tp)`` of the full matrix. Input ``x (..., in)`` is replicated on every
    rank; the output ``(..., out/tp)`` is this rank's slice of the features (or the full ``(..., out)``
    with ``gather_output=True``). fp32 or any float dtype; the output has x's dtype.

    ``copy_input=False`` skips **f** on the input: use it when several column-parallel layers read the
    same input and **f** is applied once before them (as :func:`parallelize_block` does for q, k, v).
    """

    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup | None = None, *, gather_output: bool = False,
                 copy_input: bool = True):
        super().__init__()
        _check_group(group)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(f"weight must be a 2-D tensor (the full (out, in) matrix), got {weight!r:.60}")
        self.group = group
        self.gather_output = gather_output
        self.copy_input = copy_input
        self.tp = dist.get_world_size(group)
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.weight = nn.Parameter(_shard(weight, 0, group, "ColumnParallelLinear weight"))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup | None = None, **kwargs) -> ColumnParallelLinear:
        """Shard an existing bias-free ``nn.Linear`` (each rank keeps its slice of the same full weight)."""
        if not isinstance(linear, nn.Linear) or linear.bias is not None:
            raise TypeError(f"linear must be an nn.Linear without bias, got {linear!r}")
        return cls(linear.weight, group, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tensor_parallel(x, self.group)
        y = F.linear(x, self.weight)
        if self.gather_output:
            y = gather_from_tensor_parallel(y, self.group)
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp}, gather_output={self.gather_output}"


class RowParallelLinear(nn.Module):
    """``y = x Bᵀ`` with ``B`` (out, in) split by columns — input features — across ``group``.

    This rank holds ``weight`` of shape ``(out_features, in_features / tp)``. Input ``x (..., in/tp)`` is
    this rank's slice of the features (the output of a :class:`ColumnParallelLinear`); the output
    ``(..., out)`` is the full result, identical on every rank after the all-reduce.
    """

    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup | None = None):
        super().__init__()
        _check_group(group)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(f"weight must be a 2-D tensor (the full (out, in) matrix), got {weight!r:.60}")
        self.group = group
        self.tp = dist.get_world_size(group)
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.weight = nn.Parameter(_shard(weight, 1, group, "RowParallelLinear weight"))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup | None = None) -> RowParallelLinear:
        """Shard an existing bias-free ``nn.Linear``."""
        if not isinstance(linear, nn.Linear) or linear.bias is not None:
            raise TypeError(f"linear must be an nn.Linear without bias, got {linear!r}")
        return cls(linear.weight, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] * self.tp != self.in_features:
            raise ValueError(
                f"RowParallelLinear expects this rank's slice of {self.in_features}/{self.tp} input features, "
                f"got x with last dimension {x.shape[-1]}"
            )
        return reduce_from_tensor_parallel(F.linear(x, self.weight), self.group)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp}"


def parallelize_block(block: nn.Module, tp_group: dist.ProcessGroup | None) -> nn.Module:
    """Split one kit ``Block`` across the tensor-parallel group, in place; returns the block.

    Attention: ``q_proj``, ``k_proj``, ``v_proj`` become :class:`ColumnParallelLinear` (each rank gets
    ``num_heads / tp`` whole heads — the attention itself needs no communication), ``output_proj``
    becomes :class:`RowParallelLinear`. A SwiGLU ``ffn`` (``w1``, ``w2``, ``w3``): w1 and w3 column-, w2
    row-parallel. A feed-forward whose ``w1`` is not an ``nn.Linear`` (a mixture of experts) is left to
    expert parallelism. Norms stay replicated. **f** is applied once at the input of ``attn`` and of the
    SwiGLU ``ffn`` (forward pre-hooks), so a block costs exactly one all-reduce per sub-layer in the
    forward (g in the row-parallel layers) and one per sub-layer in the backward (f).
    ``tp_group`` may be a ``ProcessGroup`` or a 1-D ``DeviceMesh``.

    Raises:
        ValueError: the number of heads or ``d_ff`` is not divisible by the tp size.
    """
    group = tp_group.get_group() if hasattr(tp_group, "get_group") else tp_group
    _check_group(group)
    if not hasattr(block, "attn") or not hasattr(block.attn, "q_proj"):
        raise TypeError(f"block must be a kit.model.Block (with attn.q_proj …), got {type(block).__name__}")
    tp = dist.get_world_size(group)
    heads = block.attn.q_proj.out_features // block.attn.d_head
    if heads % tp:
        raise ValueError(f"parallelize_block: {heads} attention heads are not divisible by the tp size {tp}")
    ffn = block.ffn
    if hasattr(ffn, "w1") and isinstance(ffn.w1, nn.Linear) and ffn.w1.out_features % tp:
        raise ValueError(f"parallelize_block: d_ff = {ffn.w1.out_features} is not divisible by the tp size {tp}")

    # f once at the input of each sub-layer (not once per column-parallel projection).
    def apply_f(module: nn.Module, args: tuple) -> tuple:
        return (copy_to_tensor_parallel(args[0], group), *args[1:])

    attn = block.attn
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, ColumnParallelLinear.from_linear(getattr(attn, name), group, copy_input=False))
    attn.output_proj = RowParallelLinear.from_linear(attn.output_proj, group)
    attn.register_forward_pre_hook(apply_f)
    if hasattr(ffn, "w1") and isinstance(ffn.w1, nn.Linear):
        ffn.w1 = ColumnParallelLinear.from_linear(ffn.w1, group, copy_input=False)
        ffn.w3 = ColumnParallelLinear.from_linear(ffn.w3, group, copy_input=False)
        ffn.w2 = RowParallelLinear.from_linear(ffn.w2, group)
        ffn.register_forward_pre_hook(apply_f)
    return block


# ------------------------------------------------------------------------------------------------------
# Given helpers: argument checks, weight sharding, and the all-gather used by ColumnParallelLinear(gather_output=True).


def _check_group(group: object) -> None:
    instance("group", group, (dist.ProcessGroup, type(None)), "a torch.distributed ProcessGroup or None")


def _shard(weight: torch.Tensor, dim: int, group: dist.ProcessGroup | None, what: str) -> torch.Tensor:
    """This rank's contiguous slice of ``weight`` along ``dim`` (a copy)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if weight.shape[dim] % size:
        raise ValueError(f"{what}: dimension {dim} of size {weight.shape[dim]} is not divisible by the tp size {size}")
    return weight.detach().chunk(size, dim=dim)[rank].clone()


class _GatherFromTensorParallel(torch.autograd.Function):
    """All-gather along the last dimension forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


def gather_from_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x (..., n)`` along the last dimension → ``(..., n·tp)`` (given helper)."""
    _check_group(group)
    return _GatherFromTensorParallel.apply(x, group)
