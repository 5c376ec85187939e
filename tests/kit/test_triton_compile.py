"""kit.triton_compile: its IR readers, on small hand-written Triton IR (no compiler needed), and its faithfulness
— what it compiles is what a GPU launch of the recorded arguments compiles."""

from __future__ import annotations

from pathlib import Path

import torch

import kit  # noqa: F401 — before triton
from kit import triton_compile
from kit.triton_compile import narrow_offsets
from tests.support import launch_cases

HEADER = "  tt.func public @kernel(%K: !tt.ptr<f16>, %stride_b: i32, %stride_n: i32, %N: i32) {\n"


def test_narrow_offsets_flags_a_32_bit_batch_head_product():
    ttir = HEADER + """
    %bh = tt.get_program_id x : i32
    %off = arith.muli %bh, %stride_b : i32
"""
    assert narrow_offsets(ttir, 0) == ["%off = arith.muli %bh, %stride_b : i32"]
    assert narrow_offsets(ttir.replace(": i32\n", ": i64\n"), 0) == []


def test_narrow_offsets_is_not_fooled_by_names_reused_in_sibling_loops():
    # MLIR prints SSA names per region: two loops one after the other both define %k_44 … The second loop's
    # %k_45 (a splat of the 32-bit stride) is not the first loop's %k_45 (a pointer offset by bh).
    ttir = HEADER + """
    %bh = tt.get_program_id x : i32
    %bh_64 = arith.extsi %bh : i32 to i64
    %base = arith.muli %bh_64, %stride_b_64 : i64
    %k_base = tt.addptr %K, %base : !tt.ptr<f16>, i64
    %r:1 = scf.for %start_n = %c0 to %N step %c32 iter_args(%a = %z) -> (tensor<32xf32>) : i32 {
      %k_44 = arith.muli %start_n, %stride_n : i32
      %k_45 = tt.splat %k_base : !tt.ptr<f16> -> tensor<32x!tt.ptr<f16>>
    }
    %s:1 = scf.for %start_n = %N to %N step %c32 iter_args(%a = %r#0) -> (tensor<32xf32>) : i32 {
      %k_44 = tt.splat %start_n : i32 -> tensor<32xi32>
      %k_45 = tt.splat %stride_n : i32 -> tensor<32xi32>
      %k_46 = arith.muli %k_44, %k_45 : tensor<32xi32>
    }
"""
    assert narrow_offsets(ttir, 0) == []
    # … while a loop whose bound comes from the batch·head id still taints its induction variable.
    tainted = ttir.replace("scf.for %start_n = %N to %N", "scf.for %start_n = %bh to %N")
    assert narrow_offsets(tainted, 0) == ["%k_46 = arith.muli %k_44, %k_45 : tensor<32xi32>"]


def test_as_3d_copies_views_whose_row_offsets_pass_32_bits():
    """The kernels' row offsets are 32-bit: a view with rows ≥ 2³¹ elements apart is made contiguous."""
    import torch

    from kit.impl import load

    as_3d = load("reference").flash_attention.checks.as_3d
    # (B·H, T, D) = (3, 2²⁷, 16) as a transpose of (T, B·H, D): row stride 48, (T − 1) · 48 > 2³¹. Meta tensors
    # have shapes and strides but no storage, so nothing of that size is allocated.
    far = torch.empty((2**27, 3, 16), device="meta").transpose(0, 1)
    assert as_3d(far).stride() == (2**27 * 16, 16, 1)
    near = torch.empty((40, 3, 16)).transpose(0, 1)  # small: the strided view is kept (no copy)
    assert as_3d(near).stride() == (16, 48, 1) and as_3d(near).data_ptr() == near.data_ptr()


# ---------------------------------------------------------------------------------------------------------
# The compile check builds what a launch builds: Triton's launcher specialises a kernel on its arguments
# (addresses and integers divisible by 16, integers equal to 1) before compiling it, and the kit's check must
# hand the compiler the same thing. Ground truth: the same launches with real tensors, interpreter off,
# through the kernels' launchers and Triton's launch path (tests/support/launch_cases.py), in a child.

ROOT = Path(__file__).resolve().parents[2]


def kinds(fa) -> dict[str, str]:
    """Kernel name → launcher kind ("forward", "dkdv", "dq") of the package ``fa``."""
    from instructor import gpu_check

    return {launcher.kernel.__name__: launcher.kind for launcher in gpu_check.launchers(fa)}


def recorded(fa, q, k, v, do, is_causal) -> list:
    """The launches of one forward + backward under the interpreter, not run (nothing is compared)."""
    return triton_compile.record_launches(lambda: launch_cases.forward_backward(fa, q, k, v, do, is_causal),
                                          execute=False)


