"""kit.triton_compile's IR readers, on small hand-written Triton IR (no compiler needed)."""

from __future__ import annotations

from kit.triton_compile import narrow_offsets

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
