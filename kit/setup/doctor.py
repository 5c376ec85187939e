"""``python -m kit doctor``: what this machine will run, and what that means for each lab."""

from __future__ import annotations

import importlib
import platform
import shutil
import sys

import kit
from kit import nvtx_ranges, results


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
    machine = results.machine_stamp()
    isa = " ".join(machine.get("isa") or []) or "unknown"
    bf16 = {True: "yes", False: "no", None: "unknown"}[machine.get("native_bf16")]
    lines.append(f"  CPU         {machine.get('cpu')} ({machine.get('arch')}; {isa}; bf16 units: {bf16})")
    if cuda:
        props = torch.cuda.get_device_properties(0)
        lines.append(f"  CUDA device {props.name} ×{torch.cuda.device_count()}, {props.total_memory / 2**30:.0f} GiB, "
                     f"compute capability {props.major}.{props.minor}")
    else:
        lines.append("  CUDA device none")
    interp = kit.triton_interpreted()
    from kit.setup.portable import NEEDS_TRITON, portable, triton_available

    mode = "interpreted (TRITON_INTERPRET=1)" if interp else "compiled"
    lines.append(f"  Triton mode {mode if triton_available() else 'none: its tests are skipped, ' + NEEDS_TRITON}")
    workers = ("fresh processes (the portable path, kit/setup/portable.py): local checks only, no grading" if portable()
               else "forked from a warm zygote (Linux): local checks and grading")
    lines.append(f"  workers     {workers}")
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
    if not cuda:
        lines.append("           " + {
            "yes": "this CPU has bf16 units: bf16 autocast can be faster than fp32 here (benchmarks say by how much).",
            "no": "this CPU has no bf16 units: bf16 matmuls go through fp32 and run several times slower than fp32 "
                  "here — right answers, slow figures (handout 01, 07b).",
            "unknown": "whether this CPU has bf16 units is unknown: compare bf16 and fp32 in bench_model."}[bf16])
    lines.append("  Stage 3  " + ("Triton kernels compile for the GPU; benchmarks are meaningful." if not interp else
                                  "Triton kernels run in the interpreter: correct but slow — keep shapes small."))
    lines.append("  Stages 4–6  distributed code runs on local processes with " + ("NCCL." if cuda else "gloo."))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the grader's floor

# What grading one submission needs, measured on the 2-core, 24 GiB machine that records the kit's timings
# (INSTRUCTOR.md, "Grading": the grader's resource floor).
FLOOR_CPUS = 1  # grading works on one CPU, slower: Stage 6's 8 ranks take turns on it
RECOMMENDED_CPUS = 2
FLOOR_MEMORY_GIB = 3.0  # the graded suite with the hidden tests peaked 2.1 GiB above the idle machine
RECOMMENDED_MEMORY_GIB = 4.0


def available_cpus() -> float:
    """CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (a container's CPU setting)."""
    import os

    cpus = float(len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else float(os.cpu_count() or 1)
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        if quota != "max":
            cpus = min(cpus, int(quota) / int(period))
    except (OSError, ValueError):
        pass
    return cpus


def available_memory_gib() -> float | None:
    """Memory available now: the kernel's MemAvailable, capped by a cgroup v2 limit; None where unknown."""
    found = []
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) / 2**20)
    except OSError:
        pass
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current").read())
        if limit != "max":
            found.append((int(limit) - used) / 2**30)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def grader_floor() -> list[str]:
    """What this machine lacks to grade well, one line each (empty: it meets the recommendation)."""
    from kit.spawn.confine import landlock_abi

    problems = []
    cpus, memory = available_cpus(), available_memory_gib()
    if cpus < RECOMMENDED_CPUS:
        problems.append(f"{cpus:g} CPU(s) (recommended: {RECOMMENDED_CPUS}): grading works but takes longer; no test "
                        "loses points to it (limits count CPU time, not the clock)")
    if memory is not None and memory < FLOOR_MEMORY_GIB:
        problems.append(f"{memory:.1f} GiB of memory available (floor: {FLOOR_MEMORY_GIB:g} GiB, recommended "
                        f"{RECOMMENDED_MEMORY_GIB:g}): Stage 6's 8 ranks may not fit, and tests would fail with "
                        "MemoryError or a killed worker")
    elif memory is not None and memory < RECOMMENDED_MEMORY_GIB:
        problems.append(f"{memory:.1f} GiB of memory available (recommended: {RECOMMENDED_MEMORY_GIB:g} GiB): enough "
                        "for one submission at a time (--jobs 1)")
    if landlock_abi() < 1:
        problems.append("no Landlock in this kernel: workers run unconfined, so a submission could read and write "
                        "what the grader's user can (INSTRUCTOR.md, 'What a grade can be trusted for')")
    problems += [f"{what}: {why.removeprefix('no: ')}" for what, why in containment().items() if why.startswith("no")]
    return problems


def containment() -> dict[str, str]:
    """``{feature: "yes: …" or "no: why"}`` for what the kernel lets the grader do beyond Landlock
    (:mod:`kit.spawn.contain`): a cgroup per run, a network namespace per zygote."""
    from kit.spawn.contain import cgroup_support, network_support

    cgroups, network = cgroup_support(), network_support()
    return {"cgroups": cgroups + ("" if cgroups.startswith("yes") else
                                  " — a daemon that hides from /proc may outlive its grade"),
            "network": network + ("" if network.startswith("yes") else
                                  " — one submission's daemon can connect to another run's gloo ranks on loopback: "
                                  "grade one submission per container")}


def grader_report() -> str:
    """``python -m kit doctor --grader``: this machine against the grader's floor."""
    from kit.spawn.confine import landlock_abi

    memory = available_memory_gib()
    lines = ["LLM Systems Lab — grader check",
             f"  CPUs        {available_cpus():g} (recommended {RECOMMENDED_CPUS}, floor {FLOOR_CPUS})",
             f"  memory      {'unknown' if memory is None else f'{memory:.1f} GiB available'} "
             f"(recommended {RECOMMENDED_MEMORY_GIB:g} GiB, floor {FLOOR_MEMORY_GIB:g})",
             f"  Landlock    {'ABI ' + str(landlock_abi()) if landlock_abi() else 'none'} (confines the workers)"]
    lines += [f"  {what:<11} {why.split(' — ')[0]}" for what, why in containment().items()]
    problems = grader_floor()
    ok = ["  OK          this machine meets the grader's recommendation"]
    lines += [f"  WARNING     {p}" for p in problems] or ok
    return "\n".join(lines)
