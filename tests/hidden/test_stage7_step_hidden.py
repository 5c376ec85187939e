"""Stage 7 — instructor-only checks of the fused AdamW and the whole step: a learning-rate schedule and a param
group added after some steps; the step on 3 ranks on another model (bf16 autocast, micro-batches, one bucket);
the step with the Triton FlashAttention.

The judge's half: the worker and the ranks run ``stage7_step_hidden_worker`` and return what they computed; the
references (float64 torch.optim.AdamW through the same schedule, the kit's naive step) are computed here and
compared here, with the public tests' tolerances.
"""

from __future__ import annotations

import pytest
import torch
from stage7_step_hidden_worker import (
    FLASH_TRITON,
    OTHER,
    STEPS,
    THREE_RANKS,
    adamw_schedule,
    config,
    flash_triton_single,
    other_batches,
    schedule_run,
    three_ranks,
)

from kit import leaderboard
from kit.checks import spawned_checks
from kit.testing import assert_close

# Each test runs FusedAdamW (directly, or as the step's optimizer='fused_adamw'): tests/test_stage7_rules.py.
pytestmark = [pytest.mark.stage7, pytest.mark.hidden, pytest.mark.builds("torch-adamw")]

U32 = 2.0**-24
hidden_ranks = spawned_checks(three_ranks, 3, timeout=300)


@pytest.mark.points(2)
def test_hidden_adamw_lr_schedule_and_new_group(worker) -> None:
    got = worker.call(adamw_schedule)
    expected = schedule_run(torch.optim.AdamW, torch.float64)
    for step, (g, e) in enumerate(zip(got, expected), start=1):
        for name in e:
            # The public tests' fp32 bound (test_stage7_adamw's docstring: 2T·u·|p| + (6T + 1.5T²)·u·lr·R, doubled),
            # with lr ≤ 1e-2 for every group and step and R ≤ 10 (|m̂/(√v̂ + ε)| stays below 3 for these gradients).
            atol = 2 * (6 * step + 1.5 * step * step) * U32 * 1e-2 * 10
            assert_close(g[name], e[name], name=f"parameter {name!r} after step {step} (lr 1e-2·0.7^t; 'c' joins as "
                         "a new group after step 2)", section="handout 07b §4", rtol=4 * step * U32, atol=atol)
    assert STEPS == len(got)


def _check(records: list[dict], choices: dict, batches: list, what: str) -> None:
    reference = leaderboard.naive_reference(config(OTHER), batches, shards=len(records))
    failures = leaderboard.compare(records, reference, config(OTHER, **choices), section="handout 07b §5")
    if failures:
        raise AssertionError(f"{what}, against the naive fp32 step: {failures[0]}\n" + "\n".join(failures[1:]))


@pytest.mark.points(3)
def test_hidden_step_three_ranks_another_model(hidden_ranks) -> None:
    _check(hidden_ranks.values("three ranks"), THREE_RANKS, other_batches(6),
           "3 ranks, another model (d 48, 3 layers, 3 heads), bf16 autocast, 2 micro-batches, one bucket")


@pytest.mark.points(2)
def test_hidden_step_flash_triton_single_process(worker) -> None:
    _check([worker.call(flash_triton_single)], FLASH_TRITON, other_batches(2)[:2],
           "one process, the Triton FlashAttention, fp32")
