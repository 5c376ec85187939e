"""Stage 7 — the whole training step (handout/07b-whole-step.md §5).

Your ``build_train_step(config, *, world)`` runs in the worker (one process) or on 2 gloo ranks: three steps on
the same seeded global batches, each rank on its own rows. What it computed comes back as data
(:func:`kit.leaderboard.record_steps`): each step's loss, every parameter's gradient and value after the first
step. The judge (this process) runs the **naive step** itself — the kit's eager ``TransformerLM`` in fp32, the loss
on full logits, ``torch.optim.AdamW``, one process on each whole global batch — and compares with
:func:`kit.leaderboard.compare`, the leaderboard's own gate: every rank's losses over the three steps, the
gradients after the first step (and whether they look never averaged, or summed, over the ranks), the parameters
after the first step (AdamW's first update, ``lr·g/(|g| + ε)``, bounded element by element), and identical
replicas. The tolerances come from the dtypes (``kit.leaderboard.tolerances`` derives them): about 10⁻⁵ of a
gradient's largest element in fp32, 10⁻¹ with bf16 matmuls.

The fused-loss choices (``loss="fused"``) use handout 07's ``fused_linear_cross_entropy``; they fail with its
error until it works.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import pytest
import torch

import kit.impl
from kit import leaderboard
from kit.checks import outcome_of, run_checks, spawned_checks
from kit.model import ModelConfig
from kit.testing import assert_raised

pytestmark = pytest.mark.stage7

SEC = "handout 07b §5"
# The cpu leaderboard task's gate instance: 2 layers, heads of 16, a vocabulary and sequence no tile divides.
MODEL = ModelConfig(vocab_size=96, context_length=16, d_model=32, d_ff=64, num_layers=2, num_heads=2)
GLOBAL_BATCH = 8  # 4 rows per rank on 2 ranks, 2 per micro-batch with micro_batches=2
STEPS = 3
TIMEOUT = 240.0

FP32_PIECES = {"attention": "flash_pytorch", "optimizer": "fused_adamw", "micro_batches": 2,
               "activation_checkpointing": True}
SINGLE = {
    "naive": {},
    "fp32 pieces": FP32_PIECES,
    "bf16 autocast": {"dtype": "bf16_autocast", "optimizer": "fused_adamw"},
    "bf16 weights": {"dtype": "bf16", "optimizer": "fused_adamw", "attention": "flash_pytorch"},
    "fused loss fp32": {"loss": "fused", "optimizer": "fused_adamw"},
    "fused loss bf16 weights": {"loss": "fused", "dtype": "bf16", "optimizer": "fused_adamw"},
}
TWO_RANKS = {
    "naive over DDPBucketed": {"bucket_size_mb": 0.01},  # 10 KiB buckets: several per step
    "fp32 pieces": {**FP32_PIECES, "bucket_size_mb": None},
    "bf16 autocast, micro-batches": {"dtype": "bf16_autocast", "micro_batches": 2, "bucket_size_mb": 0.01},
    "fused loss bf16 weights": {"loss": "fused", "dtype": "bf16", "optimizer": "fused_adamw", "micro_batches": 2},
}


def config(**choices: Any) -> dict[str, Any]:
    """StepConfig's fields as data: the test model, seed 0, the leaderboard's AdamW options, and ``choices``. A step
    with Triton kernels runs on the GPU where there is one (``make gpu-check`` runs these tests compiled)."""
    return {"model": MODEL.as_dict(), "seed": 0, **leaderboard.OPTIMIZER, "device": device_for(choices), **choices}


def device_for(choices: dict[str, Any]) -> str:
    triton = choices.get("loss") == "fused" or choices.get("attention") == "flash_triton"
    return "cuda" if triton and torch.cuda.is_available() else "cpu"


def global_batches() -> list:
    return leaderboard.batches(MODEL, GLOBAL_BATCH, STEPS)


# ----------------------------------------------------------------------------------------------------
# In the worker and the ranks: your step, three times; data back
# ----------------------------------------------------------------------------------------------------


def _record(choices: dict[str, Any]) -> dict:
    return leaderboard.record_steps(leaderboard.impl_builder, config(**choices), global_batches())


def _two_ranks() -> dict:
    return run_checks({name: functools.partial(_record, choices) for name, choices in TWO_RANKS.items()})


two_ranks = spawned_checks(_two_ranks, 2, timeout=TIMEOUT)


def _train_step_module():
    return importlib.import_module(f"{kit.impl.load().package}.whole_step.train_step")


def _bad_configs() -> dict[str, dict]:
    module = _train_step_module()
    make = module.StepConfig
    cases = {
        "attention='sdpa'": dict(attention="sdpa"), "loss='chunked'": dict(loss="chunked"),
        "optimizer='sgd'": dict(optimizer="sgd"), "dtype='fp16'": dict(dtype="fp16"),
        "micro_batches=0": dict(micro_batches=0), "micro_batches=1.5": dict(micro_batches=1.5),
        "lr=-1": dict(lr=-1.0), "model='huge'": dict(model="huge"), "model=3": dict(model=3),
        "dtype='bf16' with optimizer='adamw'": dict(dtype="bf16", optimizer="adamw"),
        "activation_checkpointing='yes'": dict(activation_checkpointing="yes"),
    }
    out = {call: outcome_of(make, **kwargs) for call, kwargs in cases.items()}
    step = module.build_train_step(module.StepConfig(model=MODEL, micro_batches=2))
    x, y = global_batches()[0]
    step(x[:2], y[:2])  # a valid step first: a stub fails here
    out["build_train_step('tiny')"] = outcome_of(module.build_train_step, "tiny")
    out["build_train_step(world=2)"] = outcome_of(module.build_train_step, module.StepConfig(model=MODEL), world=2)
    out["step(float inputs)"] = outcome_of(step, x[:2].float(), y[:2])
    out["step(3 rows, micro_batches=2)"] = outcome_of(step, x[:3], y[:3])
    out["step(inputs (2, 16), targets (2, 15))"] = outcome_of(step, x[:2], y[:2, :-1])
    return out


# ----------------------------------------------------------------------------------------------------
# In the judge: the naive step, the gate's comparison
# ----------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def naive(shards: int) -> dict:
    """The naive step on the global batches, computed here (the choices do not change what it must equal)."""
    return leaderboard.naive_reference(config(), global_batches(), shards=shards)


def check(records: list[dict], choices: dict[str, Any], what: str) -> None:
    failures = leaderboard.compare(records, naive(len(records)), config(**choices), section=SEC)
    if failures:  # the first line is what a report shows first: the most telling failure, then the context
        raise AssertionError(f"{what}, against the naive fp32 step: {failures[0]}\n"
                             + "".join(f"{f}\n" for f in failures[1:])
                             + f"(choices: {choices or 'the naive ones'})")


def single(worker, name: str) -> None:
    check([worker.call(_record, SINGLE[name])], SINGLE[name], f"one process, {name}")


def on_two_ranks(two_ranks, name: str) -> None:
    check(two_ranks.values(name), TWO_RANKS[name], f"2 ranks, {name}")


# ----------------------------------------------------------------------------------------------------
# The tests
# ----------------------------------------------------------------------------------------------------


@pytest.mark.points(2)
def test_step_naive_choices_single_process(worker):
    """The default StepConfig: the kit's attention, full logits, torch.optim.AdamW, fp32."""
    single(worker, "naive")


