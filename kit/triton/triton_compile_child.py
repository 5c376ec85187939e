"""The child process of :mod:`kit.triton_compile`: compile recorded kernel launches for sm_90, interpreter off.

Run by :func:`kit.triton_compile._run_child` as ``python -m kit.triton.triton_compile_child MODE IN.json OUT.json``
with ``TRITON_INTERPRET=0`` (the parent runs kernels in the interpreter, where a ``@triton.jit`` function
is not compilable; here the kernels' modules are imported afresh, compiled) and the kernels' repository
on ``PYTHONPATH``. Modes:

* ``compile``: IN is a list of launches (:meth:`kit.triton_compile.Launch.as_data`); OUT one report per
  launch: ``error`` or ``shared``, ``ptxas`` (its ``-v`` lines), ``ttir``, ``wgmma``, ``inputs``;
* ``inputs``: the same launches, not compiled: OUT is what Triton's launcher would hand the compiler;
* ``run``: IN is ``"package.module:function"``; the function is called, and OUT is what the launcher hands
  the compiler for every kernel it launches (the ground truth ``inputs`` is tested against);
* ``run-compile``: the same, compiled: OUT is one report per kernel compiled, as in ``compile``.

Each launch goes through Triton's own launcher, as on a GPU (:func:`kit.triton.triton_private.compile_as_launched`
inside :func:`kit.triton.triton_private.gpu_target`): a tensor argument is replaced by :class:`TensorStandIn`,
which has what the launcher reads of a tensor — its dtype and address — so the launcher specialises the
kernel exactly as it would for the recorded tensor.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: kernels defined from here on compile
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # ptxas -v output, printed by Triton as it compiles

from kit.triton import triton_private  # noqa: E402 — after the environment is set


class TensorStandIn:
    """What Triton's launcher reads of a tensor argument: its torch ``dtype`` and ``data_ptr()``, here an
    address with exactly the recorded alignment (a multiple of ``align`` bytes and of no larger power of two)."""

    def __init__(self, dtype_name: str, align: int):
        import torch

        from kit.triton_compile import TORCH_DTYPES

        self.dtype = getattr(torch, TORCH_DTYPES.get(dtype_name, dtype_name))
        self.align = int(align)

    def data_ptr(self) -> int:
        return self.align


def kernel_of(launch: dict):
    """The ``@triton.jit`` function a launch names (module and qualified name), imported here, compiled."""
    obj: Any = importlib.import_module(launch["module"])
    for part in launch["name"].split("."):
        obj = getattr(obj, part)
    return triton_private.jit_function(obj)


def arguments(launch: dict) -> dict[str, Any]:
    """The launch's arguments by name: scalars as recorded, tensors as :class:`TensorStandIn`."""
    return {name: TensorStandIn(d["dtype"], d.get("align", 16)) if d["kind"] == "ptr" else d["value"]
            for name, d in launch["args"].items()}


def _report(kernel, inputs: dict, ptxas: str) -> dict:
    lines = "\n".join(line for line in ptxas.splitlines() if "ptxas info" in line or "spill" in line)
    return {"error": "", "shared": int(kernel.metadata.shared), "ptxas": lines, "ttir": kernel.asm.get("ttir", ""),
            "wgmma": "wgmma" in kernel.asm.get("ptx", ""), "inputs": inputs}


def _error(e: Exception) -> dict:
    """The compile failure as data. Triton's CompilationError names only the source line; the reason (for example
    "K >= 16" from tl.dot, or the shared memory asked for) is in the chained exception, so the chain is kept."""
    parts: list[str] = []
    seen: set[int] = set()
    link: BaseException | None = e
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        parts.append(f"{type(link).__name__}: {str(link).strip() or type(link).__name__}")
        link = link.__cause__ or link.__context__
    message = "\n  caused by ".join(parts)
    return {"error": message[-4000:], "shared": 0, "ptxas": "", "ttir": "", "wgmma": False,
            "inputs": {}}


def _ptxas_log(kernel, output: str) -> str:
    """The ptxas ``-v`` log of ``kernel``'s build. A binary from Triton's disk cache (``TRITON_CACHE_DIR``) was
    not built now and printed nothing, so the log of its build is kept beside it (``kit-ptxas/HASH.log``)."""
    kept = Path(os.environ.get("TRITON_CACHE_DIR", ".")) / "kit-ptxas" / f"{kernel.hash}.log"
    if "ptxas info" in output:
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_suffix(f".{os.getpid()}.tmp")  # runs side by side may build the same binary
        partial.write_text(output)
        os.replace(partial, kept)
        return output
    return kept.read_text() if kept.exists() else output


def compile_one(launch: dict, seen: dict[str, dict]) -> dict:
    """Compile one launch. ``seen`` keeps each binary's report by hash: a launch that specialises like an
    earlier one gets the earlier binary from Triton's in-memory cache, and ptxas does not run again."""
    try:
        fn = kernel_of(launch)
    except Exception as e:
        return {**_error(e), "error": f"cannot import the kernel: {type(e).__name__}: {e}"}
    try:
        with triton_private.compiles_observed() as compiled:
            kernel = triton_private.compile_as_launched(fn, arguments(launch), launch["options"])
    except Exception as e:
        return _error(e)
    if compiled:
        seen[kernel.hash] = _report(kernel, compiled[0]["inputs"], _ptxas_log(kernel, compiled[0]["output"]))
    return seen[kernel.hash]


def inputs_of(launch: dict) -> dict:
    """What the launcher hands the compiler for one launch, without compiling (``{"error": …}`` if it fails)."""
    try:
        with triton_private.compiles_observed(skip=True) as compiled:
            triton_private.compile_as_launched(kernel_of(launch), arguments(launch), launch["options"])
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return compiled[0]["inputs"] if compiled else {"error": "the launcher compiled nothing"}


def run_target(target: str, compile: bool) -> list[dict]:
    """Call ``target`` (``"package.module:function"``) and report every kernel it launches: what the launcher
    hands the compiler (``compile`` False: nothing is compiled) or the compiled kernel's report."""
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    with triton_private.compiles_observed(skip=not compile) as compiled:
        fn()
    if not compile:
        return [c["inputs"] for c in compiled]
    return [_report(c["kernel"], c["inputs"], _ptxas_log(c["kernel"], c["output"])) for c in compiled]


def main(argv: list[str]) -> int:
    mode, src, dst = argv
    payload = json.loads(open(src).read())
    with triton_private.gpu_target():
        if mode == "compile":
            logs: dict[str, str] = {}
            out: Any = [compile_one(launch, logs) for launch in payload]
        elif mode == "inputs":
            out = [inputs_of(launch) for launch in payload]
        elif mode in ("run", "run-compile"):
            out = run_target(payload, compile=mode == "run-compile")
        else:
            raise SystemExit(f"unknown mode {mode!r}: compile, inputs, run or run-compile")
    with open(dst, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
