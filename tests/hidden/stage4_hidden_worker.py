"""Stage 4 hidden tests — the worker half: what runs on the ranks that load the implementation.

The judge half (``test_stage4_hidden.py``) imports this module for the shared setup (models, batches, loss)
and keeps every expected value, tolerance and message; while grading, this is the only part of the hidden
tests a worker can read. Each rank trains and returns its parameters after every step, one named check per
DDP class (``kit.checks.run_checks``), so the classes that finished are judged before a later one's failure.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import kit.impl
from kit.checks import run_checks
from kit.model import ModelConfig, TransformerLM

WORLD = 2
TINY_LM = ModelConfig(vocab_size=64, context_length=8, d_model=16, d_ff=32, num_layers=1, num_heads=2)
KINDS = ("naive", "flat", "individual", "bucketed")
SUBGROUP_STEPS = 2
ACCUMULATION_KINDS = ("individual", "bucketed")
ACCUMULATION_STEPS = 3
BUCKET_MB = 0.001  # DDPBucketed's cap, and torch DDP's bucket_cap_mb in the judge's reference


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TransformerLM(TINY_LM)


def batch(step: int, rank: int | None = None, parts: int = WORLD) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, TINY_LM.vocab_size, (8, TINY_LM.context_length + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    if rank is None:
        return x, y
    size = 8 // parts
    return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters now, by name (copies: training goes on in place)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _wrap(impl, kind: str, model: nn.Module, **kwargs):
    if kind == "naive":
        return impl.ddp.NaiveDDP(model, **kwargs)
    if kind == "flat":
        return impl.ddp.FlatDDP(model, **kwargs)
    if kind == "individual":
        return impl.ddp.DDPIndividualParameters(model, **kwargs)
    return impl.ddp.DDPBucketed(model, BUCKET_MB, **kwargs)


def _alone_in_a_group(impl, kind: str, alone) -> list[dict]:
    """DDP over this rank's own one-rank group, SGD; the parameters after each step."""
    rank = dist.get_rank()
    model = build(10 + rank)
    ddp = _wrap(impl, kind, model, process_group=alone)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out = []
    for step in range(SUBGROUP_STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        ddp.on_train_batch_start()
        loss(ddp, x, y).backward()
        ddp.finish_gradient_synchronization()
        opt.step()
        out.append(params(model))
    return out


def subgroup_rank() -> dict:
    """Each rank is its own process group: DDP over it must neither broadcast nor average across ranks."""
    impl = kit.impl.load()
    alone, _ = dist.new_subgroups(group_size=1)
    return run_checks({kind: (lambda kind=kind: _alone_in_a_group(impl, kind, alone)) for kind in KINDS})


def _with_accumulation(impl, kind: str) -> list[dict]:
    """AdamW, two micro-batches per step (the first inside no_sync); the parameters after each step."""
    rank = dist.get_rank()
    model = build(rank)
    ours = _wrap(impl, kind, model)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for step in range(ACCUMULATION_STEPS):
        x, y = batch(step, rank)
        opt.zero_grad(set_to_none=True)
        ours.on_train_batch_start()
        with ours.no_sync():
            (loss(ours, x[:2], y[:2]) / 2).backward()
        (loss(ours, x[2:], y[2:]) / 2).backward()
        ours.finish_gradient_synchronization()
        opt.step()
        out.append(params(model))
    return out


def accumulation_rank() -> dict:
    impl = kit.impl.load()
    return run_checks({kind: (lambda kind=kind: _with_accumulation(impl, kind)) for kind in ACCUMULATION_KINDS})
