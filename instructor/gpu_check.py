"""``make gpu-check``: everything the kit promises about a GPU, checked in one command (< 8 min on one H100).

On a machine without CUDA it says so and exits 0. On a GPU it runs these steps, each in its own process
under its own time limit (:func:`steps`; the limits add up to :data:`BUDGET_S`), and writes every log and
table under ``benchmarks/results/gpu/``, stamped with the device and library versions:

1. ``python -m kit doctor``                              → doctor.log
2. every ``gpu``-marked test (``pytest -m gpu``)           → gpu_tests.log
3. each GPU-kernel stage's graded and hidden tests, compiled → stage<N>_compiled.log (TRITON_INTERPRET unset)
4. ``python -m benchmarks.bench_attention --goals``        → bench_attention.{md,csv,json} (Triton and SDPA flash)
5. the numeric cross-check against SDPA at the leaderboard shape, then the autotuned config of every kernel
   with its registers, spills, shared memory and wgmma use → crosscheck.*, kernels.*
6. one train step of the ``small`` preset per dtype with MFU → train_step.*

then ``summary.md`` (one row per step) and, printed last, the goal comparison of handout 03 §7. The exit
status is 1 when a correctness step (tests, cross-check, train step) fails or runs out of time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kit import stages as registry
from kit.results import RESULTS_DIR, ROOT, environment, markdown_table, save_results

OUT = RESULTS_DIR / "gpu"
#: A compiled stage's test limit: Stage 3 compiles many shapes' kernels; Stage 7's tests are few and small.
COMPILED_STAGE_S = {3: 90, 7: 60}
BUDGET_S = 450  # the sum of the step limits: 7.5 min, inside the 8-minute promise
LEADERBOARD = dict(batch_heads=16, seq=16384, d_head=64, causal=True)  # (batch·heads, N, D), bf16
BF16_U = 2.0**-8  # unit roundoff of bf16 (8 significand bits)
TRAIN = dict(preset="small", batch_size=8, context_length=1024)
NEEDS_CUDA = ("make gpu-check needs a CUDA GPU, and this machine has none (torch.cuda.is_available() is False).\n"
              "Nothing was run. On a GPU machine: `make setup GPU=1` (offline: WHEELS=dir, see INSTRUCTOR.md "
              "'Running on a GPU'), then `make gpu-check`; results go to benchmarks/results/gpu/.")


@dataclass
class Step:
    """One command of the check: ``argv`` run from the repository root for at most ``timeout_s`` seconds;
    ``env`` entries set (None: unset) in its environment; a failing ``correctness`` step fails the check.
    ``empty_code``: an exit status that means "nothing to run" (pytest's 5: no test selected), not a failure."""

    name: str
    argv: list[str]
    timeout_s: int
    correctness: bool
    env: dict[str, str | None] = field(default_factory=dict)
    empty_code: int | None = None


@dataclass
class Outcome:
    name: str
    status: str  # "passed", "failed (exit N)", "timed out after N s", "skipped: …"
    seconds: float
    correctness: bool

    @property
    def ok(self) -> bool:
        return self.status in ("passed", "nothing selected")


def steps(out: Path = OUT, python: str = sys.executable) -> list[Step]:
    """The steps of the check, in order, with their time limits (seconds on one H100, generous)."""
    me = [python, "-m", "instructor.gpu_check", "--out", str(out), "--step"]
    pytest = [python, "-m", "pytest", "--impl", "reference", "-q", "-p", "no:cacheprovider"]
    # The test steps launch the kernels with their fixed configs (LLMSYS_FA_AUTOTUNE=0): compiled, but not
    # autotuned for each of the tests' many small shapes. The autotuned path is what bench_attention and the
    # cross-check run, at the goal shapes.
    fixed = {"TRITON_INTERPRET": None, "LLMSYS_FA_AUTOTUNE": "0"}
    return [
        Step("doctor", [python, "-m", "kit", "doctor"], 20, False),
        Step("gpu_tests", pytest + ["tests", "-m", "gpu"], 60, True, env=fixed, empty_code=5),
        *(Step(f"stage{stage.number}_compiled", pytest + [str(p.relative_to(ROOT)) for p in stage.test_paths(ROOT)],
               COMPILED_STAGE_S.get(stage.number, 60), True, env=fixed)
          for stage in registry.STAGES if stage.gpu_kernels),
        Step("bench_attention", [python, "-m", "benchmarks.bench_attention", "--goals", "--impl", "reference",
                                 "--out", str(out)], 120, False),
        Step("crosscheck", me + ["crosscheck"], 50, True),
        Step("train_step", me + ["train"], 45, True),
    ]


Runner = Callable[..., subprocess.CompletedProcess]


def run_step(step: Step, out: Path, *, seconds_left: float, runner: Runner = subprocess.run) -> Outcome:
    """Run ``step`` with its output in ``out/<name>.log`` (stamped first); never longer than ``seconds_left``."""
    limit = min(step.timeout_s, seconds_left)
    if limit < 5:
        return Outcome(step.name, "skipped: time budget spent", 0.0, step.correctness)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for key, value in step.env.items():
        env.pop(key, None) if value is None else env.__setitem__(key, value)
    log = out / f"{step.name}.log"
    stamp = "".join(f"# {k}: {v}\n" for k, v in environment().items() if k != "command")
    start = time.perf_counter()
    with open(log, "w") as f:
        f.write(stamp + f"# step: {' '.join(step.argv)}\n\n")
        f.flush()
        try:
            proc = runner(step.argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=limit)
            status = ("passed" if proc.returncode == 0 else "nothing selected" if proc.returncode == step.empty_code
                      else f"failed (exit {proc.returncode})")
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit:.0f} s"
    return Outcome(step.name, status, time.perf_counter() - start, step.correctness)


