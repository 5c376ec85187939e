"""Every use the kit makes of Triton's private API (written against Triton 3.6), in one place.

The kit needs a few things Triton has no public API for: seeing each kernel launch a program makes
(under the interpreter and compiled), compiling a kernel *as a launch would* for a GPU this machine
does not have, reading what a compiled kernel holds, and noticing atomic operations in the
interpreter. Each is one function here, so that a Triton upgrade breaks this module — and its tests,
``tests/kit/test_triton_compile.py`` — rather than code spread over the kit and its tests.

What is relied on, by function:

* :func:`launches_intercepted`: ``JITFunction.run`` and ``InterpretedFunction.run`` (``kernel[grid](…)``,
  ``triton.autotune`` and ``triton.heuristics`` all end there), their ``(*args, grid, warmup, **kwargs)``
  signature and ``arg_names``; the autotuner's timing calls run inside ``do_bench``/``_bench``.
* :func:`jit_function`: ``Autotuner``/``Heuristics`` keep the function they wrap in ``.fn``.
* :func:`gpu_target`: ``triton.runtime.driver.driver.set_active`` and the three driver methods a launch
  asks before it compiles (target, device, stream).
* :func:`compile_as_launched`, :func:`compiles_observed`: ``JITFunction.run(..., warmup=True)`` compiles
  without launching, after Triton's own binder has specialised the arguments (pointer alignment, integers
  divisible by 16 or equal to 1) and parsed the options; ``knobs.runtime.jit_cache_hook`` sees what is
  about to be compiled and may skip it, ``jit_post_compile_hook`` what was compiled (the kernel is then in
  ``JITFunction.device_caches``).
* :func:`compiled_variants`, :func:`compiled_constants`, :func:`loaded_resources`: ``JITFunction.device_caches``,
  ``CompiledKernel.src.constants`` and ``CompiledKernel._init_handles`` (registers and spills are known
  only once the binary is loaded on a GPU).
* :func:`atomics_recorded`: the interpreter's ``InterpreterBuilder.create_atomic_rmw``/``create_atomic_cas``.
* :func:`dots_counted`: the interpreter's ``InterpreterBuilder.create_dot``/``create_dot_scaled``;
  :func:`compiled_ttir`: ``CompiledKernel.asm``.
"""

from __future__ import annotations

import contextlib
import inspect
import io
from collections.abc import Callable, Iterator
from typing import Any

# The GPU the kit compiles for when it has none: Hopper (H100/H200), compute capability 9.0, 32-thread warps.
SM90 = ("cuda", 90, 32)

# Options a launch may pass besides the kernel's own parameters (Triton's launch options, not arguments).
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid",
                  "debug", "ir_override")


def _kernel_classes() -> tuple[type, type]:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return InterpretedFunction, JITFunction


def in_autotuner_benchmark() -> bool:
    """Whether the caller runs inside the autotuner's timing loop (``do_bench``), whose launches are trials."""
    return any(f.function in ("_bench", "do_bench") for f in inspect.stack(0)[2:10])


