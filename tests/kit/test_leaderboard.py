"""The leaderboard (kit/leaderboard/): its gate rejects a step with a wrong loss and one with a wrong gradient and
lets the naive step through; an entry is written, stamped and hashed; ``--collect`` ranks entries and lists the
failed, edited and mismatched ones; GPU tasks refuse to start without their GPUs. Plus the claim of handout 07b §4
that the reference ``FusedAdamW`` equals ``torch.optim.AdamW`` bit for bit.

The wrong steps below are the kit's naive step with one mistake each; the gate runs them in 2 gloo ranks, as it runs a
student's step.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kit import leaderboard
from kit.model import ModelConfig, cross_entropy

ROOT = Path(__file__).resolve().parents[2]
CPU = leaderboard.TASKS["cpu"]
# A task small enough to gate and time in seconds: the cpu task's gate instance, timed for 2 steps.
QUICK = dataclasses.replace(CPU, name="cpu", model=CPU.gate_model, warmup=1, steps=2)


# ----------------------------------------------------------------------------------------------------
# Wrong steps (module level: the ranks find them by name)
# ----------------------------------------------------------------------------------------------------


class _WrongLoss(leaderboard.NaiveStep):
    """Right training, wrong report: the loss returned is 1 % too high."""

    def __call__(self, inputs, targets) -> float:
        return 1.01 * super().__call__(inputs, targets)


class _SummedGradients(leaderboard.NaiveStep):
    """Right loss, wrong gradient: the gradients are summed over the ranks, never divided by the world size."""

    def __init__(self, config, world):
        super().__init__(config, None)
        self.world = world

    def __call__(self, inputs, targets) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = cross_entropy(self.model(inputs), targets)
        loss.backward()
        for p in self.model.parameters():
            dist.all_reduce(p.grad, group=self.world)
        self.optimizer.step()
        total = loss.detach()
        dist.all_reduce(total, group=self.world)
        return float(total) / dist.get_world_size(self.world)


def wrong_loss_builder(config, world):
    return _WrongLoss(config, world)


def summed_gradients_builder(config, world):
    return _SummedGradients(config, world)


# ----------------------------------------------------------------------------------------------------
# The gate
# ----------------------------------------------------------------------------------------------------


def test_gate_lets_the_naive_step_through():
    result = leaderboard.gate(CPU, {}, leaderboard.naive_builder)
    assert result.passed, "\n".join(result.failures)
    assert len(result.losses) == CPU.gate_steps


def test_gate_rejects_a_wrong_loss():
    result = leaderboard.gate(CPU, {}, wrong_loss_builder)
    assert not result.passed
    assert "the loss of step 1" in result.failures[0], result.failures


def test_gate_rejects_a_wrong_gradient_and_says_why():
    result = leaderboard.gate(CPU, {}, summed_gradients_builder)
    assert not result.passed
    assert "the gradient of" in result.failures[0], result.failures
    assert "summed over the 2 ranks" in result.failures[0], result.failures


def test_gate_reports_a_step_that_raises():
    result = leaderboard.gate(CPU, {"attention": "no-such-attention"}, leaderboard.impl_builder)
    assert not result.passed and "did not run" in result.failures[0]


def test_tolerances_grow_with_the_rounding_of_the_dtype():
    config = leaderboard.step_config(CPU, {}, gate=True)
    seen = {"logit_rms": 0.7, "loss": 4.8}  # the Stage 7 test model's first step
    fp32 = leaderboard.tolerances(config, 128, **seen)
    bf16 = leaderboard.tolerances({**config, "dtype": "bf16_autocast"}, 128, **seen)
    weights = leaderboard.tolerances({**config, "dtype": "bf16"}, 128, **seen)
    assert fp32.grad < 1e-4 < 1e-2 < bf16.grad < 0.2
    assert weights.param_rounding > bf16.param_rounding == fp32.param_rounding
    # The loss: from the forward's half of the roundings, the logits' size and √tokens, plus the fp32 sum.
    c_f = 4 * (config["model"]["num_layers"] + 1)
    assert fp32.loss_atol == pytest.approx(4 * 2**0.5 * c_f * (fp32.grad / (2 * c_f)) * 0.7 / 128**0.5
                                           + 128**0.5 * 2**-24 * 4.8)
    # A bf16 step's loss may differ by well under the 2⁻⁹ relative rounding of a loss stored in bf16.
    assert 0.0 < bf16.loss_atol < 2**-9 * 4.8 * 2


def test_options_that_the_task_fixes_are_refused():
    with pytest.raises(ValueError, match="fixed by the task"):
        leaderboard.step_config(CPU, {"lr": 1.0}, gate=False)
    with pytest.raises(ValueError, match="the choices are"):
        leaderboard.step_config(CPU, {"colour": "blue"}, gate=False)


# ----------------------------------------------------------------------------------------------------
# Entries and --collect
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def entries(tmp_path_factory) -> Path:
    """A folder with a naive entry (timed), a failed one, an edited one, and one whose code does not match."""
    folder = tmp_path_factory.mktemp("entries")
    code = folder / "code"
    (code / "student").mkdir(parents=True)
    (code / "student" / "step.py").write_text("x = 1\n")
    quiet = dict(log=lambda _: None)
    good = leaderboard.run_entry(QUICK, kind="naive", builder=leaderboard.naive_builder, name="naive", **quiet)
    leaderboard.write_entry(good, folder)
    bad = leaderboard.run_entry(QUICK, kind="student", builder=wrong_loss_builder, name="wrong", log=lambda _: None)
    leaderboard.write_entry(bad, folder)
    edited = dict(good, name="edited")
    edited["timing"] = dict(good["timing"], median_s=good["timing"]["median_s"] / 10)
    (folder / "edited.json").write_text(json.dumps(edited))
    mine = leaderboard.run_entry(QUICK, kind="student", builder=leaderboard.naive_builder, name="mine",
                                 code=code / "student", log=lambda _: None)
    (folder / "mine.json").write_text(json.dumps(mine))
    (folder / "mine" / "student").mkdir(parents=True)
    (folder / "mine" / "student" / "step.py").write_text("x = 2  # not what was timed\n")
    return folder


def test_an_entry_is_stamped_hashed_and_timed(entries):
    entry = json.loads(next(entries.glob("cpu-naive-*.json")).read_text())
    assert entry["gate"]["passed"] and entry["within_budget"]
    assert entry["entry_sha256"] == leaderboard.entry_hash(entry)
    for key in ("device", "torch", "date", "command"):
        assert entry["environment"].get(key)
    timing = entry["timing"]
    assert len(timing["times_s"]) == QUICK.steps and timing["min_s"] <= timing["median_s"] <= timing["max_s"]
    assert timing["tokens_per_s"] == pytest.approx(QUICK.tokens / timing["median_s"])
    assert timing["mfu"] is None  # a CPU has no peak in kit/flops.py


def test_a_failed_gate_gets_no_time(entries):
    entry = json.loads(next(entries.glob("cpu-wrong-*.json")).read_text())
    assert not entry["gate"]["passed"] and "timing" not in entry


def test_collect_ranks_and_lists_the_rest(entries, tmp_path):
    paths = leaderboard.collect(entries, baselines=None, out=tmp_path)
    table = paths["md"].read_text()
    assert paths["png"].exists() and paths["png"].stat().st_size > 0
    assert "| 1 | naive |" in table
    assert "**failed gate**" in table and "**edited**" in table and "**hash mismatch**" in table
    ranked = [line for line in table.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert len(ranked) == 1, table


def test_collect_command_line(entries, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kit", "leaderboard", "--collect", str(entries), "--out",
                           str(tmp_path), "--baselines", str(tmp_path / "none")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "leaderboard.md").exists()


@pytest.mark.parametrize("task", ["gpu1", "gpu2-8b"])
def test_gpu_tasks_refuse_without_their_gpus(task):
    if torch.cuda.is_available() and torch.cuda.device_count() >= leaderboard.TASKS[task].world:
        pytest.skip("this machine has the GPUs")
    proc = subprocess.run([sys.executable, "-m", "kit", "leaderboard", "--task", task], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "CUDA GPU" in proc.stderr and task in proc.stderr


def test_the_8b_task_is_cs336s_configuration():
    model = leaderboard.TASKS["gpu2-8b"].model
    assert model == ModelConfig(vocab_size=151_936, context_length=32_768, d_model=4096, d_ff=11_008, num_layers=34,
                                num_heads=32)
    assert leaderboard.TASKS["gpu2-8b"].batch == 2 and leaderboard.TASKS["gpu2-8b"].world == 2


# ----------------------------------------------------------------------------------------------------
# The reference FusedAdamW is torch's AdamW, bit for bit (handout 07b §4)
# ----------------------------------------------------------------------------------------------------


def test_reference_fused_adamw_equals_torch_bit_for_bit():
    fused_adamw = pytest.importorskip("reference.whole_step.fused_adamw")
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) for s in ((7, 5), (5,), (3, 3, 2))]
    grads = [[torch.randn(p.shape, generator=g) for p in start] for _ in range(8)]

    def run(make):
        params = [p.clone().requires_grad_() for p in start]
        optimizer = make([{"params": params[:2]}, {"params": params[2:], "lr": 3e-2, "weight_decay": 0.0}])
        for step in grads:
            for p, grad in zip(params, step):
                p.grad = grad.clone()
            optimizer.step()
        return params

    options = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for foreach in (False, True):
        expected = run(lambda groups, foreach=foreach: torch.optim.AdamW(groups, foreach=foreach, **options))
        got = run(lambda groups: fused_adamw.FusedAdamW(groups, **options))
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), f"foreach={foreach}"
