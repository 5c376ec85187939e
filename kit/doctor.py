"""``python -m kit doctor``: what this machine will run, and what that means for each lab."""

from __future__ import annotations

import importlib
import platform
import shutil
import sys

import kit
from kit import nvtx_ranges


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as exc:  # a broken install should be reported, not crash the doctor
        return f"missing ({type(exc).__name__})"


def report() -> str:
    import torch

    cuda = torch.cuda.is_available()
    lines = [
        "LLM Systems Lab — doctor",
        f"  python      {sys.version.split()[0]} ({platform.platform()})",
        f"  torch       {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})",
        f"  triton      {_version('triton')}",
        f"  numpy       {_version('numpy')}",
        f"  nvtx        {_version('nvtx')} (NVTX ranges: {nvtx_ranges.BACKEND})",
        f"  CPU threads {torch.get_num_threads()}",
    ]
    if cuda:
        props = torch.cuda.get_device_properties(0)
        lines.append(f"  CUDA device {props.name} ×{torch.cuda.device_count()}, {props.total_memory / 2**30:.0f} GiB, "
                     f"compute capability {props.major}.{props.minor}")
    else:
        lines.append("  CUDA device none")
    interp = kit.triton_interpreted()
    lines.append(f"  Triton mode {'interpreted (TRITON_INTERPRET=1)' if interp else 'compiled'}")
    nsys = shutil.which("nsys")
    lines.append(f"  nsys        {nsys or 'not on PATH'}")
    try:
        import numpy

        if interp and tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
            lines.append("  WARNING     numpy ≥ 2.4 breaks triton 3.6's interpreter on loops with runtime bounds: "
                         "pip install 'numpy<2.4'")
    except Exception:
        pass
    lines += ["", "What this means:"]
    if nvtx_ranges.BACKEND.startswith("torch"):
        lines.append("  NOTE        the nvtx package is missing: NVTX ranges fall back to torch.cuda.nvtx"
                     + (" (Nsight Systems shows them the same way)." if cuda else "; without CUDA they do nothing."))
    lines.append("  Stage 1  timing and torch.profiler run here; " +
                 ("the nsys lab runs here." if nsys and cuda else "the nsys lab needs a CUDA machine with nsys — "
                  "use the torch.profiler route (handout 01 §5)."))
    lines.append("  Stage 2  " + ("fp16 and bf16 autocast on the GPU." if cuda else
                                  "bf16 autocast on the CPU; fp16 loss scaling is tested with injected gradients."))
    lines.append("  Stage 3  " + ("Triton kernels compile for the GPU; benchmarks are meaningful." if not interp else
                                  "Triton kernels run in the interpreter: correct but slow — keep shapes small."))
    lines.append("  Stages 4–6  distributed code runs on local processes with " + ("NCCL." if cuda else "gloo."))
    return "\n".join(lines)