@contextlib.contextmanager
def launches_intercepted(on_launch: Callable[..., bool],
                         after: Callable[[Any, dict], None] | None = None) -> Iterator[None]:
    """Call ``on_launch(kernel, named, options, grid)`` at every kernel launch (not at warm-ups) while the
    block runs: ``kernel`` the launched function object (its ``fn`` is the Python function), ``named`` its
    arguments by parameter name, ``options`` the launch options (``num_warps``, …), ``grid`` as passed (a
    tuple or a function of the named arguments). When ``on_launch`` returns False the launch is skipped.
    ``after(kernel, named)``, if given, is called once a launch that ran has returned (or raised): under the
    interpreter its stores are then in memory; on a GPU they are once the stream is synchronised."""
    classes = _kernel_classes()
    originals = {cls: cls.run for cls in classes}

    def make(original):
        def run(self, *args, grid, warmup, **kwargs):
            if not warmup:
                named = {**dict(zip(self.arg_names, args)), **kwargs}
                options = {k: named.pop(k) for k in LAUNCH_OPTIONS if k in named and k not in self.arg_names}
                if not on_launch(self, named, {k: v for k, v in options.items() if v is not None}, grid):
                    return None
                if after is not None:
                    try:
                        return original(self, *args, grid=grid, warmup=warmup, **kwargs)
                    finally:
                        after(self, named)
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

        return run

    for cls, original in originals.items():
        cls.run = make(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.run = original


def jit_function(obj: Any):
    """The ``JITFunction`` behind ``obj`` (an ``Autotuner`` or ``Heuristics`` wraps it in ``.fn``);
    ``TypeError`` when there is none."""
    _, jit = _kernel_classes()
    while not isinstance(obj, jit) and hasattr(obj, "fn"):
        obj = obj.fn
    if not isinstance(obj, jit):
        raise TypeError(f"{obj!r} is not a @triton.jit function (is the interpreter on in this process?)")
    return obj


class _NotLaunched(Exception):
    """Raised where a launch would start a compiled kernel on the GPU this machine does not have."""


class _TargetDriver:
    """Stands in for the CUDA driver: a launch asks it for the target it compiles for, and nothing else
    until it would start the kernel (then :class:`_NotLaunched`)."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def launcher_cls(self, src, metadata):
        raise _NotLaunched(metadata)


@contextlib.contextmanager
def gpu_target(backend: str = SM90[0], arch: int = SM90[1], warp_size: int = SM90[2]) -> Iterator[None]:
    """Launches inside the block compile for ``backend``/``arch`` (default sm_90) exactly as on that GPU,
    without one: Triton's active driver is replaced by a stand-in that names the target. A launch that is
    not a warm-up compiles and then stops where it would start the kernel (it returns None)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    previous = driver._active
    driver.set_active(_TargetDriver(GPUTarget(backend, arch, warp_size)))
    _, jit = _kernel_classes()
    original_run = jit.run

    def run(self, *args, **kwargs):
        try:
            return original_run(self, *args, **kwargs)
        except _NotLaunched:
            return None

    jit.run = run
    try:
        yield
    finally:
        jit.run = original_run
        driver._active = previous


def compile_as_launched(fn, named: dict[str, Any], options: dict[str, Any]):
    """Compile the ``@triton.jit`` function ``fn`` the way ``fn[grid](**named, **options)`` would, and
    return the ``CompiledKernel``: Triton's launcher specialises the arguments and builds the compile
    options itself. Call inside :func:`gpu_target` with the interpreter off."""
    return jit_function(fn).run(grid=None, warmup=True, **named, **options)


@contextlib.contextmanager
def compiles_observed(skip: bool = False) -> Iterator[list[dict]]:
    """Observe every kernel compiled inside the block. Yields a list that gets one entry per compile:
    ``inputs`` — what Triton hands its compiler, as plain data: ``name``, ``signature`` (parameter → type,
    ``constexpr`` for specialised ones), ``constants`` and ``attrs`` (parameter → value / attributes such as
    ``tt.divisibility``; top-level parameters only, the kit's kernels take no tuples) and ``options`` (warps,
    stages, …); ``kernel`` — the ``CompiledKernel`` (None with ``skip``, which skips the compile: the launch
    then returns None); ``output`` — what the compiler printed meanwhile (e.g. the ptxas log), which is
    captured, not shown. A launch served from the in-memory cache compiles nothing and adds no entry."""
    import triton

    found: list[dict] = []
    printed = io.StringIO()

    def before(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 — Triton's names
        names = list(compile["signature"])
        found.append({"inputs": {
            "name": fn.name,
            "signature": dict(compile["signature"]),
            "constants": {names[k[0]]: _plain(v) for k, v in compile["constants"].items()},
            "attrs": {names[k[0]]: [list(a) for a in v] for k, v in compile["configs"][0].items() if v},
            "options": {k: compile[k] for k in ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion")},
        }, "kernel": None, "output": "", "_from": len(printed.getvalue())})
        return skip

    def after(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
        entry = found[-1]
        entry["kernel"] = fn.jit_function.device_caches[compile["device"]][0][key]
        entry["output"] = printed.getvalue()[entry.pop("_from"):]

    knobs = triton.knobs.runtime
    previous = knobs.jit_cache_hook, knobs.jit_post_compile_hook
    knobs.jit_cache_hook, knobs.jit_post_compile_hook = before, after
    try:
        with contextlib.redirect_stdout(printed):
            yield found
    finally:
        knobs.jit_cache_hook, knobs.jit_post_compile_hook = previous
        for entry in found:
            entry.pop("_from", None)


def _plain(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


def compiled_variants(fn) -> Iterator[Any]:
    """Every ``CompiledKernel`` this process has built of ``fn`` (a ``JITFunction``, or what wraps one in
    ``.fn``): its per-device caches."""
    while not hasattr(fn, "device_caches") and hasattr(fn, "fn"):
        fn = fn.fn
    for cache, *_ in getattr(fn, "device_caches", {}).values():
        yield from cache.values()


def compiled_constants(compiled) -> dict[str, Any]:
    """The constexpr values a ``CompiledKernel`` was built with, by parameter name."""
    names = list(getattr(compiled.src.fn, "arg_names", []))
    return {names[key[0]] if isinstance(key, tuple) else key: value
            for key, value in getattr(compiled.src, "constants", {}).items()
            if not isinstance(key, tuple) or key[0] < len(names)}


def loaded_resources(compiled) -> tuple[int, int]:
    """(registers per thread, spilled registers) of a ``CompiledKernel``, loaded on this process's GPU."""
    compiled._init_handles()
    return compiled.n_regs, compiled.n_spills


@contextlib.contextmanager
def dots_counted() -> Iterator[list[int]]:
    """Count the ``tl.dot`` operations (plain and scaled) the interpreter executes inside the block:
    ``counter[0]``, which the caller may reset between launches."""
    from triton.runtime.interpreter import InterpreterBuilder

    counter = [0]
    names = [n for n in ("create_dot", "create_dot_scaled") if hasattr(InterpreterBuilder, n)]
    originals = {name: getattr(InterpreterBuilder, name) for name in names}

    def counting(original):
        def create(self, *args, **kwargs):
            counter[0] += 1
            return original(self, *args, **kwargs)

        return create

    for name, original in originals.items():
        setattr(InterpreterBuilder, name, counting(original))
    try:
        yield counter
    finally:
        for name, original in originals.items():
            setattr(InterpreterBuilder, name, original)


def compiled_ttir(fn) -> list[str]:
    """The Triton IR (``CompiledKernel.asm["ttir"]``) of every variant of ``fn`` this process has compiled."""
    return [str(getattr(c, "asm", {}).get("ttir", "")) for c in compiled_variants(fn)]


@contextlib.contextmanager
def atomics_recorded() -> Iterator[list[dict]]:
    """Record every atomic operation the interpreter executes inside the block: ``{"op": "rmw"|"cas",
    "dtype": the element type it operates on (e.g. "fp32", "int32")}``. Atomics run one program at a time
    in the interpreter, so they are reproducible there; on a GPU, float atomic additions land in the order
    the hardware schedules them."""
    from triton.runtime.interpreter import InterpreterBuilder

    found: list[dict] = []
    originals = {name: getattr(InterpreterBuilder, name) for name in ("create_atomic_rmw", "create_atomic_cas")}

    def create_atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope):
        found.append({"op": "rmw", "dtype": str(val.dtype.scalar)})
        return originals["create_atomic_rmw"](self, rmwOp, ptr, val, mask, sem, scope)

    def create_atomic_cas(self, ptr, cmp, val, sem, scope):
        found.append({"op": "cas", "dtype": str(val.dtype.scalar)})
        return originals["create_atomic_cas"](self, ptr, cmp, val, sem, scope)

    InterpreterBuilder.create_atomic_rmw = create_atomic_rmw
    InterpreterBuilder.create_atomic_cas = create_atomic_cas
    try:
        yield found
    finally:
        for name, original in originals.items():
            setattr(InterpreterBuilder, name, original)
