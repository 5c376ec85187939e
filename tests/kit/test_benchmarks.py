"""The benchmarks: each runs end to end at smoke size as a module, writes stamped results where it is told,
never over the committed tables by accident; the skeleton's timer, the FLOP convention, and the attention
benchmark's fixes (4-D SDPA, per-cell errors, loud goal report)."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from kit import bench
from kit.flops import attention_flops, describe_device, memory_bandwidth, peak_flops, transformer_flops
from kit.model import get_config
from kit.results import RESULTS_DIR, SCRATCH_DIR
from kit.spawn import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))


def _clean_env() -> dict[str, str]:
    # No PYTHONPATH: a benchmark must run as `python -m benchmarks.<name>` from the repository root.
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"MPLBACKEND": "Agg"}


def _committed() -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(RESULTS_DIR.glob("*")) if p.is_file()}


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch):
    """Undo what ``bench.parse`` does to this process (the implementation variable, torch threads)."""
    from kit.impl import ENV_VAR

    monkeypatch.setenv(ENV_VAR, os.environ.get(ENV_VAR, "student"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_smoke(name: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    results = list(tmp_path.glob("*.json"))
    assert results, f"{name} wrote no JSON results into --out"
    for path in results:
        stamp = json.loads(path.read_text())["environment"]
        for key in ("device", "torch", "date", "command", "impl"):
            assert stamp.get(key), f"{path.name} lacks the {key!r} stamp"
        assert stamp["command"].startswith(f"python -m benchmarks.{name} --smoke"), stamp["command"]
        # Which CPU made the figures (issue 38): its model, instruction sets, bf16 units and BLAS.
        for key in ("cpu", "arch", "isa", "native_bf16", "torch_cpu_capability", "blas"):
            assert key in stamp.get("machine", {}), f"{path.name} lacks the machine stamp's {key!r}"
    assert "|" in proc.stdout, f"{name} printed no markdown table"


def test_bench_model_compile_compares_eager_and_compiled(tmp_path: Path) -> None:
    """`bench_model --compile` (handout 01 §7): eager and compiled rows side by side for the forward and the
    forward+backward, each with its first call's time, the compiled ones with their speed-up over eager. The
    `aot_eager` backend traces forward and backward like inductor but generates no code: seconds, not minutes."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_model", "--smoke", "--compile", "--compile-backend",
                           "aot_eager", "--impl", "reference", "--out", str(tmp_path)], cwd=ROOT, env=_clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"bench_model --compile failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    rows = json.loads((tmp_path / "bench_model_compile.json").read_text())["rows"]
    assert not (tmp_path / "bench_model.json").exists(), "--compile writes its own table"
    assert sorted((r["mode"], r["compile"]) for r in rows) == [("forward", "aot_eager"), ("forward", "eager"),
                                                               ("forward_backward", "aot_eager"),
                                                               ("forward_backward", "eager")]
    for r in rows:
        assert r["first_call_s"] > 0 and r["mean_ms"] > 0, r
        eager = next(e for e in rows if e["mode"] == r["mode"] and e["compile"] == "eager")
        if r["compile"] == "eager":
            assert r["speedup"] is None
        else:
            assert r["speedup"] == pytest.approx(eager["median_ms"] / r["median_ms"])


