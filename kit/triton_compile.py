"""Compile the Triton kernels a program really launches, for a GPU, on a machine without one.

The Triton interpreter (``TRITON_INTERPRET=1``) runs a ``@triton.jit`` body as NumPy code, so it accepts
code the compiler rejects (Python lists, ``raise``, data-dependent Python control flow) and cannot show
properties that exist only in the compiled kernel (the precision ``tl.dot`` runs at, the width of integer
offsets, shared memory and registers). This module closes that gap without naming any kernel:

1. :func:`record_launches` runs a function under the interpreter and records every kernel launch it makes
   — which ``@triton.jit`` function, each argument (for a tensor: its element type and how its address is
   aligned; for a scalar: its value), the constexpr values, the grid and the launch options — whatever the
   kernels and their parameters are called;
2. :func:`compile_launches` compiles exactly those launches for a Hopper GPU (sm_90) in child processes
   (one per CPU, side by side) with the interpreter off (no GPU needed; :mod:`kit.triton.triton_compile_child`)
   and returns one :class:`CompileReport` per launch: the compiler's error if any, shared memory, the ptxas
   register/spill line, and the Triton IR;
3. :func:`tf32_dots` and :func:`narrow_offsets` inspect that IR: fp32 ``tl.dot`` must run at IEEE precision,
   and products of the batch·head program id with a runtime argument (a stride) must be 64-bit.

**The build is the one a GPU launch makes.** A launch does not compile the kernel's source alone: Triton's
launcher first *specialises* it on the arguments — pointers whose address is a multiple of 16 bytes and
integers divisible by 16 are marked so (``tt.divisibility``: loads become vectorised and K/V tiles can be
pipelined), an integer equal to 1 becomes a constant — and registers, spills and shared memory depend on
it (a D = 128 kernel can spill without the hints and not with them). The child therefore hands each
recorded launch to Triton's own launcher (``JITFunction.run`` with ``warmup=True``, the GPU replaced by a
stand-in that names sm_90; :mod:`kit.triton.triton_private`), with the recorded scalars and, for each tensor, a
stand-in with its dtype and alignment: the specialisation is Triton's, not a copy of its rules.
:func:`launch_specialisations` returns what that launcher hands the compiler, and
``tests/kit/test_triton_compile.py`` checks it against launches of real tensors (shapes, strides that are
and are not multiples of 16, a misaligned view).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kit.triton import triton_private

# sm_90 (H100/H200): 227 KiB of shared memory per block with the opt-in carve-out.
SM90_SHARED_BYTES = 232448
# A tensor's address alignment is recorded up to this many bytes (CUDA's allocator aligns to 512, the CPU one
# to 64; Triton 3.6 asks only whether it is a multiple of 16).
MAX_RECORDED_ALIGNMENT = 256


@dataclass
class Launch:
    """One recorded kernel launch: ``module.name`` launched with ``args`` (parameter name → descriptor:
    ``{"kind": "ptr", "dtype": "fp16", "align": 256}`` for a tensor, whose address is a multiple of
    ``align`` bytes; ``{"kind": "int"|"float"|"bool"|"value", "value": ...}`` for anything else), on ``grid``
    (a tuple of ints), with ``options`` (the launch options it passed: ``num_warps``, ``num_stages``, …)."""

    module: str
    name: str
    args: dict[str, dict]
    grid: tuple[int, ...]
    options: dict[str, Any] = field(default_factory=dict)

    def key(self) -> str:
        return json.dumps([self.module, self.name, self.args, self.options], sort_keys=True, default=str)

    def as_data(self) -> dict:
        """The launch as plain data (what :meth:`from_data` reads back)."""
        return {"module": self.module, "name": self.name, "args": self.args, "grid": list(self.grid),
                "options": self.options}

    @classmethod
    def from_data(cls, data: dict) -> Launch:
        return cls(data["module"], data["name"], data["args"], tuple(data["grid"]), dict(data["options"]))


@dataclass
class CompileReport:
    """The outcome of compiling one :class:`Launch` for sm_90: ``error`` (the compiler's message) or
    ``shared`` bytes, ``ptxas`` (its ``-v`` lines: registers, spills), ``ttir`` (the Triton IR), ``wgmma``
    (whether the PTX uses Hopper's warpgroup MMA instructions, i.e. ``tl.dot`` got the fast path) and
    ``inputs`` (what Triton's launcher handed the compiler: signature, constants, ``tt.divisibility``
    attributes by parameter, options)."""

    launch: Launch
    error: str = ""
    shared: int = 0
    ptxas: str = ""
    ttir: str = ""
    wgmma: bool = False
    inputs: dict = field(default_factory=dict)

    @property
    def registers(self) -> int:
        """Registers per thread ptxas reported (0 when unknown)."""
        found = re.findall(r"Used (\d+) registers", self.ptxas)
        return max(int(n) for n in found) if found else 0

    @property
    def spills(self) -> int:
        """Bytes of register spill stores ptxas reported (0 when none or unknown)."""
        return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", self.ptxas))

    def as_data(self) -> dict:
        return {"launch": self.launch.as_data(), "error": self.error, "shared": self.shared, "ptxas": self.ptxas,
                "ttir": self.ttir, "wgmma": self.wgmma, "inputs": self.inputs}

    @classmethod
    def from_data(cls, data: dict) -> CompileReport:
        return cls(Launch.from_data(data["launch"]), **{k: v for k, v in data.items() if k != "launch"})


_TRITON_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64",
                  "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1",
                  "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}
TORCH_DTYPES = {short: long for long, short in _TRITON_DTYPES.items()}  # "fp16" → "float16"


def alignment(address: int) -> int:
    """The largest power of two, at most :data:`MAX_RECORDED_ALIGNMENT`, that divides ``address``."""
    return MAX_RECORDED_ALIGNMENT if address % MAX_RECORDED_ALIGNMENT == 0 else address & -address


def describe_argument(value: Any) -> dict:
    """One launch argument as :class:`Launch` records it: a tensor as its Triton pointer type and alignment, a
    scalar as its kind and value."""
    import torch

    if isinstance(value, torch.Tensor):
        return {"kind": "ptr", "dtype": _TRITON_DTYPES.get(str(value.dtype).removeprefix("torch."), "fp32"),
                "align": alignment(value.data_ptr())}
    if isinstance(value, bool):
        return {"kind": "bool", "value": value}
    if isinstance(value, int):
        return {"kind": "int", "value": value}
    if isinstance(value, float):
        return {"kind": "float", "value": value}
    if value is None or isinstance(value, str):
        return {"kind": "value", "value": value}
    if hasattr(value, "item"):  # a NumPy/torch scalar
        return describe_argument(value.item())
    return {"kind": "value", "value": repr(value)}


def record_launches(fn: Callable[[], Any], execute: bool = True) -> list[Launch]:
    """Run ``fn()`` and return the distinct kernel launches it made.

    With ``execute=False`` the kernels are recorded but not run (their outputs stay uninitialised): a
    cheap way to see the grids a launcher asks for at sizes the interpreter would take minutes to run.

    Works through ``kernel[grid](...)``, ``triton.autotune`` and ``triton.heuristics``; the autotuner's
    benchmarking launches are not recorded, only the launch it settles on.
    """
    launches: dict[str, Launch] = {}

    def on_launch(kernel, named: dict, options: dict, grid) -> bool:
        if triton_private.in_autotuner_benchmark():
            return True
        g = grid(named) if callable(grid) else grid
        g = tuple(int(x) for x in (g if isinstance(g, (tuple, list)) else (g,)))
        args = {k: describe_argument(v) for k, v in named.items()}
        launch = Launch(kernel.fn.__module__, kernel.fn.__qualname__, args,
                        g, {k: v if isinstance(v, (bool, int, float, str)) else repr(v) for k, v in options.items()})
        launches.setdefault(launch.key(), launch)
        return execute

    with triton_private.launches_intercepted(on_launch):
        fn()
    return list(launches.values())


def user_cache_dir() -> Path:
    """Where the graded compile checks keep Triton's compile cache between runs:
    ``$XDG_CACHE_HOME/llmsys-lab/triton-sm90`` (``~/.cache/...`` by default: the kit's cache folder, where
    the FlashAttention tuning cache lives too).

    A student runs Stage 3's tests dozens of times, mostly with kernels that did not change since the last
    run, and compiling them is most of the stage's time (25 s of 45 on 2 cores). Triton's cache key is a hash
    of everything a build depends on — the kernel's source and the ``@triton.jit`` functions and globals it
    uses, the specialisation, the options, the target and Triton's own version — so an edited kernel is
    compiled afresh and an unchanged one comes back as the binary it was. The grader gives each run a home of
    its own, so a submission never sees another's cache. Delete the folder to empty it."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmsys-lab" / "triton-sm90"


def _child_command(mode: str, payload: Any, workdir: Path, root: Path, tag: str,
                   cache: Path | None = None) -> tuple[list[str], dict, Path]:
    workdir.mkdir(parents=True, exist_ok=True)
    src, dst = workdir / f"{mode}{tag}-in.json", workdir / f"{mode}{tag}-out.json"
    dst.unlink(missing_ok=True)
    src.write_text(json.dumps(payload))
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache or workdir / "triton-cache"),
           "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return [sys.executable, "-m", "kit.triton.triton_compile_child", mode, str(src), str(dst)], env, dst


def _run_children(mode: str, payloads: list[Any], workdir: Path, root: Path, timeout: float,
                  cache: Path | None = None) -> list[Any]:
    """Run one ``python -m kit.triton.triton_compile_child MODE IN OUT`` per payload, all at once, with the interpreter
    off and ``root`` on the path; their outputs in order. ``RuntimeError`` with a child's output if it crashes
    (the others are stopped); ``subprocess.TimeoutExpired`` if they take longer than ``timeout`` together."""
    children = []
    try:
        for i, payload in enumerate(payloads):
            tag = f"-{i}" if len(payloads) > 1 else ""
            command, env, dst = _child_command(mode, payload, workdir, root, tag, cache)
            log = (workdir / f"{mode}{tag}.log").open("w+")  # a file, not a pipe: a chatty child never blocks
            children.append((subprocess.Popen(command, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT,
                                              text=True), dst, log))
        deadline = time.monotonic() + timeout
        outputs = []
        for proc, dst, log in children:
            remaining = max(deadline - time.monotonic(), 0.1)
            try:
                proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired as e:
                raise subprocess.TimeoutExpired(proc.args, timeout) from e
            if proc.returncode != 0 or not dst.exists():
                log.seek(0)
                raise RuntimeError(f"the compile step ({mode}) crashed:\n" + log.read()[-3000:])
            outputs.append(json.loads(dst.read_text()))
        return outputs
    finally:
        for proc, _, log in children:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


def _run_child(mode: str, payload: Any, workdir: Path, root: Path, timeout: float) -> Any:
    """One child (see :func:`_run_children`)."""
    return _run_children(mode, [payload], workdir, root, timeout)[0]


def compile_jobs() -> int:
    """How many compile children run at once: one per CPU this process may use, at most 4 (each holds the
    compiler, about 0.5 GB). Under ``taskset -c 0`` that is one, and the launches compile one after another."""
    from kit.setup.doctor import available_cpus

    return max(1, min(int(available_cpus()), 4))


def compile_launches(launches: list[Launch], workdir: Path, root: Path, timeout: float = 900,
                     jobs: int | None = None, cache: Path | None = None) -> list[CompileReport]:
    """Compile each recorded launch for sm_90 as a launch of its arguments would, in child processes
    (interpreter off, no GPU needed).

    Launches that differ only in their grid go to the same child (they share one binary); the rest are
    dealt out to ``jobs`` children (default :func:`compile_jobs`) that compile side by side —
    ptxas and LLVM are single-threaded, and a test's compile is its largest single cost. ``root`` goes on
    the children's ``PYTHONPATH`` so the kernels' modules import there; ``workdir`` holds the exchange files
    and, unless ``cache`` names another folder (:func:`user_cache_dir`: kept between runs), Triton's compile
    cache. A launch served from the cache reports what its compile reported. Raises ``RuntimeError`` with a
    child's output if one crashes.
    """
    if not launches:
        return []
    binaries: dict[str, list[int]] = {}  # launches that differ only in their grid build the same binary
    for i, la in enumerate(launches):
        binaries.setdefault(la.key(), []).append(i)
    groups: list[list[int]] = [[] for _ in range(min(jobs or compile_jobs(), len(binaries)))]
    for indices in binaries.values():  # dealt in launch order, each to the child with the fewest so far
        min(groups, key=len).extend(indices)
    outputs = _run_children("compile", [[launches[i].as_data() for i in group] for group in groups], workdir, root,
                            timeout, cache)
    reports: list[dict] = [{}] * len(launches)
    for group, output in zip(groups, outputs):
        for i, rep in zip(group, output):
            reports[i] = rep
    return [CompileReport(la, **rep) for la, rep in zip(launches, reports)]


def launch_specialisations(launches: list[Launch], workdir: Path, root: Path, timeout: float = 300) -> list[dict]:
    """What Triton's launcher hands the compiler for each launch (no compile): ``signature``, ``constants``,
    ``attrs`` and ``options``, as :func:`kit.triton.triton_private.compiles_observed` describes them."""
    return _run_child("inputs", [la.as_data() for la in launches], workdir, root, timeout)


def launched_specialisations(target: str, workdir: Path, root: Path, timeout: float = 300) -> list[dict]:
    """The same for whatever ``target`` (``"package.module:function"``, called without arguments) launches
    when it runs with the interpreter off — real tensors through the real launch path, for sm_90, stopped
    before the GPU would be needed: the ground truth :func:`launch_specialisations` is tested against."""
    return _run_child("run", target, workdir, root, timeout)


def compile_launched(target: str, workdir: Path, root: Path, timeout: float = 900) -> list[dict]:
    """The compile reports (as data: ``error``, ``shared``, ``ptxas``, ``ttir``, ``wgmma``, ``inputs``) of the
    kernels ``target`` launches with the interpreter off, compiled for sm_90 as those launches compile them."""
    return _run_child("run-compile", target, workdir, root, timeout)


_LINE = re.compile(r"^\s*(%[\w#]+)(?::\d+)?\s*=\s*(.*)$")


def _values(text: str) -> list[str]:
    return re.findall(r"%[\w]+", text)


def tf32_dots(ttir: str) -> list[str]:
    """The ``tt.dot`` lines of ``ttir`` that multiply fp32 operands at a reduced precision (TF32, TF32x3)
    instead of IEEE fp32 — what ``tl.dot`` does on a GPU unless ``input_precision="ieee"`` is passed."""
    bad = []
    for line in ttir.splitlines():
        if "tt.dot " not in line:
            continue
        operands = line.rsplit(" : ", 1)[-1].split("->")[0]
        precision = re.search(r"inputPrecision = (\w+)", line)  # printed only when not the default, ieee
        if re.search(r"xf32>", operands.split("*")[0]) and precision and precision.group(1) != "ieee":
            bad.append(re.sub(r"\s+loc\(.*$", "", line.strip()))
    return bad


def narrow_offsets(ttir: str, axis: int) -> list[str]:
    """``arith.muli`` lines of ``ttir`` that multiply a value derived from ``tl.program_id(axis)`` by a
    value derived from a runtime argument (a stride, a length) in 32 bits: ``bh · stride`` overflows
    past 2³¹ elements unless one factor is cast to ``tl.int64`` first."""
    axis_name = "xyz"[axis]
    from_pid: set[str] = set()
    from_arg: set[str] = set()
    bad = []
    for header in re.findall(r"^\s*tt\.func .*$", ttir, re.M):
        from_arg.update(re.findall(r"(%[\w]+): ", header))
    def define(name: str, pid: bool, arg: bool) -> None:
        # MLIR reuses SSA names in sibling regions (two loops one after the other both have a %k_44), so a
        # definition replaces whatever an earlier, out-of-scope value of that name carried.
        (from_pid.add if pid else from_pid.discard)(name)
        (from_arg.add if arg else from_arg.discard)(name)

    for line in ttir.splitlines():
        loop = re.search(r"scf\.for (%\w+) = (%[\w#]+) to (%[\w#]+)", line)
        if loop:  # the induction variable carries what its bounds carry
            iv, bounds = loop.group(1), [b.split("#")[0] for b in loop.group(2, 3)]
            define(iv, any(b in from_pid for b in bounds), any(b in from_arg for b in bounds))
        for inner, outer in re.findall(r"(%\w+)\s*=\s*(%[\w#]+)", line.split("iter_args(", 1)[1] if "iter_args(" in
                                       line else ""):
            outer = outer.split("#")[0]
            define(inner, outer in from_pid, outer in from_arg)
        m = _LINE.match(line)
        if not m:
            continue
        result, rhs = m.group(1), m.group(2)
        result = result.split("#")[0].split(":")[0]
        if rhs.startswith(f"tt.get_program_id {axis_name}"):
            define(result, True, False)
            continue
        operands = [v for v in _values(rhs.split(":")[0]) if v != result]
        define(result, any(v in from_pid for v in operands), any(v in from_arg for v in operands))
        if rhs.startswith("arith.muli") and len(operands) >= 2:
            a, b = operands[:2]
            pid_arg = (a in from_pid and b in from_arg) or (b in from_pid and a in from_arg)
            if pid_arg and re.search(r"\bi32\b|xi32>", rhs.rsplit(":", 1)[-1]):
                bad.append(re.sub(r"\s+loc\(.*$", "", line.strip()))
    return bad


def with_config(launch: Launch, config: dict[str, Any]) -> Launch:
    """``launch`` with other constexpr values and launch options: ``config`` maps constexpr names (e.g.
    ``BLOCK_M``) to values and may hold launch options (``num_warps``, ``num_stages``) — one autotune
    candidate of it."""
    args = {k: dict(d) for k, d in launch.args.items()}
    options = dict(launch.options)
    for name, value in config.items():
        if name in triton_private.LAUNCH_OPTIONS:
            options[name] = value
        else:
            args[name] = describe_argument(value) if isinstance(value, (bool, int, float)) else {"kind": "value",
                                                                                        "value": value}
    return Launch(launch.module, launch.name, args, launch.grid, options)


def with_dtype(launch: Launch, old: str, new: str) -> Launch:
    """``launch`` with every tensor of element type ``old`` (e.g. ``"fp16"``) made ``new`` (``"bf16"``),
    its alignment kept: the same launch on tensors of another dtype."""
    args = {k: {**d, "dtype": new} if d["kind"] == "ptr" and d["dtype"] == old else dict(d)
            for k, d in launch.args.items()}
    return Launch(launch.module, launch.name, args, launch.grid, dict(launch.options))


def batch_head_axis(launch: Launch, batch_heads: int) -> int | None:
    """The grid axis whose size is ``batch_heads`` (and no other axis's is), or None."""
    axes = [i for i, n in enumerate(launch.grid) if n == batch_heads]
    return axes[0] if len(axes) == 1 else None


def describe(launch: Launch) -> str:
    """``module.name(grid=…, constexprs…)`` for messages."""
    consts = {k: d["value"] for k, d in launch.args.items() if d["kind"] in ("bool", "value") or k.isupper()
              and d["kind"] == "int"}
    return f"{launch.module}.{launch.name} (grid {launch.grid}, {consts})"
