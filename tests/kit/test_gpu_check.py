"""`make gpu-check` (instructor/gpu_check.py) checked on a CPU: it explains that it needs CUDA and exits 0; on a
(faked) GPU its orchestration, logs, summary, exit status and goal report behave, with a fake runner in
place of the real steps. The GPU figures themselves are only ever measured on a GPU."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from instructor import gpu_check
from kit import stages

pytestmark = pytest.mark.kit
ROOT = Path(__file__).resolve().parents[2]


def test_cpu_machine_explains_and_exits_zero(tmp_path):
    out = tmp_path / "gpu"
    proc = subprocess.run([sys.executable, "-m", "instructor.gpu_check", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={"CUDA_VISIBLE_DEVICES": "",
                                                                            "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "needs a CUDA GPU" in proc.stdout and "make setup GPU=1" in proc.stdout
    assert not out.exists(), "a CPU run must write nothing under benchmarks/results/gpu/"


def test_makefile_has_the_targets():
    text = (ROOT / "Makefile").read_text()
    assert "gpu-check: setup" in text and "-m instructor gpu-check" in text
    assert "wheelhouse:" in text and "--wheels $(WHEELS)" in text


def test_steps_fit_the_budget_and_name_what_exists():
    plan = gpu_check.steps(Path("/tmp/out"), python="python")
    compiled = [f"stage{s.number}_compiled" for s in stages.STAGES if s.gpu_kernels]
    assert "stage3_compiled" in compiled
    assert [s.name for s in plan] == ["doctor", "gpu_tests", *compiled, "bench_attention", "crosscheck", "train_step"]
    assert sum(s.timeout_s for s in plan) <= gpu_check.BUDGET_S < 8 * 60
    by_name = {s.name: s for s in plan}
    assert by_name["stage3_compiled"].env["TRITON_INTERPRET"] is None, "Stage 3 must run compiled"
    for arg in by_name["stage3_compiled"].argv:
        if arg.startswith("tests/"):
            assert (ROOT / arg).exists(), arg
    assert "-m" in by_name["gpu_tests"].argv and "gpu" in by_name["gpu_tests"].argv
    bench = by_name["bench_attention"].argv
    assert {"--goals", "--impl", "reference"} <= set(bench) and bench[bench.index("--out") + 1] == "/tmp/out"
    assert {s.name for s in plan if s.correctness} == {"gpu_tests", *compiled, "crosscheck", "train_step"}


def test_bench_attention_accepts_the_flags_the_check_passes():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_attention", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--goals" in proc.stdout and "--out" in proc.stdout, proc.stderr


class FakeRunner:
    """Stands in for subprocess.run: records each call; ``results[name]`` is an exit code or an exception."""

    def __init__(self, out: Path, results: dict):
        self.names = {tuple(s.argv): s.name for s in gpu_check.steps(out)}
        self.results, self.calls = results, []

    def __call__(self, argv, *, cwd, env, stdout, stderr, timeout):
        name = self.names[tuple(argv)]
        self.calls.append((name, env, timeout))
        stdout.write(f"output of {name}\n")
        result = self.results.get(name, 0)
        if isinstance(result, Exception):
            raise result
        return subprocess.CompletedProcess(argv, result)


def bench_json(out: Path, triton_ms: float = 4.0, sdpa_ms: float = 4.5, tflops: float = 500.0) -> None:
    rows = [{"config": "leaderboard", "provider": p, "mode": m, "ms": ms, "tflops": 1.0, "status": "ok"}
            for m in ("forward", "backward", "forward_backward") for p, ms in (("flash_triton", triton_ms),
                                                                                ("sdpa", sdpa_ms))]
    rows.append({"config": "fwd-throughput", "provider": "flash_triton", "mode": "forward", "ms": 1.0,
                 "tflops": tflops, "status": "ok"})
    (out / "bench_attention.json").write_text(json.dumps({"environment": {"device": "NVIDIA H100 80GB HBM3 ×1"},
                                                          "rows": rows}))


def test_all_steps_pass_and_goals_print_last(tmp_path, capsys):
    out = tmp_path / "gpu"
    out.mkdir()
    bench_json(out)
    runner = FakeRunner(out, {})
    assert gpu_check.main(["--out", str(out)], cuda=True, runner=runner) == 0
    assert [c[0] for c in runner.calls] == [s.name for s in gpu_check.steps(out)]
    stage3_env = next(env for name, env, _ in runner.calls if name == "stage3_compiled")
    assert "TRITON_INTERPRET" not in stage3_env
    log = (out / "crosscheck.log").read_text()
    assert log.startswith("# device: ") and "# torch: " in log and "output of crosscheck" in log
    summary = (out / "summary.md").read_text()
    assert "All correctness steps passed." in summary and "| train_step | passed |" in summary
    printed = capsys.readouterr().out.rstrip().splitlines()
    assert printed[-1] == "  forward D=128 N=16384 bf16: 500 TFLOP/s (goal ≥ 450: met)", printed[-5:]
    assert any("forward_backward: 4.00 ms vs SDPA flash 4.50 ms (not slower); goal ≤ 5.0 ms: met" in line
               for line in printed)


def test_a_failing_correctness_step_fails_the_check(tmp_path, capsys):
    out = tmp_path / "gpu"
    runner = FakeRunner(out, {"crosscheck": 1, "bench_attention": 3,
                         "stage3_compiled": subprocess.TimeoutExpired("pytest", 120)})
    assert gpu_check.main(["--out", str(out)], cuda=True, runner=runner) == 1
    summary = (out / "summary.md").read_text()
    limit = next(s.timeout_s for s in gpu_check.steps(out) if s.name == "stage3_compiled")
    assert "| crosscheck | failed (exit 1) |" in summary and f"timed out after {limit} s" in summary
    assert "FAILED correctness steps: stage3_compiled, crosscheck" in summary
    assert "train_step" in [c[0] for c in runner.calls], "a failure must not stop the later steps"
    printed = capsys.readouterr().out
    assert "   | output of crosscheck" in printed, "a failing step's log tail is printed"
    assert "goal comparison missing" in printed.rstrip().splitlines()[-1]


def test_a_non_gating_failure_keeps_exit_zero(tmp_path):
    out = tmp_path / "gpu"
    out.mkdir()
    bench_json(out, triton_ms=6.0)
    assert gpu_check.main(["--out", str(out)], cuda=True, runner=FakeRunner(out, {"doctor": 1})) == 0


def test_budget_skips_what_no_longer_fits(tmp_path):
    outcomes = gpu_check.run_all(tmp_path, runner=FakeRunner(tmp_path, {}), budget_s=0)
    assert {o.status for o in outcomes} == {"skipped: time budget spent"}
    assert gpu_check.summary(outcomes, tmp_path)[1] == 1, "a skipped correctness step is not a pass"


def test_step_timeout_never_exceeds_what_is_left(tmp_path):
    runner = FakeRunner(tmp_path, {})
    gpu_check.run_step(gpu_check.steps(tmp_path)[1], tmp_path, seconds_left=20.0, runner=runner)
    assert runner.calls[0][2] == 20.0


def test_crosscheck_tolerances_follow_the_error_model():
    import torch

    atol, grad_rtol = gpu_check.crosscheck_tolerances(torch.tensor([0.0, 1.0]), 3.0)
    u = 2.0**-8
    assert torch.allclose(atol, torch.tensor([2 * u * 3.0, 2 * u * 4.0])) and grad_rtol == 8 * u


def fake_compiled(blocks: dict, warps: int, stages: int, ptx: str = "wgmma.mma_async", regs=128, spills=0):
    names = ["Q", "K", "V", "BLOCK_M", "BLOCK_N", "HEAD_DIM"]
    constants = {(names.index(k),): v for k, v in blocks.items()}

    def init():
        compiled.n_regs, compiled.n_spills = regs, spills

    compiled = SimpleNamespace(src=SimpleNamespace(fn=SimpleNamespace(arg_names=names), constants=constants),
                               metadata=SimpleNamespace(num_warps=warps, num_stages=stages, shared=98304),
                               asm={"ptx": ptx}, _init_handles=init)
    return compiled


def test_kernel_report_marks_the_autotuned_choice(monkeypatch):
    pick = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    chosen = fake_compiled({"BLOCK_M": 128, "BLOCK_N": 64, "HEAD_DIM": 64}, 4, 3)
    other = fake_compiled({"BLOCK_M": 64, "BLOCK_N": 64, "HEAD_DIM": 64}, 4, 3, ptx="mma.sync", spills=16)
    kernel = SimpleNamespace(device_caches={0: ({"a": chosen, "b": other}, None, None)})
    launcher = SimpleNamespace(kernel=kernel, kind="forward", tuned=object(), chosen={"forward|…|H100": pick})
    fixed = SimpleNamespace(kernel=SimpleNamespace(device_caches={0: ({"c": chosen},)}), kind="dq", tuned=None,
                            chosen={})
    monkeypatch.setattr(gpu_check, "launchers", lambda pkg: [launcher, fixed])
    rows = gpu_check.kernel_report([object()])
    assert [(r["kernel"], r["BLOCK_M"], r["chosen"], r["wgmma"], r["spills"]) for r in rows] == [
        ("forward", 128, "yes", True, 0), ("forward", 64, "no", False, 16), ("dq", 128, "fixed", True, 0)]
    assert rows[0]["shared_kib"] == 96.0 and rows[0]["registers"] == 128


def test_kernel_report_survives_a_kernel_that_does_not_load():
    compiled = fake_compiled({"BLOCK_M": 128}, 8, 2)
    compiled._init_handles = lambda: (_ for _ in ()).throw(RuntimeError("out of resources"))
    row = gpu_check.compiled_row("dkdv", compiled, [])
    assert row["registers"] is None and row["spills"] == "not loaded (RuntimeError)"


def test_launchers_are_found_in_the_flash_attention_package(impl):
    found = gpu_check.launchers(impl.flash_attention)
    assert sorted(lch.kind for lch in found) == ["dkdv", "dq", "forward", "fused"]


REAL_COMPILE = r"""
import os
os.environ["TRITON_INTERPRET"] = "0"
import kit  # noqa: F401
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from instructor.gpu_check import compiled_row


