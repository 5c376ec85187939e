"""Stage 6 hidden checks: edge cases the public tests do not pin down (instructor only)."""

from __future__ import annotations

import pytest
import torch

from kit.checks import run_checks, spawned_checks
from kit.model import ModelConfig, TransformerLM, cross_entropy
from kit.testing import assert_close, assert_equal

pytestmark = [pytest.mark.stage6, pytest.mark.hidden]

CFG = ModelConfig(vocab_size=32, context_length=8, d_model=16, d_ff=32, num_layers=2, num_heads=2)
MOE = dict(d_model=8, d_ff=16, num_experts=6, top_k=1, capacity_factor=None)


def _model_and_batch():
    torch.manual_seed(11)
    model = TransformerLM(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (3, 7), generator=torch.Generator().manual_seed(12))
    return model, [(tokens[:, :-1], tokens[:, 1:])]


def _moe(impl):
    torch.manual_seed(13)
    return impl.parallel.expert_parallel.MoEFeedForward(MOE["d_model"], MOE["d_ff"], MOE["num_experts"],
                                                        top_k=MOE["top_k"], capacity_factor=MOE["capacity_factor"])


def _x(rank: int) -> torch.Tensor:
    return torch.randn(5, MOE["d_model"], generator=torch.Generator().manual_seed(20 + rank))


def _pipeline_one_microbatch(impl) -> dict:
    """One micro-batch through two stages: fewer micro-batches than stages must not hang."""
    import torch.distributed as dist

    pp = impl.parallel.pipeline_parallel
    model, batches = _model_and_batch()
    stage = pp.PipelineStage(model, dist.get_rank(), 2)
    res = pp.one_f_one_b(stage, batches, group=None, activation_shape=(3, 6, CFG.d_model))
    return {"loss": res.loss, "grads": {n: p.grad.clone() for n, p in stage.named_parameters()}}


def _dropless_moe(impl) -> dict:
    """Dropless top-1 routing, three experts per rank."""
    import torch.distributed as dist

    moe = impl.parallel.expert_parallel.parallelize_moe(_moe(impl), None)
    x = _x(dist.get_rank()).requires_grad_()
    y = moe(x)
    y.pow(2).sum().backward()
    return {"y": y.detach(), "dropped": moe.dropped_tokens, "x_grad": x.grad}


def _rank_fn() -> dict:
    import kit.impl

    impl = kit.impl.load()
    return run_checks({"pipe": lambda: _pipeline_one_microbatch(impl), "moe": lambda: _dropless_moe(impl)})


hidden_results = spawned_checks(_rank_fn, 2, timeout=90)


@pytest.mark.points(1)
def test_pipeline_with_fewer_microbatches_than_stages_hidden(hidden_results):
    ranks = hidden_results.values("pipe")
    model, batches = _model_and_batch()
    loss = cross_entropy(model(batches[0][0]), batches[0][1])
    loss.backward()
    grads = dict(model.named_parameters())
    for r, v in enumerate(ranks):
        assert abs(v["loss"] - loss.item()) < 1e-5, f"rank {r}: loss {v['loss']} vs {loss.item()} (handout 06 §3.3)"
        for name, g in v["grads"].items():
            assert_close(g, grads[name].grad, name=f"stage {r}: gradient of {name}, m=1 < p=2",
                         section="handout 06 §3.3", rtol=1e-4, atol=1e-6)


@pytest.mark.points(1)
def test_dropless_top1_expert_parallel_hidden(hidden_results, impl):
    ranks = hidden_results.values("moe")
    for r, v in enumerate(ranks):
        moe = _moe(impl)
        x = _x(r).requires_grad_()
        y = moe(x)
        y.pow(2).sum().backward()
        assert_equal(v["dropped"], 0, name=f"rank {r}: dropped assignments without a capacity limit",
                     section="handout 06 §4.1")
        assert_close(v["y"], y, name=f"rank {r}: dropless top-1 MoE output", section="handout 06 §4.2",
                     rtol=1e-5, atol=1e-6)
        assert_close(v["x_grad"], x.grad, name=f"rank {r}: ∂L/∂x", section="handout 06 §4.2", rtol=1e-5, atol=1e-6)
