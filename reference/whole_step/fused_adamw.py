"""AdamW, fused (handout 07b §4). SKELETON: the whole-step helper writes this module.

Public API (the tests call exactly this):

    FusedAdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, master_weights=False)

a ``torch.optim.Optimizer`` whose ``step()`` updates each parameter group without a Python loop over its
tensors, equal to ``torch.optim.AdamW`` (decoupled weight decay, bias correction) up to rounding; with
``master_weights=True`` 16-bit parameters are updated through an fp32 copy kept in the optimizer state.
"""

from __future__ import annotations

import torch

__all__ = ["FusedAdamW"]


class FusedAdamW(torch.optim.Optimizer):
    """See the module docstring."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, master_weights: bool = False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.master_weights = master_weights

    @torch.no_grad()
    def step(self, closure=None):
        # BEGIN SOLUTION the skeleton's placeholder: the whole-step helper replaces it (handout 07b §4)
        raise NotImplementedError("skeleton")
        # END SOLUTION
