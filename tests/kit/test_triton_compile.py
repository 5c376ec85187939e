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
