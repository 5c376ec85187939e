"""Stage 7 (fused loss) hidden checks, the worker's half: run the implementation, return what it computed (data).

The judge's half (tests/hidden/test_stage7_fused_loss_hidden.py) holds the inputs' construction, the references,
tolerances and messages; this module is the only part of the hidden tests a worker can read.
"""

from __future__ import annotations

import importlib

import torch

import kit.impl
from kit.model import TransformerLM


def _loss():
    return importlib.import_module(f"{kit.impl.selected()}.whole_step.fused_cross_entropy").fused_linear_cross_entropy


def loss_and_grads(h, w, t, upstream: float, grad_hidden: bool = True, grad_weight: bool = True) -> dict:
    """The loss, and the gradients of ``upstream · loss`` for the inputs that require them (None for the others)."""
    leaf_h, leaf_w = h.clone().requires_grad_(grad_hidden), w.clone().requires_grad_(grad_weight)
    loss = _loss()(leaf_h, leaf_w, t)
    (loss * upstream).backward()
    return {"loss": loss.detach(), "dh": leaf_h.grad, "dw": leaf_w.grad}


def transformer_step(state: dict, tokens: torch.Tensor, targets: torch.Tensor) -> dict:
    """TransformerLM("tiny") loaded with ``state``: the fused loss of its hidden states and LM-head weight, and the
    gradient of every parameter."""
    model = TransformerLM("tiny").to(tokens.device)
    model.load_state_dict(state)
    loss = _loss()(model.hidden_states(tokens), model.lm_head.weight, targets)
    loss.backward()
    return {"loss": loss.detach(), "grads": [[name, p.grad] for name, p in model.named_parameters()]}
