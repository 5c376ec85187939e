"""Stage 4 — instructor-only checks: DDP over a subgroup, and agreement with torch's own DDP."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import kit.impl
from kit.checks import run_check
from kit.model import ModelConfig, TransformerLM
from kit.testing import assert_close

pytestmark = [pytest.mark.stage4, pytest.mark.hidden]

WORLD = 2
TINY_LM = ModelConfig(vocab_size=64, context_length=8, d_model=16, d_ff=32, num_layers=1, num_heads=2)


def _build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TransformerLM(TINY_LM)


def _batch(step: int, rank: int | None = None, parts: int = WORLD) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, TINY_LM.vocab_size, (8, TINY_LM.context_length + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    if rank is None:
        return x, y
    size = 8 // parts
    return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _wrap(impl, kind: str, model: nn.Module, **kwargs):
    if kind == "naive":
        return impl.ddp.NaiveDDP(model, **kwargs)
    if kind == "flat":
        return impl.ddp.FlatDDP(model, **kwargs)
    if kind == "individual":
        return impl.ddp.DDPIndividualParameters(model, **kwargs)
    return impl.ddp.DDPBucketed(model, 0.001, **kwargs)


def _subgroup_rank() -> None:
    """Each rank is its own process group: DDP over it must neither broadcast nor average across ranks."""
    impl = kit.impl.load()
    rank = dist.get_rank()
    alone, _ = dist.new_subgroups(group_size=1)
    for kind in ("naive", "flat", "individual", "bucketed"):
        model, reference = _build(10 + rank), _build(10 + rank)
        ddp = _wrap(impl, kind, model, process_group=alone)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(2):
            x, y = _batch(step, rank)
            ref_opt.zero_grad()
            _loss(reference, x, y).backward()
            ref_opt.step()
            opt.zero_grad()
            ddp.on_train_batch_start()
            _loss(ddp, x, y).backward()
            ddp.finish_gradient_synchronization()
            opt.step()
            for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
                assert_close(p, q, name=f"rank {rank}, {kind} over a one-rank process_group, step {step + 1}: {name} "
                             "(vs this rank training alone)", section="handout 04 §1", rtol=1e-5, atol=1e-6)


def _torch_ddp_rank() -> None:
    """AdamW with two accumulated micro-batches: ours vs torch.nn.parallel.DistributedDataParallel."""
    impl = kit.impl.load()
    rank = dist.get_rank()
    for kind in ("individual", "bucketed"):
        ours_model, theirs_model = _build(rank), _build(rank)
        ours = _wrap(impl, kind, ours_model)
        theirs = DistributedDataParallel(theirs_model, bucket_cap_mb=0.001)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ours, theirs)]
        for step in range(3):
            x, y = _batch(step, rank)
            for model, opt in zip((ours, theirs), opts):
                opt.zero_grad(set_to_none=True)
                if model is ours:
                    ours.on_train_batch_start()
                with model.no_sync():
                    (_loss(model, x[:2], y[:2]) / 2).backward()
                (_loss(model, x[2:], y[2:]) / 2).backward()
                if model is ours:
                    ours.finish_gradient_synchronization()
                opt.step()
            for (name, p), (_, q) in zip(ours_model.named_parameters(), theirs_model.named_parameters()):
                assert_close(p, q, name=f"rank {rank}, {kind} vs torch DDP, step {step + 1}: {name}",
                             section="handout 04 §5", rtol=1e-5, atol=1e-6)


@pytest.mark.points(2)
def test_process_group_is_respected() -> None:
    run_check(_subgroup_rank, WORLD, timeout=120)


@pytest.mark.points(2)
def test_matches_torch_ddp_with_accumulation() -> None:
    run_check(_torch_ddp_rank, WORLD, timeout=120)