def run_all(out: Path, *, runner: Runner = subprocess.run, budget_s: float = BUDGET_S,
            plan: list[Step] | None = None) -> list[Outcome]:
    """Every step in order under one overall budget; a step's failure does not stop the ones after it."""
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + budget_s
    outcomes = []
    for step in plan if plan is not None else steps(out):
        print(f"== gpu-check: {step.name} (≤ {step.timeout_s} s)", flush=True)
        outcomes.append(run_step(step, out, seconds_left=deadline - time.perf_counter(), runner=runner))
        print(f"   {outcomes[-1].status} in {outcomes[-1].seconds:.0f} s → {out / (step.name + '.log')}", flush=True)
        log = out / f"{step.name}.log"
        if not outcomes[-1].ok and log.exists():  # the end of a failing step's log, where the reason usually is
            print("".join(f"   | {line}\n" for line in log.read_text().splitlines()[-15:]), end="", flush=True)
    return outcomes


def goal_lines(out: Path) -> list[str]:
    """The goal comparison from ``out/bench_attention.json`` (bench_attention's own report), or why it is missing."""
    path = out / "bench_attention.json"
    if not path.exists():
        return ["!! goal comparison missing: bench_attention wrote no bench_attention.json (see bench_attention.log)"]
    from benchmarks.bench_attention import goal_report

    data = json.loads(path.read_text())
    return goal_report(data["rows"], True, data["environment"].get("device", ""))


def summary(outcomes: list[Outcome], out: Path) -> tuple[str, int]:
    """The step table (written to ``out/summary.md``, stamped) and the exit status: 1 if a correctness step
    did not pass."""
    rows = [{"step": o.name, "status": o.status, "seconds": round(o.seconds, 1),
             "gates the exit status": "yes" if o.correctness else "no", "log": f"{o.name}.log"} for o in outcomes]
    env = environment()
    text = "## make gpu-check\n\n" + " · ".join(f"{k}: {v}" for k, v in env.items()) + "\n\n" + markdown_table(rows)
    failed = [o.name for o in outcomes if o.correctness and not o.ok]
    text += "\n\n" + (f"FAILED correctness steps: {', '.join(failed)}" if failed else "All correctness steps passed.")
    (out / "summary.md").write_text(text + "\n")
    return text, 1 if failed else 0


# ------------------------------------------------------------------ steps that run inside this module