def test_the_check_specialises_each_launch_as_triton_s_launcher_does(tmp_path):
    fa = launch_cases.reference()
    by_name = kinds(fa)
    launches, labels = [], []
    for label, (q_shape, kv_shape, is_causal, how) in launch_cases.CASES.items():
        for la in recorded(fa, *launch_cases.make(q_shape, kv_shape, how), is_causal):
            kind = by_name.get(la.name)
            if kind is not None:  # off the interpreter, a launcher without autotuning uses its fixed config
                d = la.args["HEAD_DIM"]["value"]
                la = triton_compile.with_config(la, fa.triton_config.fixed_config(kind, torch.float16, d))
            launches.append(la)
            labels.append(f"{label}: {la.name}")
    ours = triton_compile.launch_specialisations(launches, tmp_path / "ours", ROOT)
    truth = triton_compile.launched_specialisations("tests.support.launch_cases:launch_cases", tmp_path / "real", ROOT)
    assert len(truth) == len(ours), f"{len(truth)} kernels compiled by the real launches, {len(ours)} recorded"
    for label, mine, real in zip(labels, ours, truth):
        assert "error" not in mine, f"{label}: {mine}"
        for part in ("name", "signature", "constants", "attrs", "options"):
            assert mine[part] == real[part], (f"{label}: {part} differs from a launch's:\n  kit  {mine[part]}\n"
                                              f"  real {real[part]}")

    # The cases do reach the specialisation: what is and is not marked divisible by 16, or made a constant.
    def case(label: str, name: str = "flash_fwd_kernel") -> dict:
        return next(m for lab, m in zip(labels, ours) if lab == f"{label}: {name}")

    divisible = lambda spec, arg: ["tt.divisibility", 16] in spec["attrs"].get(arg, [])  # noqa: E731
    aligned = case("lengths multiples of 16")
    assert all(divisible(aligned, a) for a in ("Q", "K", "stride_qb", "stride_qn", "stride_lb", "Nq", "Nk"))
    assert not divisible(case("lengths 40 and 72"), "Nq") and not divisible(case("lengths 40 and 72"), "stride_lb")
    padded = case("row stride 72, not a multiple of 16")
    assert not divisible(padded, "stride_qn") and divisible(padded, "stride_qb") and divisible(padded, "Q")
    misaligned = case("q 2 bytes past an aligned address")
    assert not divisible(misaligned, "Q") and divisible(misaligned, "K")
    one_row = case("one query row")
    assert one_row["signature"]["Nq"] == "constexpr" and one_row["constants"]["Nq"] == 1


def test_the_check_compiles_what_a_launch_compiles(tmp_path):
    """Registers, spills and shared memory of the configs issue 29 measured, by the kit's check and by a launch."""
    fa = launch_cases.reference()
    bh, n = launch_cases.CONFIG_SHAPE
    launches = []
    for kind, d, is_causal, (m, bn, w, s) in launch_cases.ISSUE_CONFIGS:
        q, k, v, do = launch_cases.make((bh, n, d), (bh, n, d), "contiguous", torch.bfloat16)
        name = next(name for name, kd in kinds(fa).items() if kd == kind)
        la = next(la for la in recorded(fa, q, k, v, do, is_causal) if la.name == name)
        launches.append(triton_compile.with_config(la, {"UPCAST": False, "DOT_PRECISION": "tf32", "BLOCK_M": m,
                                                        "BLOCK_N": bn, "num_warps": w, "num_stages": s}))
    # Three children side by side, whatever this machine's CPUs: each report must land with its own launch.
    cache = tmp_path / "cache"
    ours = triton_compile.compile_launches(launches, tmp_path / "ours", ROOT, jobs=3, cache=cache)
    real = [triton_compile.CompileReport(launches[0], **r) for r in triton_compile.compile_launched(
        "tests.support.launch_cases:launch_configs", tmp_path / "real", ROOT)]
    rows = []
    for mine, (kind, d, is_causal, config) in zip(ours, launch_cases.ISSUE_CONFIGS):
        assert not mine.error, mine.error
        constants = {k: mine.inputs["constants"][k] for k in ("BLOCK_M", "BLOCK_N", "HEAD_DIM", "IS_CAUSAL")}
        match = [r for r in real if r.inputs["name"] == mine.inputs["name"] and r.inputs["options"] ==
                 mine.inputs["options"] and all(r.inputs["constants"][k] == v for k, v in constants.items())]
        assert len(match) == 1, f"{kind} D={d} {config}: {len(match)} real launches compiled it"
        got = (mine.registers, mine.spills, mine.shared)
        want = (match[0].registers, match[0].spills, match[0].shared)
        rows.append(f"{kind} D={d} causal={is_causal} {config}: kit {got}, launch {want}")
        assert mine.inputs == match[0].inputs and got == want, "\n".join(rows)
    print("\n".join(rows))

    # Again from the same cache (as the graded checks compile, user_cache_dir): nothing is built again (no file
    # of the cache is rewritten) and every report is the same, ptxas's lines included: a binary from the cache
    # printed nothing, so the kit keeps its build's log beside it.
    def files() -> dict[Path, int]:
        return {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}

    built = files()
    again = triton_compile.compile_launches(launches, tmp_path / "again", ROOT, jobs=3, cache=cache)
    assert files() == built, "compiled again from the same cache, some binaries were built again"
    assert [(r.error, r.shared, r.ptxas, r.ttir, r.inputs) for r in again] == \
        [(r.error, r.shared, r.ptxas, r.ttir, r.inputs) for r in ours]
    assert all("ptxas info" in r.ptxas for r in again)


def test_a_compile_failure_keeps_the_compiler_s_reason(tmp_path):
    """Triton's CompilationError names the source line; its reason ("K >= 16" for a tl.dot summing over 8
    elements) is in the chained exception. The report keeps the chain, so the graded compile checks can say why."""
    fa = launch_cases.reference()
    bh, n = launch_cases.CONFIG_SHAPE
    kind, d, is_causal, _ = launch_cases.ISSUE_CONFIGS[0]
    q, k, v, do = launch_cases.make((bh, n, d), (bh, n, d), "contiguous", torch.bfloat16)
    name = next(name for name, kd in kinds(fa).items() if kd == kind)
    la = next(la for la in recorded(fa, q, k, v, do, is_causal) if la.name == name)
    la = triton_compile.with_config(la, {"UPCAST": False, "DOT_PRECISION": "tf32", "BLOCK_M": 16, "BLOCK_N": 8,
                                         "num_warps": 4, "num_stages": 1})
    (report,) = triton_compile.compile_launches([la], tmp_path / "ours", ROOT, jobs=1, cache=tmp_path / "cache")
    assert report.error.startswith("CompilationError"), report.error
    assert "K >= 16" in report.error and "caused by" in report.error, report.error
