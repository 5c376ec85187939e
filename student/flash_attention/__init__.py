# Given code — read, don't edit. Generated from the kit's reference by `make student`.
"""Stage 3 — FlashAttention-2 in PyTorch and Triton, forward and backward (handout/03-flash-attention.md).

One file per idea:

* ``checks.py`` (given): the input contract and the ``(batch·heads, N, D)`` layout.
* ``pytorch_impl.py``: :class:`FlashAttentionPytorch`, the tiled algorithm in plain PyTorch (§1–§4).
* ``triton_config.py`` (given): autotuning on a GPU, one fixed config and bf16 upcasting in the interpreter.
* ``triton_forward.py``: the forward kernel (§5).
* ``triton_backward.py``: the preprocess, dK/dV and dQ kernels, deterministic without atomics (§6).
* ``triton_impl.py``: :class:`FlashAttentionTriton`, the kernels behind autograd.
* ``api.py`` (given): :func:`flash_attention` and :func:`flash_attention_fn`, the Transformer drop-in, and the
  block interface (:func:`attention_forward_with_lse`, :func:`attention_backward_with_lse`) ring attention uses.
"""

# First: on a machine without CUDA, `import kit` sets TRITON_INTERPRET=1, which triton reads when it is
# imported and when each @triton.jit function is defined.
import kit  # noqa: F401

from .api import attention_backward_with_lse, attention_forward_with_lse, flash_attention, flash_attention_fn
from .pytorch_impl import FlashAttentionPytorch
from .triton_impl import FlashAttentionTriton

__all__ = ["FlashAttentionPytorch", "FlashAttentionTriton", "attention_backward_with_lse", "attention_forward_with_lse",
           "flash_attention", "flash_attention_fn"]