def crosscheck_tolerances(o_abs, v_absmax: float):
    """Elementwise forward tolerance between two bf16 FlashAttention outputs, from the error model:
    each rounds P to bf16 before P·V (error ≤ u·Σ_j p_j|v_j| ≤ u·max|v|, fp32 accumulation negligible)
    and rounds O to bf16 (≤ u·|o|), so each is within u·(|o| + max|v|) of the exact result and two of
    them within twice that. Gradients: three chained bf16 roundings per term (P, dS, the output) in each
    implementation, with cancellations in dS = P∘(dP − Δ): checked normwise, ‖a − b‖ / ‖b‖ ≤ 8u."""
    return 2 * BF16_U * (o_abs + v_absmax), 8 * BF16_U


def crosscheck(out: Path, shape: dict = LEADERBOARD, device: str = "cuda") -> bool:
    """Triton vs SDPA's flash backend at ``shape`` (default: the leaderboard's), forward and backward, causal,
    bf16 — the Triton backward once per design (``triton_config.BACKWARD_DESIGNS``: on a GPU either may be the
    one that runs). Returns pass/fail. (``device="cpu"`` with a small shape runs the same code in the test
    suite.)"""
    from unittest import mock

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kit.impl import load

    impl = load("reference")
    config = impl.flash_attention.triton_config
    bh, n, d = shape["batch_heads"], shape["seq"], shape["d_head"]
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(bh, n, d, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(4))

    def run(design: str | None):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        if design is not None:
            with mock.patch.object(config, "BACKWARD", design):
                o = impl.flash_attention.flash_attention(qq, kk, vv, True)
                o.backward(do)
        else:  # 4-D (1, BH, N, D): the fused SDPA backends need 4-D inputs
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(qq[None], kk[None], vv[None], is_causal=True)[0]
            o.backward(do)
        if device == "cuda":
            torch.cuda.synchronize()
        return o.detach(), [t.grad for t in (qq, kk, vv)]

    o_ref, grads_ref = run(None)
    atol, grad_rtol = crosscheck_tolerances(o_ref.float().abs(), v.float().abs().max().item())
    rows = []
    for design in config.BACKWARD_DESIGNS:
        o, grads = run(design)
        diff = (o.float() - o_ref.float()).abs()
        excess = diff - atol
        worst = int(excess.argmax())
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
        rows.append({"backward design": design, "quantity": "O",
                     "check": "elementwise abs(Δ) ≤ 2u(abs(o) + max abs(v))",
                     "worst": float(diff.flatten()[worst]), "bound": float(atol.flatten()[worst]),
                     "where (bh, row, col)": str(where), "ok": bool(excess.max() <= 0)})
        for name, a, b in zip(("dQ", "dK", "dV"), grads, grads_ref):
            rel = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
            rows.append({"backward design": design, "quantity": name, "check": "‖Δ‖ / ‖sdpa‖ ≤ 8u", "worst": rel,
                         "bound": grad_rtol, "where (bh, row, col)": "normwise",
                         "ok": bool(math.isfinite(rel) and rel <= grad_rtol)})
    save_results("crosscheck", rows, out_dir=out, title=f"Triton (each backward design) vs SDPA flash at {bh} × {n} "
                 f"× {d} ((batch·heads, N, D), causal, bf16); u = 2⁻⁸", stamp={"impl": "reference"})
    save_results("kernels", kernel_report([impl.flash_attention]), out_dir=out,
                 title="Autotuned config per kernel (chosen = the autotuner's pick; compiled for this GPU)")
    return all(r["ok"] for r in rows)


def launchers(package) -> list:
    """The kernel launchers (objects with ``kernel``, ``kind``, ``tuned`` and ``chosen``) of a flash_attention
    package: those its ``triton_config.configure`` made."""
    config = sys.modules.get(f"{package.__name__}.triton_config")
    return list(getattr(config, "LAUNCHERS", []))