@pytest.mark.builds("torch-adamw")
@pytest.mark.points(3)
def test_step_fp32_pieces_single_process(worker):
    """Your Stage 3 FlashAttention (PyTorch), FusedAdamW, 2 micro-batches, activation checkpointing, fp32."""
    single(worker, "fp32 pieces")


@pytest.mark.builds("torch-adamw")
@pytest.mark.points(2)
def test_step_bf16_autocast_single_process(worker):
    single(worker, "bf16 autocast")


@pytest.mark.builds("torch-adamw")
@pytest.mark.points(3)
def test_step_bf16_weights_single_process(worker):
    """bf16 weights, fp32 master weights and moments in FusedAdamW."""
    single(worker, "bf16 weights")


@pytest.mark.builds("triton-loss", "torch-adamw")
@pytest.mark.points(2)
def test_step_fused_loss_single_process(worker):
    """Handout 07's fused LM head + cross-entropy in place of the full logits, fp32."""
    single(worker, "fused loss fp32")


@pytest.mark.builds("triton-loss", "torch-adamw")
@pytest.mark.points(2)
def test_step_fused_loss_bf16_weights_single_process(worker):
    single(worker, "fused loss bf16 weights")


@pytest.mark.points(3)
def test_step_two_ranks_ddp_bucketed(two_ranks):
    """Your Stage 4 DDPBucketed over the world group, small buckets: gradients averaged, replicas identical."""
    on_two_ranks(two_ranks, "naive over DDPBucketed")


@pytest.mark.builds("torch-adamw")
@pytest.mark.points(3)
def test_step_two_ranks_fp32_pieces(two_ranks):
    """FlashAttention, FusedAdamW, micro-batches under no_sync, checkpointing, one bucket, on 2 ranks."""
    on_two_ranks(two_ranks, "fp32 pieces")


@pytest.mark.points(2)
def test_step_two_ranks_bf16_autocast_micro_batches(two_ranks):
    on_two_ranks(two_ranks, "bf16 autocast, micro-batches")


@pytest.mark.builds("triton-loss", "torch-adamw")
@pytest.mark.points(2)
def test_step_two_ranks_fused_loss_bf16_weights(two_ranks):
    on_two_ranks(two_ranks, "fused loss bf16 weights")


@pytest.mark.points(2)
def test_step_bad_config_rejected(worker):
    outcomes = worker.call(_bad_configs)
    expected = {
        "attention='sdpa'": (ValueError, "attention"), "loss='chunked'": (ValueError, "loss"),
        "optimizer='sgd'": (ValueError, "optimizer"), "dtype='fp16'": (ValueError, "dtype"),
        "micro_batches=0": (ValueError, "micro_batches"), "micro_batches=1.5": (TypeError, "micro_batches"),
        "lr=-1": (ValueError, "lr"), "model='huge'": (ValueError, "preset"), "model=3": (TypeError, "model"),
        "dtype='bf16' with optimizer='adamw'": (ValueError, "optimizer"),
        "activation_checkpointing='yes'": (TypeError, "activation_checkpointing"),
        "build_train_step('tiny')": (TypeError, "config"), "build_train_step(world=2)": (TypeError, "world"),
        "step(float inputs)": (ValueError, "inputs"), "step(3 rows, micro_batches=2)": (ValueError, "micro_batches"),
        "step(inputs (2, 16), targets (2, 15))": (ValueError, "targets"),
    }
    for call, (error, match) in expected.items():
        what = call if call.startswith(("build", "step(")) else f"StepConfig({call})"
        assert_raised(outcomes[call], error, match, what=what, section=SEC)

