# Your work goes in this file. Generated from the kit's reference by `make student`.
"""Stage 1 — benchmarking and profiling (handout/01-benchmarking.md).

Timing GPU code is easy to get wrong: CUDA launches kernels asynchronously, so a clock read right after
a call measures the launch, not the work; the first calls pay for compilation, allocator growth and
caches. This module times code correctly, labels its phases with NVTX ranges for Nsight Systems, and
profiles it with torch.profiler on machines without nsys.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kit.data import random_batch
from kit.model import TransformerLM, cross_entropy, get_config, make_optimizer
from kit.nvtx_ranges import nvtx  # the nvtx package, or torch.cuda.nvtx ranges where it is missing
from kit.validate import callable_arg, choice, non_negative_int, positive_int

MODES = ("forward", "forward_backward", "train_step")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TimingStats:
    """Seconds per call over the timed iterations. ``std`` is the sample standard deviation (0 for one sample)."""

    mean: float
    std: float
    median: float
    min: float
    samples: list[float] = field(repr=False)

    @property
    def max(self) -> float:
        return max(self.samples)

    def as_ms(self) -> dict[str, float]:
        return {"mean_ms": 1e3 * self.mean, "std_ms": 1e3 * self.std, "median_ms": 1e3 * self.median,
                "min_ms": 1e3 * self.min}


def default_sync() -> Callable[[], None]:
    """``torch.cuda.synchronize`` when CUDA is available, else a function that does nothing."""
    if torch.cuda.is_available():
        return torch.cuda.synchronize
    return lambda: None


def time_fn(
    fn: Callable[[], object],
    *,
    warmup: int,
    iters: int,
    sync: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> TimingStats:
    """Time ``fn()`` over ``iters`` calls after ``warmup`` untimed calls.

    Each timed call is bracketed by ``sync()`` calls: one before the clock starts (so earlier queued work
    is not billed to this call) and one after the call returns (so the call's own queued work is). The
    warm-up calls run first, untimed, followed by one ``sync()``.

    Args:
        fn: the work to time, called with no arguments.
        warmup: untimed calls first (≥ 0): JIT compilation, allocator growth, cache warm-up.
        iters: timed calls (≥ 1).
        sync: waits for queued device work; default ``torch.cuda.synchronize`` on CUDA, a no-op on CPU.
        clock: seconds as a float; ``time.perf_counter`` (injectable so tests can use a fake clock).

    Returns:
        :class:`TimingStats` in seconds per call.

    Raises:
        TypeError: ``fn`` or ``sync`` is not callable, or ``warmup``/``iters`` is not an int.
        ValueError: ``warmup < 0`` or ``iters < 1``.
    """
    callable_arg("fn", fn)
    non_negative_int("warmup", warmup)
    positive_int("iters", iters)
    callable_arg("sync", sync, optional=True)
    raise NotImplementedError("time_fn: warm up, then time each call between two sync() calls (handout 01 §1)")


def annotated_scaled_dot_product_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
) -> torch.Tensor:
    """softmax(q kᵀ / √d) v with NVTX ranges, so Nsight Systems shows where attention spends its time.

    q: ``(..., Nq, D)``, k and v: ``(..., Nk, D)``, any float dtype; returns ``(..., Nq, D)``. Causal
    masking aligns query i with key i. Ranges, opened with ``nvtx.annotate(name)`` (the module-level
    ``nvtx``): ``"scaled_dot_product_attention"`` around everything, and inside it, in order,
    ``"attention_scores"`` (q kᵀ / √d and the mask), ``"softmax"`` and ``"final_matmul"``.

    Raises:
        ValueError: shapes that do not match (q ``(…, Nq, D)``, k ``(…, Nk, D)``, v ``(…, Nk, Dv)``).
    """
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"q (…, Nq, D), k (…, Nk, D), v (…, Nk, Dv) expected; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    raise NotImplementedError("annotated_scaled_dot_product_attention: scores, softmax, final matmul, each in its own nvtx.annotate range (handout 01 §3)")


def benchmark_model(
    preset: str = "small",
    *,
    context_length: int = 256,
    batch_size: int = 4,
    mode: str = "forward_backward",
    dtype: str = "fp32",
    device: str | torch.device | None = None,
    warmup: int = 5,
    iters: int = 10,
    attention_fn: Callable | None = None,
    model: TransformerLM | None = None,
) -> dict:
    """Time the kit's Transformer: ``forward``, ``forward_backward`` or a full AdamW ``train_step``.

    ``dtype`` ``"fp32"`` runs in fp32; ``"bf16"``/``"fp16"`` run the forward under ``torch.autocast``
    (weights stay fp32). Each timed step opens NVTX ranges ``"forward"``, ``"backward"`` and
    ``"optimizer_step"`` (the latter two as the mode includes them), so an nsys capture splits the step.

    Returns a dict with the configuration, the :class:`TimingStats` under ``"timing"``, ``"tokens_per_s"``
    and ``"params"`` (the parameter count).

    Raises:
        ValueError: an unknown ``mode``, ``dtype`` or preset name.
        TypeError: a size that is not an int.
    """
    choice("mode", mode, MODES)
    choice("dtype", dtype, DTYPES)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = get_config(preset, context_length=max(context_length, get_config(preset).context_length))
    model = model or TransformerLM(config, attention_fn=attention_fn)
    model = model.to(device)
    optimizer = make_optimizer(model) if mode == "train_step" else None
    inputs, targets = random_batch(batch_size, context_length, config.vocab_size, device=device, seed=0)
    autocast_dtype = DTYPES[dtype]

    timing = ...  # time_fn(...) over one step of `mode`: forward (under autocast), backward, optimizer step
    raise NotImplementedError("benchmark_model: one step of the mode in NVTX ranges, timed with time_fn (handout 01 §2)")
    return {
        "preset": preset if isinstance(preset, str) else "custom",
        "context_length": context_length,
        "batch_size": batch_size,
        "mode": mode,
        "dtype": dtype,
        "device": str(device),
        "params": model.num_parameters(),
        "timing": timing,
        "tokens_per_s": batch_size * context_length / timing.mean,
    }


def profile_step(
    fn: Callable[[], object],
    *,
    warmup: int = 1,
    row_limit: int = 10,
    trace_path: str | Path | None = None,
) -> list[dict]:
    """Profile one call of ``fn`` with torch.profiler (CPU activity, plus CUDA when available).

    Returns the top ``row_limit`` operators by self time, each a dict with ``name``, ``calls``,
    ``self_time_us`` (CUDA self time on a GPU, else CPU self time) and ``total_time_us``, sorted by
    ``self_time_us`` descending. With ``trace_path``, also writes a Chrome/Perfetto trace there.

    Raises:
        TypeError: ``fn`` is not callable, or ``row_limit`` is not an int.
        ValueError: ``row_limit < 1``.
    """
    callable_arg("fn", fn)
    positive_int("row_limit", row_limit)
    from torch.profiler import ProfilerActivity, profile

    raise NotImplementedError("profile_step: warm up, profile one call, sort key_averages() by self time, export the trace (handout 01 §5)")


# ------------------------------------------------------------------------------------------------------
# Given: memory helpers. CUDA's caching allocator keeps statistics and a history; the CPU has neither.


def peak_memory(fn: Callable[[], object], device: str | torch.device | None = None) -> int:
    """Peak bytes allocated by torch on a CUDA device while ``fn()`` runs (after resetting the peak).

    Raises:
        RuntimeError: CUDA is not available (a CPU allocator keeps no peak statistics).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        raise RuntimeError(
            "peak_memory needs a CUDA device: the CPU allocator keeps no peak statistics. On a CPU, measure "
            "what autograd saves with Stage 2's saved_activation_bytes, or use torch.profiler(profile_memory=True)."
        )
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def memory_snapshot(fn: Callable[[], object], path: str | Path, max_entries: int = 1_000_000) -> Path:
    """Record every CUDA allocation while ``fn()`` runs and dump a snapshot for https://pytorch.org/memory_viz
    (the viewer runs in your browser; nothing is uploaded).

    Raises:
        RuntimeError: CUDA is not available.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("memory_snapshot needs CUDA: it records the CUDA caching allocator's history.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        fn()
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return path


def read_trace(path: str | Path) -> list[dict]:
    """The events of a Chrome trace written by :func:`profile_step`."""
    return json.loads(Path(path).read_text())["traceEvents"]