def test_bench_fsdp_skips_and_names_unfinished_implementations(tmp_path: Path) -> None:
    """Problem 5.18's benchmark on the stubs: Stage 4's DDP and this stage's FSDP are skipped with the stub's own
    message, and torch's fully_shard still runs: the benchmark works before every stage is done."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_fsdp", "--smoke", "--impl", "student", "--out",
                           str(tmp_path)], cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"bench_fsdp on the stubs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    rows = {r["impl"]: r for r in json.loads((tmp_path / "bench_fsdp.json").read_text())["rows"]}
    for name, where in (("DDP", "handout 04"), ("FSDP p1", "handout 05b")):
        assert rows[name]["note"].startswith("not implemented yet: ") and where in rows[name]["note"], rows[name]
        assert f"skipped {name}: not implemented yet" in proc.stdout
    assert rows["fully_shard"]["step_ms"] > 0 and rows["fully_shard"]["state_mb"] > 0


def test_benchmarks_have_no_path_hacks_and_return_their_rows() -> None:
    for name in BENCHMARKS:
        source = (ROOT / "benchmarks" / f"{name}.py").read_text()
        assert "sys.path" not in source, f"benchmarks/{name}.py edits sys.path: run it as `python -m benchmarks.{name}`"
        assert "bench.parse(" in source and "def main(argv: list[str] | None = None) -> list[dict]:" in source, (
            f"benchmarks/{name}.py does not use the skeleton (kit.bench.parse, main(argv) -> rows)")


@pytest.mark.parametrize("argv", [["--smoke", "--save", "--impl", "reference"], ["--save", "--impl", "student"],
                                  ["--smoke", "--out", str(RESULTS_DIR), "--impl", "reference"],
                                  ["--out", str(RESULTS_DIR / "gpu"), "--impl", "student"]],
                         ids=["smoke-save", "student-save", "smoke-out-results", "student-out-results-subfolder"])
def test_every_benchmark_refuses_to_overwrite_committed_results(argv: list[str], in_process, capsys) -> None:
    before = _committed()
    for name in BENCHMARKS:
        module = importlib.import_module(f"benchmarks.{name}")
        with pytest.raises(SystemExit) as info:
            module.main(argv)
        assert info.value.code == 2, f"{name} {argv}: expected a usage error, got exit code {info.value.code}"
        assert "benchmarks/results/" in capsys.readouterr().err
    assert _committed() == before


def test_default_output_folders_are_scratch(in_process) -> None:
    p = bench.parser("demo")
    assert bench.parse(p, ["--smoke"]).out == (SCRATCH_DIR / "smoke").resolve()
    assert bench.parse(p, ["--impl", "student"]).out == SCRATCH_DIR.resolve()
    assert not SCRATCH_DIR.resolve().is_relative_to(RESULTS_DIR.resolve())
    assert bench.parse(p, ["--save", "--impl", "reference"]).out == RESULTS_DIR.resolve()
    ignore = (ROOT / ".gitignore").read_text().split()
    assert f"/{SCRATCH_DIR.name}/" in ignore, f"{SCRATCH_DIR.name}/ must be git-ignored"


def test_a_smoke_run_without_out_leaves_the_committed_tables_alone(tmp_path: Path) -> None:
    # The real default path, with the scratch folder redirected so the test writes nothing into the repository.
    code = ("import sys, kit.bench; from pathlib import Path; kit.bench.SCRATCH_DIR = Path(sys.argv[1]); "
            "from benchmarks import bench_model; bench_model.main(['--smoke'])")
    before = _committed()
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=_clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "smoke" / "bench_model.md").exists()
    assert _committed() == before, "a --smoke run changed benchmarks/results/"


def _step_time_rank(late_s: float, step_s: list[float]) -> float:
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 0:
        time.sleep(late_s)  # arrives late: the barrier must keep this out of everybody's time
    return bench.step_time(lambda: time.sleep(step_s[rank]))


def test_step_time_starts_together_and_reports_the_slowest_rank() -> None:
    times = run_on_ranks(_step_time_rank, 2, args=(0.6, [0.05, 0.3]), timeout=120, backend="gloo")
    for rank, t in enumerate(times):
        # Every rank reports rank 1's 0.3 s (the slowest), not its own 0.05 s and not rank 0's 0.6 s delay.
        assert 0.3 <= t < 0.55, f"rank {rank}: step_time {t:.3f} s, expected the slowest step (0.3 s) only"


# ---------------------------------------------------------------------------------------------------------
# One FLOP convention (kit/flops.py)
# ---------------------------------------------------------------------------------------------------------


def test_transformer_flops_count_causal_attention_once() -> None:
    cfg = get_config("small")
    d, L, T, B = cfg.d_model, cfg.num_layers, 1024, 2
    n = L * (4 * d * d + 3 * d * cfg.d_ff + 2 * d) + d + d * cfg.vocab_size
    tokens = B * T
    # Per token: 6·N for the weights, 6·L·d·T for causal attention (PaLM's 12·L·d·T counts the full matrix).
    assert transformer_flops(cfg, B, T, "train_step") == pytest.approx(tokens * (6 * n + 6 * L * d * T), rel=1e-12)
    assert transformer_flops(cfg, B, T, "forward") == pytest.approx(tokens * (2 * n + 2 * L * d * T), rel=1e-12)
    assert transformer_flops(cfg, B, T, "backward") == pytest.approx(2 * transformer_flops(cfg, B, T, "forward"))
    with pytest.raises(ValueError, match="mode"):
        transformer_flops(cfg, B, T, "inference")


def test_attention_flops_halve_for_causal_and_scale_by_mode() -> None:
    full = attention_flops(16, 16384, 16384, 64, causal=False, mode="forward")
    assert full == 4 * 16 * 16384**2 * 64
    assert attention_flops(16, 16384, 16384, 64, causal=True, mode="forward") == full / 2
    assert attention_flops(16, 16384, 16384, 64, causal=True, mode="forward_backward") == 1.5 * full
    with pytest.raises(ValueError, match="head_dim"):
        attention_flops(16, 128, 128, 0, causal=True, mode="forward")
    with pytest.raises(ValueError, match="batch_heads"):
        attention_flops(True, 128, 128, 64, causal=True, mode="forward")


# The names torch.cuda.get_device_name() reports for each card, and the data sheet's figures they must get.
REPORTED_NAMES = {
    "NVIDIA H100 80GB HBM3": (989e12, 3.35e12), "NVIDIA H100 PCIe": (756e12, 2.0e12),
    "NVIDIA H100 NVL": (835e12, 3.9e12), "NVIDIA H200": (989e12, 4.8e12), "NVIDIA H200 NVL": (835e12, 4.8e12),
    "NVIDIA B200": (2.25e15, 8e12), "NVIDIA GB200": (2.5e15, 8e12), "NVIDIA A100-SXM4-80GB": (312e12, 2.039e12),
    "NVIDIA A100-SXM4-40GB": (312e12, 1.555e12), "NVIDIA A100 80GB PCIe": (312e12, 1.935e12),
    "NVIDIA A100-PCIE-40GB": (312e12, 1.555e12), "NVIDIA L40S": (362e12, 0.864e12), "NVIDIA L4": (121e12, 0.3e12),
    "NVIDIA GeForce RTX 4090": (165e12, 1.008e12),
}


@pytest.mark.parametrize("name", sorted(REPORTED_NAMES))
def test_each_reported_device_name_gets_its_own_figures(name: str) -> None:
    flops_bf16, bandwidth = REPORTED_NAMES[name]
    assert peak_flops(name, "bf16") == flops_bf16, name
    assert memory_bandwidth(name) == bandwidth, name


def test_device_lookup_is_exact_and_says_unknown() -> None:
    # The substring rule this replaced read the L40S as an L4 and the H100 NVL as an H100 SXM.
    assert peak_flops("NVIDIA L40S", "bf16") != peak_flops("NVIDIA L4", "bf16")
    assert peak_flops("NVIDIA H100 NVL", "bf16") != peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert peak_flops("H100", "bf16") == 989e12 and memory_bandwidth("H100") == 3.35e12  # a row by its own name
    assert peak_flops("Tesla V100-SXM2-32GB", "fp16") == 125e12 and peak_flops("Tesla V100-SXM2-32GB", "bf16") is None
    assert peak_flops("NVIDIA B200", "fp32") is None  # left out on purpose (see kit/flops.py)
    for unknown in ("Some CPU", "NVIDIA H100", "NVIDIA L4 Ultra", "NVIDIA GH200 480GB", "h100"):
        assert peak_flops(unknown, "bf16") is None and memory_bandwidth(unknown) is None, unknown
        assert describe_device(unknown).startswith("unknown device"), unknown
    assert describe_device("NVIDIA H100 NVL") == "H100 NVL"
    with pytest.raises(TypeError, match="device_name"):
        peak_flops(None, "bf16")


# ---------------------------------------------------------------------------------------------------------
# bench_attention: 4-D SDPA, per-cell errors, goal rows and a loud goal report
# ---------------------------------------------------------------------------------------------------------


def _cell(**changes) -> dict:
    return dict(config="grid", batch=2, heads=3, seq=64, d_head=16, dtype="bf16", causal=True,
                modes=("forward", "backward", "forward_backward")) | changes


@pytest.mark.filterwarnings("ignore:.*(kernel not used|4 dimensional).*:UserWarning")
def test_sdpa_pinned_to_its_flash_backend_runs_on_the_benchmark_inputs() -> None:
    from benchmarks import bench_attention as ba

    # CUDA-only code path, taken on a CPU: pinning SDPA to FLASH_ATTENTION behaves the same there.
    attn = ba.make_provider("sdpa", True, impl=None)
    results = ba.measure(attn, _cell(), torch.device("cpu"), cpu_iters=1)
    assert {mode: status for mode, (_, _, status) in results.items()} == dict.fromkeys(results, "ok"), results
    # Why the inputs must be 4-D: the same pinned call on (B·H, N, D) finds no kernel.
    q = torch.randn(6, 64, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="No available kernel"):
        attn(q, q, q, True)


def test_a_failing_cell_is_reported_and_the_grid_goes_on(tmp_path: Path, monkeypatch, in_process) -> None:
    import triton.runtime.errors

    from benchmarks import bench_attention as ba

    real = ba.make_provider

    def fake(name: str, on_cuda: bool, impl):
        if name == "flash_triton":
            def broken(q, k, v, causal):
                raise triton.runtime.errors.OutOfResources(232448, 227328, "shared memory")
            return broken
        return real(name, on_cuda, impl)

    monkeypatch.setattr(ba, "make_provider", fake)
    rows = ba.main(["--smoke", "--out", str(tmp_path), "--providers", "flash_triton,naive", "--impl", "reference"])
    status = {(r["provider"], r["mode"]): r["status"] for r in rows}
    assert all(status[("naive", m)] == "ok" for m in ba.MODES), status
    assert all(status[("flash_triton", m)].startswith("error: OutOfResources: out of resource: shared memory")
               for m in ba.MODES), status
    assert "OutOfResources" in (tmp_path / "bench_attention.md").read_text()
    assert ba.failure(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 GiB")) == "OOM"
    assert ba.failure(NotImplementedError("the dQ kernel")) == "not implemented: the dQ kernel"


def test_goal_rows_are_the_leaderboard_and_throughput_shapes() -> None:
    from benchmarks import bench_attention as ba

    cells = ba.plan(Namespace(smoke=False, goals=True), on_cuda=True)
    assert [c["config"] for c in cells] == ["leaderboard", "fwd-throughput"]
    board, thr = cells
    assert (board["batch"] * board["heads"], board["seq"], board["d_head"], board["dtype"], board["causal"]) == (
        16, 16384, 64, "bf16", True)
    assert set(board["modes"]) == set(ba.MODES)
    assert (thr["seq"], thr["d_head"], thr["causal"], thr["modes"]) == (16384, 128, False, ("forward",))
    cpu = Namespace(smoke=False, goals=False, compile_on_cpu=False, cpu_triton_max_seq=128)
    assert ba.skip_reason("sdpa", board, on_cuda=False, args=cpu).startswith("needs CUDA")


def test_gpu_grid_reaches_naive_attentions_out_of_memory() -> None:
    """Problem 3.6(a) asks where naive attention runs out of memory: the GPU grid must get there. At batch·heads
    16 its forward alone holds 2N²·c + 2N² bytes per batch·head (scores and scaled scores, or masked scores and
    probabilities, plus two boolean masks): > 80 GB at N = 32768 even in bf16, < 80 GB at 16384 even in fp32."""
    from benchmarks import bench_attention as ba

    grid = [c for c in ba.plan(Namespace(smoke=False, goals=False), on_cuda=True) if c["config"] == "grid"]
    assert {c["batch"] * c["heads"] for c in grid} == {16}
    seqs = sorted({c["seq"] for c in grid})
    forward_peak = {c: lambda n, c=c: 16 * (2 * n * n * c + 2 * n * n) for c in (2, 4)}
    assert forward_peak[2](seqs[-1]) > 80e9 and forward_peak[4](seqs[-2]) < 80e9, seqs


def _goal_rows(sdpa_status: str = "ok") -> list[dict]:
    rows = []
    for mode, mine, sdpa in (("forward", 1.5, 1.6), ("backward", 3.0, 3.3), ("forward_backward", 4.6, 4.9)):
        rows.append(dict(config="leaderboard", provider="flash_triton", mode=mode, ms=mine, tflops=1.0, status="ok"))
        ok = sdpa_status == "ok"
        rows.append(dict(config="leaderboard", provider="sdpa", mode=mode, ms=sdpa if ok else None,
                         tflops=None, status=sdpa_status))
    rows.append(dict(config="fwd-throughput", provider="flash_triton", mode="forward", ms=1.0, tflops=480.0,
                     status="ok"))
    return rows


def test_goal_report_compares_with_sdpa_and_says_loudly_when_it_cannot() -> None:
    from benchmarks import bench_attention as ba

    lines = "\n".join(ba.goal_report(_goal_rows(), on_cuda=True, device_name="fake H100"))
    assert "leaderboard forward_backward: 4.60 ms vs SDPA flash 4.90 ms (not slower); goal ≤ 5.0 ms: met" in lines
    assert "480 TFLOP/s (goal ≥ 450: met)" in lines and "MISSING" not in lines
    lines = "\n".join(ba.goal_report(_goal_rows("error: RuntimeError: No available kernel"), on_cuda=True))
    for mode in ba.MODES:
        assert f"MISSING leaderboard {mode} for sdpa: error: RuntimeError: No available kernel" in lines
    assert "need a CUDA GPU" in ba.goal_report(_goal_rows(), on_cuda=False)[0]


def test_executed_flops_follow_each_design() -> None:
    from benchmarks import bench_attention as ba

    cell = _cell(seq=1024, d_head=64)
    model = attention_flops(6, 1024, 1024, 64, causal=True, mode="forward_backward")
    # The kit's Triton design: 2 forward + 7 backward matmuls on the causal half = 1.5 × the model's 3 × 2.
    assert ba.executed_flops("flash_triton", cell, "forward_backward", on_cuda=True) == pytest.approx(1.5 * model)
    # Naive attention computes the whole masked matrix: twice the causal model count.
    assert ba.executed_flops("naive", cell, "forward_backward", on_cuda=False) == pytest.approx(2 * model)
    # FlashAttention-2 (SDPA's flash backend): 5 backward matmuls.
    assert ba.executed_flops("sdpa", cell, "backward", on_cuda=True) == pytest.approx(
        1.25 * attention_flops(6, 1024, 1024, 64, causal=True, mode="backward"))
    assert ba.executed_flops("sdpa", _cell(dtype="fp32"), "forward", on_cuda=True) is None
