"""Launches of the reference FlashAttention kernels whose GPU build the kit's compile check must reproduce.

Used twice by ``tests/kit/test_triton_compile.py`` and ``tests/kit/test_kernel_candidates.py``: recorded in the
test process under the interpreter (what ``kit.triton_compile`` compiles), and launched for real by
:func:`launch_cases` / :func:`launch_configs` in a child process with the interpreter off, through the
kernels' own launchers and Triton's launch path, stopped before the GPU would be needed (the ground truth).
The kernels are launched directly (``triton_attention_forward``/``_backward``), not through autograd: the
CPU tensors of the child would otherwise be refused before any kernel is reached.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

# name → (q shape, k/v shape, head dim, is_causal, how the tensors are made): fp16 (the dtype whose launch
# constexprs the interpreter and a GPU share).
CASES = {
    "lengths multiples of 16": ((2, 3, 64, 64), (2, 3, 128, 64), True, "contiguous"),
    "lengths 40 and 72": ((6, 40, 64), (6, 72, 64), True, "contiguous"),
    "row stride 72, not a multiple of 16": ((6, 48, 64), (6, 80, 64), False, "padded rows"),
    "q 2 bytes past an aligned address": ((6, 48, 32), (6, 48, 32), True, "misaligned q"),
    "(B, H, T, D) view of (T, B, H, D)": ((2, 3, 40, 16), (2, 3, 56, 16), True, "permuted"),
    "one query row": ((6, 1, 64), (6, 33, 64), False, "contiguous"),
}


def make(q_shape, kv_shape, how: str, dtype=torch.float16) -> tuple[torch.Tensor, ...]:
    """q, k, v, dO of these shapes, laid out as ``how`` says (values do not matter: nothing is compared)."""
    def one(shape):
        if how == "padded rows":  # each row of D elements starts 72 elements after the previous one
            return torch.zeros(*shape[:-1], 72, dtype=dtype)[..., : shape[-1]]
        if how == "permuted":  # (B, H, T, D) as a view of a (T, B, H, D) tensor
            b, h, t, d = shape
            return torch.zeros(t, b, h, d, dtype=dtype).permute(1, 2, 0, 3)
        return torch.zeros(shape, dtype=dtype)

    q, k, v, do = one(q_shape), one(kv_shape), one(kv_shape), one(q_shape)
    if how == "misaligned q":
        q = torch.zeros(q.numel() + 1, dtype=dtype)[1:].view(q.shape)
    return q, k, v, do


def forward_backward(fa, q, k, v, do, is_causal: bool) -> None:
    """One forward and one backward through the package ``fa``'s launchers (whatever they compute)."""
    o, L = fa.triton_forward.triton_attention_forward(q, k, v, is_causal)
    fa.triton_backward.triton_attention_backward(q, k, v, o, L, do, is_causal)


def reference():
    from kit.impl import load

    return load("reference").flash_attention


def launch_cases() -> None:
    """Every case of :data:`CASES`, in order (the child's target: real tensors, real launch path)."""
    fa = reference()
    for q_shape, kv_shape, is_causal, how in CASES.values():
        forward_backward(fa, *make(q_shape, kv_shape, how), is_causal)


# (kind, head dim, is_causal, (BLOCK_M, BLOCK_N, warps, stages)): the configs issue 29 reports compiled as a
# launch compiles them, bf16 on sm_90 (registers / spilled bytes / shared memory there: 254 / 0 / 64 KiB,
# 254 / 0 / 160 KiB, 144 / 0 / 81 KiB, 215 / 0 / 72 KiB).
ISSUE_CONFIGS = [
    ("forward", 64, True, (128, 64, 4, 3)),
    ("forward", 128, False, (128, 128, 8, 2)),
    ("dkdv", 128, False, (32, 64, 8, 3)),
    ("dq", 64, False, (128, 32, 4, 5)),
]
CONFIG_SHAPE = (2, 256)  # (batch·heads, N): lengths and strides multiples of 16, like the goal shapes


@contextlib.contextmanager
def launched_with(fa, kind: str, config: tuple[int, int, int, int]):
    """Inside the block, ``kind``'s launcher uses ``config`` where it would use its fixed config."""
    original = fa.triton_config.fixed_config
    m, n, w, s = config

    def fixed(k, dtype, head_dim):
        return {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s} if k == kind else original(
            k, dtype, head_dim)

    with mock.patch.object(fa.triton_config, "fixed_config", fixed):
        yield


def launch_configs() -> None:
    """Each of :data:`ISSUE_CONFIGS`, bf16, launched for real (the child's target)."""
    fa = reference()
    bh, n = CONFIG_SHAPE
    for kind, d, is_causal, config in ISSUE_CONFIGS:
        q, k, v, do = make((bh, n, d), (bh, n, d), "contiguous", torch.bfloat16)
        with launched_with(fa, kind, config):
            if kind == "forward":
                fa.triton_forward.triton_attention_forward(q, k, v, is_causal)
            else:
                forward_backward(fa, q, k, v, do, is_causal)