@triton.jit
def toy(A, B, C, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(C + r, tl.dot(tl.load(A + r), tl.load(B + r)).to(tl.bfloat16))


src = ASTSource(fn=toy, signature={"A": "*bf16", "B": "*bf16", "C": "*bf16", "BLOCK_M": "constexpr",
                                   "BLOCK_N": "constexpr"}, constexprs={"BLOCK_M": 64, "BLOCK_N": 64})
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
print(compiled_row("toy", compiled, []))
"""


def test_compiled_row_reads_a_real_sm90_kernel(tmp_path):
    """The attribute names compiled_row relies on, checked on a kernel compiled for sm_90 (no GPU needed)."""
    env = {"TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(ROOT)}
    script = tmp_path / "toy_kernel.py"  # @triton.jit needs its source in a file
    script.write_text(REAL_COMPILE)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    row = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert row["BLOCK_M"] == 64 and row["BLOCK_N"] == 64 and row["warps"] == 4 and row["stages"] == 3
    assert row["wgmma"] is True and row["shared_kib"] > 0 and row["chosen"] == "fixed"
    assert row["registers"] is None, "no GPU here: registers and spills are only known once loaded on one"


def test_crosscheck_code_path_runs_on_cpu_at_a_small_shape(tmp_path):
    """The cross-check's own code (SDPA flash on 4-D inputs, the tolerances, the tables) at 2 × 64 × 16 on a
    CPU: the Triton kernels interpreted. Its leaderboard figures are only ever measured on a GPU."""
    assert gpu_check.crosscheck(tmp_path, dict(batch_heads=2, seq=64, d_head=16), device="cpu")
    rows = json.loads((tmp_path / "crosscheck.json").read_text())["rows"]
    assert [(r["backward design"], r["quantity"]) for r in rows] == [
        (design, q) for design in ("split", "fused") for q in ("O", "dQ", "dK", "dV")] and all(r["ok"] for r in rows)
    assert (tmp_path / "kernels.md").exists()


def test_train_step_code_path_runs_on_cpu(tmp_path):
    assert gpu_check.train(tmp_path, dict(preset="tiny", batch_size=2, context_length=32), device="cpu")
    rows = json.loads((tmp_path / "train_step.json").read_text())["rows"]
    assert [r["dtype"] for r in rows] == ["fp32", "bf16", "fp16"]
    assert all(r["mfu_percent"] is None and r["model_tflops"] > 0 for r in rows), "no peak for a CPU: no MFU"


def test_no_gpu_test_selected_is_not_a_failure(tmp_path):
    step = gpu_check.steps(tmp_path)[1]
    outcome = gpu_check.run_step(step, tmp_path, seconds_left=60, runner=FakeRunner(tmp_path, {"gpu_tests": 5}))
    assert outcome.status == "nothing selected" and outcome.ok
    crosscheck = next(s for s in gpu_check.steps(tmp_path) if s.name == "crosscheck")
    outcome = gpu_check.run_step(crosscheck, tmp_path, seconds_left=60, runner=FakeRunner(tmp_path, {"crosscheck": 5}))
    assert not outcome.ok
