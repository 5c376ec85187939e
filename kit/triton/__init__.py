"""The kit's side of Triton, behind :mod:`kit.triton_compile` (which tests and the reference import):

* :mod:`~kit.triton.triton_private` — every use the kit makes of Triton's private API, in one place;
* :mod:`~kit.triton.triton_compile_child` — the child process that compiles recorded launches for sm_90.

This package imports nothing at start-up (``import triton`` inside it is still the real Triton: imports are absolute).
"""
