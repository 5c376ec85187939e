"""Every GPU launch config of the reference FlashAttention kernels compiles for an H100 (sm_90) — no GPU needed.

The kernels' speed on a GPU rests on properties the CPU interpreter cannot show, but the compiler can:
``tl.dot`` must lower to Hopper's warpgroup MMA (``wgmma`` in the PTX: without it the tensor cores run at a
fraction of their rate), the pipelined tiles must fit the 227 KiB of shared memory a block may use, and
ptxas must not spill registers to local memory (each spill is a round trip through L1 in the hot loop).
This test compiles each autotune candidate (``triton_config.gpu_configs(kind, D)``) and each fixed config of
every kernel (forward, both backward designs), for bf16 and fp16, at head dims 64 and 128, causal and not,
with Triton's own compiler and ptxas (shipped with Triton), as a launch on tensors whose addresses, strides
and lengths are multiples of 16 builds it (``kit.triton_compile``), and fails when any of them loses wgmma,
overflows shared memory or spills: a kernel change that does so fails CI instead of a benchmark weeks later.

``make test`` runs a representative subset (causal, one dtype per head dim: bf16 at D = 128, fp16 at D = 64
— the variants with the most code and the most registers); ``make check-kernels`` sets
``LLMSYS_KERNEL_SWEEP=full`` and compiles the full sweep (both dtypes × both head dims × causal and not).
Not checked here (needs a GPU): the speed itself, and the fp32 path (CUDA cores, not tuned).
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
import torch

import kit  # noqa: F401 — before triton
from instructor import gpu_check
from kit import triton_compile
from kit.impl import load
from tests.support import launch_cases

ROOT = Path(__file__).resolve().parents[2]
FULL = os.environ.get("LLMSYS_KERNEL_SWEEP", "") == "full"
SUBSET = [("bf16", 128, True), ("fp16", 64, True)]
SWEEP = [(dt, d, c) for dt in ("bf16", "fp16") for d in (64, 128) for c in (True, False)] if FULL else SUBSET
GPU_CONSTEXPRS = {"UPCAST": False, "DOT_PRECISION": "tf32"}  # what a GPU launch passes for bf16/fp16


def recorded_launches(package, head_dim: int, is_causal: bool) -> list:
    """The fp16 launches of one forward + backward (each backward design) in the interpreter, not run: the
    arguments and constexprs of every kernel, to be compiled with each candidate's tiles. Lengths 256 and
    contiguous tensors make every address, stride and length a multiple of 16, as at the goal shapes, so the
    check builds what those launches build (kit.triton_compile: Triton specialises on it)."""
    fa = package.flash_attention
    q, k, v, do = launch_cases.make((2, 256, head_dim), (2, 256, head_dim), "contiguous")

    def forward_and_backward():
        for design in fa.triton_config.BACKWARD_DESIGNS:
            with mock.patch.object(fa.triton_config, "BACKWARD", design):
                o = fa.FlashAttentionTriton.apply(*(t.clone().requires_grad_() for t in (q, k, v)), is_causal)
                o.backward(do)

    return triton_compile.record_launches(forward_and_backward, execute=False)


def candidate_launches(package) -> list:
    """One :class:`~kit.triton_compile.Launch` per (kernel, config, dtype, head dim, causal) of :data:`SWEEP`."""
    config = package.flash_attention.triton_config
    kinds = {launcher.kernel.__name__: launcher.kind for launcher in gpu_check.launchers(package.flash_attention)}
    launches = []
    for d, causal in sorted({(d, c) for _, d, c in SWEEP}):
        for template in recorded_launches(package, d, causal):
            template = triton_compile.with_config(template, {k: v for k, v in GPU_CONSTEXPRS.items()
                                                             if k in template.args})
            for dtype in sorted({dt for dt, dd, cc in SWEEP if (dd, cc) == (d, causal)}):
                typed = triton_compile.with_dtype(template, "fp16", dtype)
                kind = kinds.get(template.name)
                if kind is None:  # the preprocess kernel: one fixed tile size
                    launches.append(typed)
                    continue
                tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
                configs = [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
                           for c in config.gpu_configs(kind, d)] + [config.fixed_config(kind, tdtype, d)]
                for c in {tuple(sorted(c.items())): c for c in configs}.values():
                    launches.append(triton_compile.with_config(typed, c))
    return launches


def test_every_gpu_config_compiles_with_wgmma_no_spills_within_shared_memory(tmp_path):
    package = load("reference")
    launches = candidate_launches(package)
    reports = triton_compile.compile_launches(launches, tmp_path, ROOT, timeout=3000)
    problems, rows = [], []
    for r in reports:
        a = r.launch.args
        what = (f"{r.launch.name} {next(x['dtype'] for x in a.values() if x['kind'] == 'ptr')} "
                f"D={a['HEAD_DIM']['value']} causal={a.get('IS_CAUSAL', {}).get('value')} "
                f"BLOCK_M={a['BLOCK_M']['value']} BLOCK_N={a.get('BLOCK_N', {}).get('value')} "
                f"warps={r.launch.options.get('num_warps', 4)} stages={r.launch.options.get('num_stages', 3)}")
        rows.append(f"{what}: {r.registers} regs, {r.spills} B spilled, {r.shared / 1024:.0f} KiB shared, "
                    f"wgmma={r.wgmma}" if not r.error else f"{what}: ERROR")
        if r.error:
            problems.append(f"{what}: does not compile: {r.error[-300:]}")
            continue
        if r.shared > triton_compile.SM90_SHARED_BYTES:
            problems.append(f"{what}: {r.shared} B of shared memory > {triton_compile.SM90_SHARED_BYTES} (227 KiB)")
        if r.spills:
            problems.append(f"{what}: spills {r.spills} B of registers ({r.ptxas.splitlines()[-2:]})")
        if "BLOCK_N" in a and not r.wgmma:  # the preprocess kernel has no tl.dot
            problems.append(f"{what}: no wgmma in the PTX — tl.dot fell back to mma.sync (or FMA)")
    print("\n".join(rows))
    assert not problems, (
        f"{len(problems)} of {len(reports)} GPU launch configs of the FlashAttention kernels break on sm_90 "
        "(drop or shrink them in triton_config.GPU_CANDIDATES / fixed_config, or fix the kernel):\n  "
        + "\n  ".join(problems))


@pytest.mark.parametrize("kind", ["forward", "dkdv", "dq", "fused"])
def test_candidates_keep_the_tile_alignment_rule(kind):
    """BLOCK_M a multiple of BLOCK_N (forward, dQ), BLOCK_N a multiple of BLOCK_M (dK/dV, fused): the causal
    diagonal then falls on a tile boundary (handout 03 §4). The kernels assert it too (tl.static_assert)."""
    config = load("reference").flash_attention.triton_config
    for c in config.GPU_CONFIGS[kind]:
        m, n = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        assert config.aligned(kind, m, n), f"{kind} candidate {c} breaks the alignment rule"


def test_a_misaligned_config_fails_to_compile(tmp_path):
    """The alignment rule is checked by each kernel (tl.static_assert), so a config that breaks it fails to compile
    instead of computing wrong gradients on a GPU only (the interpreter uses its own aligned tiles)."""
    package = load("reference")
    kinds = {launcher.kernel.__name__: launcher.kind for launcher in gpu_check.launchers(package.flash_attention)}
    bad = {"forward": (64, 128), "dkdv": (128, 64), "dq": (64, 128), "fused": (128, 64)}
    launches = [triton_compile.with_config(la, {**GPU_CONSTEXPRS, "BLOCK_M": bad[kinds[la.name]][0],
                                                "BLOCK_N": bad[kinds[la.name]][1]})
                for la in recorded_launches(package, 64, True) if la.name in kinds]
    reports = triton_compile.compile_launches(launches, tmp_path, ROOT)
    # (the forward runs once per backward design, so it is recorded twice)
    assert sorted({kinds[r.launch.name] for r in reports}) == ["dkdv", "dq", "forward", "fused"]
    for r in reports:
        assert "must be a multiple of" in r.error, f"{r.launch.name} compiled a misaligned config: {r.error[-300:]}"
