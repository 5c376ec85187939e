"""Compile the Triton kernels a program really launches, for a GPU, on a machine without one.

The Triton interpreter (``TRITON_INTERPRET=1``) runs a ``@triton.jit`` body as NumPy code, so it accepts
code the compiler rejects (Python lists, ``raise``, data-dependent Python control flow) and cannot show
properties that exist only in the compiled kernel (the precision ``tl.dot`` runs at, the width of integer
offsets, shared memory and registers). This module closes that gap without naming any kernel:

1. :func:`record_launches` runs a function under the interpreter and records every kernel launch it makes
   — which ``@triton.jit`` function, the type of each argument (pointer dtype for tensors, int/float/bool
   for scalars), the constexpr values, the grid and ``num_warps``/``num_stages`` — whatever the kernels
   and their parameters are called;
2. :func:`compile_launches` compiles exactly those kernels for a Hopper GPU (sm_90) in a child process with
   the interpreter off (no GPU needed) and returns one :class:`CompileReport` per kernel: the compiler's
   error if any, shared memory, the ptxas register/spill line, and the Triton IR;
3. :func:`tf32_dots` and :func:`narrow_offsets` inspect that IR: fp32 ``tl.dot`` must run at IEEE precision,
   and products of the batch·head program id with a runtime argument (a stride) must be 64-bit.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# sm_90 (H100/H200): 227 KiB of shared memory per block with the opt-in carve-out.
SM90_SHARED_BYTES = 232448


@dataclass
class Launch:
    """One recorded kernel launch: ``module.name`` launched with ``args`` (parameter name → descriptor:
    ``{"kind": "ptr", "dtype": "fp16"}``, ``{"kind": "int"|"float"|"bool"|"value", "value": ...}``), on
    ``grid`` (a tuple of ints), with ``options`` (``num_warps``/``num_stages`` when the launch gave them)."""

    module: str
    name: str
    args: dict[str, dict]
    grid: tuple[int, ...]
    options: dict[str, int] = field(default_factory=dict)

    def key(self) -> str:
        return json.dumps([self.module, self.name, self.args, self.options], sort_keys=True, default=str)


@dataclass
class CompileReport:
    """The outcome of compiling one :class:`Launch` for sm_90: ``error`` (the compiler's message) or
    ``shared`` bytes, ``ptxas`` (its ``-v`` lines: registers, spills), ``ttir`` (the Triton IR) and
    ``wgmma`` (whether the PTX uses Hopper's warpgroup MMA instructions, i.e. ``tl.dot`` got the fast path)."""

    launch: Launch
    error: str = ""
    shared: int = 0
    ptxas: str = ""
    ttir: str = ""
    wgmma: bool = False

    @property
    def registers(self) -> int:
        """Registers per thread ptxas reported (0 when unknown)."""
        found = re.findall(r"Used (\d+) registers", self.ptxas)
        return max(int(n) for n in found) if found else 0

    @property
    def spills(self) -> int:
        """Bytes of register spill stores ptxas reported (0 when none or unknown)."""
        return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", self.ptxas))


_TRITON_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64",
                  "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}


def _describe(value: Any) -> dict:
    import torch

    if isinstance(value, torch.Tensor):
        return {"kind": "ptr", "dtype": _TRITON_DTYPES.get(str(value.dtype).removeprefix("torch."), "fp32")}
    if isinstance(value, bool):
        return {"kind": "bool", "value": value}
    if isinstance(value, int):
        return {"kind": "int", "value": value}
    if isinstance(value, float):
        return {"kind": "float", "value": value}
    if value is None or isinstance(value, str):
        return {"kind": "value", "value": value}
    if hasattr(value, "item"):  # a NumPy/torch scalar
        return _describe(value.item())
    return {"kind": "value", "value": repr(value)}


def record_launches(fn: Callable[[], Any], execute: bool = True) -> list[Launch]:
    """Run ``fn()`` and return the distinct kernel launches it made.

    With ``execute=False`` the kernels are recorded but not run (their outputs stay uninitialised): a
    cheap way to see the grids a launcher asks for at sizes the interpreter would take minutes to run.

    Works through ``kernel[grid](...)``, ``triton.autotune`` and ``triton.heuristics`` (all of which end in
    ``InterpretedFunction.run`` under the interpreter, ``JITFunction.run`` on a GPU); the autotuner's
    benchmarking launches are not recorded, only the launch it settles on.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: dict[str, Launch] = {}
    originals = {cls: cls.run for cls in (InterpretedFunction, JITFunction)}

    def make_recording(original):
        def recording(self, *args, grid, warmup, **kwargs):
            if not warmup and not any(f.function in ("_bench", "do_bench") for f in inspect.stack(0)[1:8]):
                named = {**dict(zip(self.arg_names, args)), **kwargs}
                options = {k: int(named.pop(k)) for k in ("num_warps", "num_stages") if named.get(k) is not None}
                for k in ("num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid"):
                    named.pop(k, None)
                g = grid(named) if callable(grid) else grid
                g = tuple(int(x) for x in (g if isinstance(g, (tuple, list)) else (g,)))
                launch = Launch(self.fn.__module__, self.fn.__qualname__,
                                {k: _describe(v) for k, v in named.items()}, g, options)
                launches.setdefault(launch.key(), launch)
                if not execute:
                    return None
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

        return recording

    for cls, original in originals.items():
        cls.run = make_recording(original)
    try:
        fn()
    finally:
        for cls, original in originals.items():
            cls.run = original
    return list(launches.values())


_CHILD = r"""
import contextlib, importlib, io, json, os, sys, traceback
os.environ["TRITON_INTERPRET"] = "0"
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
import kit  # noqa: F401
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

out = []
for launch in json.load(open(sys.argv[1])):
    rep = {"error": "", "shared": 0, "ptxas": "", "ttir": "", "wgmma": False}
    out.append(rep)
    try:
        obj = importlib.import_module(launch["module"])
        for part in launch["name"].split("."):
            obj = getattr(obj, part)
        while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):
            obj = obj.fn  # Autotuner / Heuristics wrap the JITFunction
        if not isinstance(obj, JITFunction):
            raise TypeError(f"{launch['module']}.{launch['name']} is not a module-level @triton.jit function")
    except Exception as e:
        rep["error"] = f"cannot import the kernel: {type(e).__name__}: {e}"
        continue
    signature, constexprs, args = {}, {}, launch["args"]
    for i, p in enumerate(obj.params):
        d = args.get(p.name)
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[(i,)] = d["value"] if d is not None else p.default
        elif d is None:
            signature[p.name] = "constexpr"  # a defaulted argument the launch did not pass
            constexprs[(i,)] = p.default
        elif d["kind"] == "ptr":
            signature[p.name] = "*" + d["dtype"]
        elif d["kind"] == "int":
            signature[p.name] = "i32" if -2**31 <= d["value"] < 2**31 else "i64"
        elif d["kind"] == "float":
            signature[p.name] = "fp32"
        elif d["kind"] == "bool":
            signature[p.name] = "i1"
        else:
            signature[p.name] = "constexpr"
            constexprs[(i,)] = d["value"]
    options = {"num_warps": 4, "num_stages": 3, **launch["options"]}
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            k = triton.compile(ASTSource(fn=obj, signature=signature, constexprs=constexprs),
                               target=GPUTarget("cuda", 90, 32), options=options)
        rep["shared"] = int(k.metadata.shared)
        rep["ttir"] = k.asm.get("ttir", "")
        rep["wgmma"] = "wgmma" in k.asm.get("ptx", "")
        rep["ptxas"] = "\n".join(l for l in log.getvalue().splitlines() if "ptxas info" in l or "spill" in l)
    except Exception as e:
        msg = str(e).strip() or type(e).__name__
        rep["error"] = f"{type(e).__name__}: {msg}"[-4000:]
json.dump(out, open(sys.argv[2], "w"))
"""


def compile_launches(launches: list[Launch], workdir: Path, root: Path, timeout: float = 900) -> list[CompileReport]:
    """Compile each recorded launch for sm_90 in a child process (interpreter off, no GPU needed).

    ``root`` goes on the child's ``PYTHONPATH`` so the kernels' modules import there; ``workdir`` holds the
    Triton cache and the exchange files. Raises ``RuntimeError`` with the child's output if it crashes.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    src, dst = workdir / "launches.json", workdir / "reports.json"
    src.write_text(json.dumps([{"module": la.module, "name": la.name, "args": la.args, "options": la.options}
                               for la in launches]))
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(workdir / "triton-cache"),
           "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(dst)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not dst.exists():
        raise RuntimeError("the compile step crashed:\n" + (proc.stdout + proc.stderr)[-3000:])
    return [CompileReport(la, **rep) for la, rep in zip(launches, json.loads(dst.read_text()))]


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


def with_config(launch: Launch, config: dict[str, int]) -> Launch:
    """``launch`` with other constexpr values and launch options: ``config`` maps constexpr names (e.g.
    ``BLOCK_M``) to values and may hold ``num_warps``/``num_stages`` — one autotune candidate of it."""
    args = {k: dict(d) for k, d in launch.args.items()}
    options = dict(launch.options)
    for name, value in config.items():
        if name in ("num_warps", "num_stages"):
            options[name] = int(value)
        else:
            kind = "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "value"
            args[name] = {"kind": kind, "value": value}
    return Launch(launch.module, launch.name, args, launch.grid, options)


def batch_head_axis(launch: Launch, batch_heads: int) -> int | None:
    """The grid axis whose size is ``batch_heads`` (and no other axis's is), or None."""
    axes = [i for i, n in enumerate(launch.grid) if n == batch_heads]
    return axes[0] if len(axes) == 1 else None


def describe(launch: Launch) -> str:
    """``module.name(grid=…, constexprs…)`` for messages."""
    consts = {k: d["value"] for k, d in launch.args.items() if d["kind"] in ("bool", "value") or k.isupper()
              and d["kind"] == "int"}
    return f"{launch.module}.{launch.name} (grid {launch.grid}, {consts})"