def kernel_report(packages) -> list[dict]:
    """One row per compiled variant of each kernel: tiles, warps, stages, registers, spills, shared memory,
    wgmma in the PTX, and whether the autotuner chose it (``chosen``: yes, no, or fixed = not autotuned)."""
    from kit.triton import triton_private

    rows = []
    for launcher in [lch for pkg in packages for lch in launchers(pkg)]:
        picks = list(getattr(launcher, "chosen", {}).values()) if getattr(launcher, "tuned", None) is not None else []
        for compiled in triton_private.compiled_variants(launcher.kernel):
            rows.append(compiled_row(launcher.kind, compiled, picks))
    return rows


def compiled_row(kind: str, compiled, picks: list[dict]) -> dict:
    """Metrics of one ``triton.compiler.CompiledKernel``; ``picks`` are the configs the launcher chose
    (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``)."""
    from kit.triton import triton_private

    constants = triton_private.compiled_constants(compiled)
    meta = compiled.metadata
    blocks = {k: constants[k] for k in ("BLOCK_M", "BLOCK_N", "HEAD_DIM", "IS_CAUSAL") if k in constants}
    try:
        regs, spills = triton_private.loaded_resources(compiled)
    except Exception as exc:  # e.g. OutOfResources: still report the row
        regs, spills = None, f"not loaded ({type(exc).__name__})"
    mine = {"BLOCK_M": blocks.get("BLOCK_M"), "BLOCK_N": blocks.get("BLOCK_N"), "num_warps": meta.num_warps,
            "num_stages": meta.num_stages}
    picked = any(all(p.get(k) == v for k, v in mine.items()) for p in picks)
    chosen = "fixed" if not picks else "yes" if picked else "no"
    return {"kernel": kind, **blocks, "warps": meta.num_warps, "stages": meta.num_stages, "chosen": chosen,
            "registers": regs, "spills": spills, "shared_kib": round(meta.shared / 1024, 1),
            "wgmma": "wgmma" in compiled.asm.get("ptx", "")}


def train(out: Path, setting: dict = TRAIN, device: str = "cuda") -> bool:
    """One train step (AdamW, after warm-up) of ``setting``'s preset per dtype, with MFU. Returns pass/fail."""
    import torch

    from kit.flops import peak_flops, transformer_flops
    from kit.impl import load
    from kit.model import get_config

    bm = load("reference").benchmarking
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    config = get_config(setting["preset"], context_length=setting["context_length"])
    rows = []
    for dtype in ("fp32", "bf16", "fp16"):
        r = bm.benchmark_model(setting["preset"], context_length=setting["context_length"], device=device,
                               batch_size=setting["batch_size"], mode="train_step", dtype=dtype, warmup=2, iters=3)
        flops = transformer_flops(config, setting["batch_size"], setting["context_length"], "train_step")
        peak = peak_flops(name, dtype)
        seconds = r["timing"].median
        rows.append({"dtype": dtype, **setting, "ms": seconds * 1e3, "tokens_per_s": r["tokens_per_s"],
                     "model_tflops": flops / seconds / 1e12,
                     "mfu_percent": None if peak is None else 100 * flops / seconds / peak,
                     "ok": bool(math.isfinite(seconds) and seconds > 0)})
        if device == "cuda":
            torch.cuda.empty_cache()
    save_results("train_step", rows, out_dir=out, title=f"One train step (AdamW) of {setting['preset']} per dtype; "
                 "MFU on model FLOPs (kit/flops.py)", stamp={"impl": "reference"})
    return all(r["ok"] for r in rows)


def main(argv: list[str] | None = None, *, cuda: bool | None = None, runner: Runner = subprocess.run) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=OUT, help="where the logs and tables go (default: %(default)s)")
    p.add_argument("--step", choices=("crosscheck", "train"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda:
        print(NEEDS_CUDA)
        return 0
    if args.step is not None:
        os.environ.pop("TRITON_INTERPRET", None)
        return 0 if {"crosscheck": crosscheck, "train": train}[args.step](args.out) else 1
    outcomes = run_all(args.out, runner=runner)
    text, status = summary(outcomes, args.out)
    print("\n" + text + "\n\nGoals (handout 03 §7):\n" + "\n".join(goal_lines(args.out)))
    return status


if __name__ == "__main__":
    sys.exit(main())
