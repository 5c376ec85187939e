"""Small units of the given code: impl selection, teaching assertions, model, nsys summary, memory timeline,
results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kit import impl as impl_module
from kit.allocations import Allocations
from kit.model import ModelConfig, TransformerLM, get_config, naive_attention
from kit.nsys import summarize_nsys_csv
from kit.results import save_results
from kit.testing import assert_close

ROOT = Path(__file__).resolve().parents[2]


def test_impl_selection(monkeypatch):
    monkeypatch.setenv(impl_module.ENV_VAR, "reference")
    assert impl_module.load().package == "reference"
    assert impl_module.load("student").package == "student"
    with pytest.raises(ValueError, match="implementation must be one of"):
        impl_module.load("solutions")


def test_assert_close_names_quantity_worst_element_and_section():
    expected = torch.zeros(2, 3)
    actual = expected.clone()
    actual[1, 2] = 0.5
    actual[0, 0] = 0.01
    with pytest.raises(AssertionError) as info:
        assert_close(actual, expected, name="dQ", section="handout 03 §4", rtol=0, atol=1e-3)
    msg = str(info.value)
    for part in ("dQ", "2 of 6", "(1, 2)", "got 0.5", "atol=0.001", "handout 03 §4"):
        assert part in msg, f"{part!r} missing from: {msg}"
    with pytest.raises(AssertionError, match="inf/nan"):
        assert_close(torch.tensor([float("nan")]), torch.tensor([1.0]), name="x", section="s")
    with pytest.raises(AssertionError, match="shape"):
        assert_close(torch.zeros(2), torch.zeros(3), name="x", section="s")
    assert_close(expected + 1e-7, expected, name="x", section="s", rtol=0, atol=1e-6)


def test_model_forward_shapes_and_pluggable_attention():
    model = TransformerLM("tiny")
    tokens = torch.randint(0, 512, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 512)
    calls = []

    def recording_attention(q, k, v, is_causal):
        calls.append((tuple(q.shape), is_causal))
        return naive_attention(q, k, v, is_causal)

    model.set_attention(recording_attention)
    torch.testing.assert_close(model(tokens), logits)
    assert calls == [((2, 4, 16, 16), True)] * 2


def test_model_is_causal():
    model = TransformerLM("tiny")
    tokens = torch.randint(0, 512, (1, 12))
    changed = tokens.clone()
    changed[0, 8] = (changed[0, 8] + 1) % 512
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[0, :8], b[0, :8])
    assert not torch.allclose(a[0, 8:], b[0, 8:])


def test_model_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_heads"):
        ModelConfig(d_model=10, num_heads=3)
    with pytest.raises(ValueError, match="preset must be one of"):
        get_config("huge")
    with pytest.raises(ValueError, match="context_length"):
        TransformerLM("tiny")(torch.zeros(1, 65, dtype=torch.long))
    assert get_config("xl").d_model == 1600 and get_config("2.7B").num_layers == 32


def test_nsys_summary_parses_both_reports(tmp_path):
    nvtx = tmp_path / "nvtx.csv"
    nvtx.write_text(
        "Time (%),Total Time (ns),Instances,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Style,Range\n"
        "60.0,6000000,3,2000000,2000000,1900000,2100000,100,PushPop,:backward\n"
        "40.0,4000000,3,1333333,1333333,1300000,1400000,50,PushPop,:forward\n"
    )
    kern = tmp_path / "kern.csv"
    kern.write_text(
        "Time (%),Total Time (ns),Instances,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Name\n"
        "90.0,9000000,30,300000,300000,290000,310000,10,ampere_sgemm_128x64_tn\n"
        "10.0,1000000,10,100000,100000,90000,110000,5,softmax_kernel\n"
    )
    rows = summarize_nsys_csv(nvtx, kern)
    assert [(r["kind"], r["name"]) for r in rows][:2] == [("nvtx", "backward"), ("nvtx", "forward")]
    assert rows[0]["total_ms"] == pytest.approx(6.0) and rows[0]["share"] == pytest.approx(0.6)
    assert rows[2]["name"] == "ampere_sgemm_128x64_tn" and rows[2]["share"] == pytest.approx(0.9)
    out = subprocess.run([sys.executable, "-m", "kit", "nsys-summary", str(nvtx), str(kern)], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "| nvtx | backward | 3 | 6.000 |" in out
    # Invocations per step: the capture held 10 steps, so 30 GEMM launches are 3 per step.
    per_step = {r["name"]: r["per_step"] for r in summarize_nsys_csv(nvtx, kern, steps=10)}
    assert per_step["ampere_sgemm_128x64_tn"] == 3 and per_step["softmax_kernel"] == 1
    out = subprocess.run([sys.executable, "-m", "kit", "nsys-summary", str(nvtx), str(kern), "--steps", "10"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "| kernel | ampere_sgemm_128x64_tn | 30 | 3 | 9.000 |" in out, out


def _tiny_train_step():
    from kit import memory_timeline
    from kit.model import cross_entropy

    torch.manual_seed(0)
    config = get_config("tiny", context_length=16)
    model = TransformerLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, config.vocab_size, (2, 17))
    psi = sum(p.numel() for p in model.parameters())
    return memory_timeline.train_step_fn(model, optimizer, (tokens[:, :-1], tokens[:, 1:]), cross_entropy), psi


def test_allocations_count_new_storages_only_and_free_them():
    """Views and in-place ops allocate nothing; a freed tensor leaves ``live``; ``peak`` and ``largest`` stay."""
    before = torch.ones(1000)  # exists before the mode: never counted
    with Allocations() as seen:
        a = torch.empty(300, dtype=torch.float64)  # 2400 B
        view, _ = a[:10], before.add_(1)  # a view and an in-place result: nothing new
        b = torch.zeros(100)  # 400 B
        assert (seen.live, seen.peak) == (2800, 2800)
        del a, view
        assert seen.live == 400, "a storage stops counting when its last tensor dies"
        c = torch.zeros(50)  # 200 B
        assert (seen.live, seen.peak) == (600, 2800)
    assert seen.largest == 2400 and "(300,) torch.float64" in seen.what, seen.what
    del b, c


def test_memory_timeline_classifies_a_train_step():
    """kit.memory_timeline on a CPU: the phases in order, parameters 4Ψ throughout, AdamW's state 8Ψ (plus its
    step counters) from the first step's optimizer phase on, gradients 4Ψ at that phase, activations during
    the forward only."""
    from kit import memory_timeline

    step, psi = _tiny_train_step()

    def two_steps():
        step()
        step()

    timeline = memory_timeline.record(two_steps)
    assert timeline.source == "export_memory_timeline"
    assert [name for name, _, _ in timeline.phases] == ["forward", "backward", "optimizer_step"] * 2
    peaks = timeline.phase_peaks()
    assert all(p["parameter"] == 4 * psi for p in peaks[3:]), [p["parameter"] for p in peaks]
    assert peaks[0]["optimizer_state"] == 0, "no AdamW state before the first step"
    for p in peaks[2:]:
        assert 8 * psi <= p["optimizer_state"] <= 8 * psi + 4 * 64, p  # + a 4-byte `step` per tensor
    assert peaks[2]["gradient"] == 4 * psi, "all gradients alive when the optimizer steps"
    assert peaks[0]["activation"] > 0 and peaks[0]["gradient"] == 0
    assert max(timeline.total()) == max(p["total"] for p in peaks)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    memory_timeline.plot(timeline, ax)
    assert ax.get_ylabel() == "allocated (MiB)"
    plt.close(fig)


def test_memory_timeline_falls_back_to_memory_events(monkeypatch):
    from kit import memory_timeline

    def gone(prof, device):
        raise AttributeError("export_memory_timeline")

    monkeypatch.setattr(memory_timeline, "_from_export", gone)
    step, psi = _tiny_train_step()
    with pytest.warns(UserWarning, match="raw \\[memory\\] events"):
        timeline = memory_timeline.record(step)
    assert timeline.source == "memory events"
    assert [name for name, _, _ in timeline.phases] == ["forward", "backward", "optimizer_step"]
    # The raw events count what was allocated inside the call: the first step's AdamW state (8Ψ) at least.
    assert max(timeline.total()) >= 8 * psi
    with pytest.raises(TypeError, match="fn"):
        memory_timeline.record(None)


def test_save_results_stamps_every_file(tmp_path):
    paths = save_results("demo", [{"a": 1, "b": 2.5}], out_dir=tmp_path)
    assert json.loads(paths["json"].read_text())["environment"]["torch"] == torch.__version__
    csv_text = paths["csv"].read_text()
    assert csv_text.startswith("# device:") and "a,b" in csv_text


def test_doctor_reports_versions_and_triton_mode():
    out = subprocess.run([sys.executable, "-m", "kit", "doctor"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    for part in ("torch", "triton", "Triton mode", "nsys", "Stage 3", "bf16 units: "):
        assert part in out


def test_handout_tests_and_points_agree():
    from kit.grading.handout_check import check

    errors = check()
    assert not errors, "the handout and the tests disagree:\n" + "\n".join(errors)


def test_handout_check_catches_a_wrong_total(tmp_path):
    from kit.grading.handout_check import parse_handout

    chapter = tmp_path / "09-x.md"
    chapter.write_text("### Problem 9.1 — Thing (3 points)\nTests: `test_a`, `test_b`\n"
                       "Hidden tests: `test_c` (1 point)\n\n### Problem 9.2 — Essay (written)\n")
    problems = parse_handout(chapter)
    assert [(p.number, p.points, p.tests, p.hidden) for p in problems] == [
        ("9.1", 3.0, ["test_a", "test_b"], {"test_c": 1.0}), ("9.2", None, [], {})]


def test_doctor_says_what_a_grading_machine_lacks(monkeypatch):
    from kit.setup import doctor
    from kit.spawn import confine

    monkeypatch.setattr(doctor, "available_cpus", lambda: 1.0)
    monkeypatch.setattr(doctor, "available_memory_gib", lambda: 2.0)
    monkeypatch.setattr(confine, "landlock_abi", lambda: 0)
    problems = doctor.grader_floor()
    assert len(problems) == 3, problems
    assert problems[0].startswith("1 CPU(s) (recommended: 2)") and "no test loses points" in problems[0]
    assert "2.0 GiB of memory available (floor: 3 GiB" in problems[1]
    assert "no Landlock" in problems[2]
    assert "WARNING" in doctor.grader_report()
    monkeypatch.setattr(doctor, "available_cpus", lambda: 2.0)
    monkeypatch.setattr(doctor, "available_memory_gib", lambda: 6.0)
    monkeypatch.setattr(confine, "landlock_abi", lambda: 7)
    assert doctor.grader_floor() == [] and "meets the grader's recommendation" in doctor.grader_report()


def test_what_to_work_on_names_the_stub_behind_a_dependent_check():
    """A check that could not run because another failed (Failure.reraise) is grouped under that failure's stub,
    not under its own "because that failed:" sentence."""
    from kit.grading import reporting
    from kit.grading.scoring import GradeResult, TestResult

    output = ("tests/test_stage5_zero.py:759: in test_resume_at_three_ranks_from_two\n"
              "E   NotImplementedError: no checkpoint to resume from: the 2-rank run saves it, because that failed:\n"
              "E   ShardedOptimizer.__init__: build local_optimizer (handout 05 §2)\n"
              "E   (rank 0, check 'checkpoint')\n")
    stub = "E   NotImplementedError: ShardedOptimizer.__init__: build local_optimizer (handout 05 §2)\n"
    tests = [TestResult("tests/test_stage5_zero.py::test_a", 5, 1.0, False, output=stub),
             TestResult("tests/test_stage5_zero.py::test_resume", 5, 1.0, False, output=output)]
    table = reporting.format_table(GradeResult(submission="s", tests=tests))
    grouped = ("implement ShardedOptimizer.__init__: build local_optimizer (handout 05 §2)\n"
               "      failing: test_a (+1 more)")
    assert grouped in table, table
    assert "because that failed" not in table, table


def test_score_table_columns_line_up_for_every_stage_title():
    """Every stage's row of the score table has its bars where the header has them, the longest title included
    (Stage 5's "Sharded data parallel: ZeRO-1 and FSDP" once broke the columns)."""
    from kit import stages
    from kit.grading.reporting import format_table
    from kit.grading.scoring import GradeResult, TestResult

    tests = [TestResult(nodeid=f"tests/x.py::test_{s.number}", stage=s.number, points=2.0, hidden=False,
                        score=2.0 * (s.number % 2), status="passed" if s.number % 2 else "failed")
             for s in stages.STAGES]
    table = [line for line in format_table(GradeResult("demo", tests)).splitlines() if line.startswith("|")]
    assert len(table) == len(stages.STAGES) + 3
    bars = {tuple(i for i, ch in enumerate(line) if ch == "|") for line in table}
    assert len(bars) == 1, "\n".join(table)
    assert any(s.title in line for s in stages.STAGES for line in table if len(s.title) > 28)
