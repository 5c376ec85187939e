"""Design override: Tensor parallelism without autograd.Function: f is a view with a gradient hook that all-reduces
∂L/∂x, g is the straight-through sum `x + (Σx − x).detach()`.

Only what this design writes differently from reference/parallel/tensor_parallel.py:
instructor/overrides.py builds the graded module from the reference and these definitions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kit.validate import instance


def copy_to_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
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
    _check_group(group)
    total = x.detach().contiguous().clone()
    dist.all_reduce(total, group=group)
    if not x.requires_grad:
        return total
    # The straight-through trick: the value is the sum, the gradient w.r.t. x is the identity.
    return x + (total - x.detach())
