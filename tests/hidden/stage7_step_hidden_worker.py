"""Stage 7 hidden tests (the fused AdamW and the whole step), the worker's half: what the worker and the ranks run,
and the training loop the judge also runs for its reference. No expected values, tolerances or messages here: they
stay in ``test_stage7_step_hidden.py``, which a worker cannot read while grading."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

import kit.impl
from kit import leaderboard
from kit.checks import run_checks
from kit.model import ModelConfig

STEPS = 6
ADD_GROUP_AT = 2  # a new param group (its own lr, no decay) joins after this many steps
# Another model than the public tests': 3 layers, 3 heads of 16, a vocabulary and sequence no tile divides.
OTHER = ModelConfig(vocab_size=80, context_length=12, d_model=48, d_ff=80, num_layers=3, num_heads=3)
THREE_RANKS = {"attention": "flash_pytorch", "optimizer": "fused_adamw", "dtype": "bf16_autocast",
               "micro_batches": 2, "bucket_size_mb": None}
FLASH_TRITON = {"attention": "flash_triton", "optimizer": "fused_adamw"}


def schedule_run(make: Callable[..., torch.optim.Optimizer], dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """Two parameters at lr 1e-2 decaying by 0.7 a step; a third joins as a new group (lr 5e-3, no weight decay)
    after ``ADD_GROUP_AT`` steps. The parameters after each step."""
    g = torch.Generator().manual_seed(11)
    params = {n: torch.randn(s, generator=g).to(dtype).requires_grad_() for n, s in
              (("a", (5, 4)), ("b", (4,)), ("c", (3, 3)))}
    optimizer = make([params["a"], params["b"]], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    after = []
    for step in range(STEPS):
        if step == ADD_GROUP_AT:
            optimizer.add_param_group({"params": [params["c"]], "lr": 5e-3, "weight_decay": 0.0})
        optimizer.param_groups[0]["lr"] = 1e-2 * 0.7**step
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        optimizer.step()
        after.append({n: p.detach().clone() for n, p in params.items()})
    return after


def adamw_schedule() -> list[dict[str, torch.Tensor]]:
    module = importlib.import_module(f"{kit.impl.load().package}.whole_step.fused_adamw")
    return schedule_run(module.FusedAdamW, torch.float32)


def config(model: ModelConfig, **choices: Any) -> dict[str, Any]:
    """A step with the Triton FlashAttention runs on the GPU where there is one (``make gpu-check`` runs the hidden
    tests compiled)."""
    gpu = choices.get("attention") == "flash_triton" and torch.cuda.is_available()
    return {"model": model.as_dict(), "seed": 3, **leaderboard.OPTIMIZER, "device": "cuda" if gpu else "cpu",
            **choices}


def other_batches(global_batch: int) -> list:
    return leaderboard.batches(OTHER, global_batch, 3, seed=500)


def three_ranks() -> dict:
    return run_checks({"three ranks": lambda: leaderboard.record_steps(
        leaderboard.impl_builder, config(OTHER, **THREE_RANKS), other_batches(6))})


def flash_triton_single() -> dict:
    return leaderboard.record_steps(leaderboard.impl_builder, config(OTHER, **FLASH_TRITON), other_batches(2)[:2])
