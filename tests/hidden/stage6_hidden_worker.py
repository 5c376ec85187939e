"""Stage 6 hidden checks, the workers' half: what the ranks run, and the seeded inputs they share with the judge.

The judge's half (expected values, tolerances, messages) is ``test_stage6_hidden.py``; only this file is
readable by a worker while grading.
"""

from __future__ import annotations

import torch

import kit.impl
from kit.checks import run_checks
from kit.model import ModelConfig, TransformerLM

CFG = ModelConfig(vocab_size=32, context_length=8, d_model=16, d_ff=32, num_layers=2, num_heads=2)
MOE = dict(d_model=8, d_ff=16, num_experts=6, top_k=1, capacity_factor=None)


def model_and_batch():
    torch.manual_seed(11)
    model = TransformerLM(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (3, 7), generator=torch.Generator().manual_seed(12))
    return model, [(tokens[:, :-1], tokens[:, 1:])]


def make_moe(moe_class):
    """A dropless top-1 layer: the implementation's ``MoEFeedForward`` in a rank, the judge's ``ReferenceMoE``
    there (created the same way, so with the same weights)."""
    torch.manual_seed(13)
    return moe_class(MOE["d_model"], MOE["d_ff"], MOE["num_experts"], top_k=MOE["top_k"],
                     capacity_factor=MOE["capacity_factor"])


def moe_input(rank: int) -> torch.Tensor:
    return torch.randn(5, MOE["d_model"], generator=torch.Generator().manual_seed(20 + rank))


def _pipeline_one_microbatch(impl) -> dict:
    """One micro-batch through two stages: fewer micro-batches than stages must not hang."""
    import torch.distributed as dist

    pp = impl.parallel.pipeline_parallel
    model, batches = model_and_batch()
    stage = pp.PipelineStage(model, dist.get_rank(), 2)
    res = pp.one_f_one_b(stage, batches, group=None, activation_shape=(3, 6, CFG.d_model))
    return {"loss": res.loss, "grads": {n: p.grad.clone() for n, p in stage.named_parameters()}}


def _dropless_moe(impl) -> dict:
    """Dropless top-1 routing, three experts per rank."""
    import torch.distributed as dist

    ep = impl.parallel.expert_parallel
    moe = ep.parallelize_moe(make_moe(ep.MoEFeedForward), None)
    x = moe_input(dist.get_rank()).requires_grad_()
    y = moe(x)
    y.pow(2).sum().backward()
    return {"y": y.detach(), "dropped": moe.dropped_tokens, "x_grad": x.grad}


def rank_fn() -> dict:
    impl = kit.impl.load()
    return run_checks({"pipe": lambda: _pipeline_one_microbatch(impl), "moe": lambda: _dropless_moe(impl)})


# Context parallelism's sequence shards, without ranks: an odd micro-batch size and cp = 4, both layouts.
CP_SHARDS = dict(dp=1, tp=1, pp=1, ep=1, cp=4, global_batch_size=6, micro_batch_size=3, grad_accum_steps=2,
                 seq_len=16)


def cp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, 32, (2, 3, 17), generator=torch.Generator().manual_seed(14))
    return [(tokens[i, :, :-1], tokens[i, :, 1:]) for i in range(2)]


def sequence_shards_by_rank(layout: str) -> list:
    """Each cp rank's ``sequence_shards`` of the same two micro-batches."""
    t4 = kit.impl.load().parallel.train_4d
    cfg = t4.Train4DConfig(**CP_SHARDS, cp_layout=layout)
    return [t4.sequence_shards(cfg, cp_batches(), r) for r in range(cfg.cp)]
