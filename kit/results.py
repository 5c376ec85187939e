"""Write benchmark results the same way everywhere: a markdown table on stdout and ``<name>.{md,csv,json}``,
each stamped with the device, library versions, date, implementation and the command line, and with the
machine stamp (:func:`machine_stamp`): the CPU model, the instruction sets that decide its speed, torch's CPU
code path and BLAS. A CPU figure means little without them: the same bf16 step is faster than fp32 on a CPU
with bf16 units and over ten times slower on one without.

Two folders: :data:`RESULTS_DIR` (``benchmarks/results/``) holds the committed tables, measured with the
reference at full size; :data:`SCRATCH_DIR` (``bench-output/``, git-ignored) is where every other run
writes. :mod:`kit.bench` decides which one a run may use.
"""

from __future__ import annotations

import csv
import datetime as dt
import functools
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
SCRATCH_DIR = ROOT / "bench-output"

# The instruction sets that decide how fast this kit's CPU matmuls run, per architecture family, as Linux's
# /proc/cpuinfo names them (x86 "flags", ARM "Features"): vector width, and whether bf16 has its own units.
RELEVANT_ISA: dict[str, tuple[str, ...]] = {
    "x86": ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"),
    "arm": ("asimd", "neon", "bf16", "sve"),
}
# Any of these executes bf16 dot products natively; without one, torch widens bf16 to fp32 and rounds back
# (emulation), and bf16 is slower than fp32.
BF16_UNITS: dict[str, tuple[str, ...]] = {"x86": ("avx512_bf16", "amx_bf16"), "arm": ("bf16",)}
# Environment variables that change which code path ATen, MKL or oneDNN take: a run with one set is not
# comparable with a run without.
CODE_PATH_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
                       "DNNL_MAX_CPU_ISA")
# macOS has no /proc/cpuinfo: sysctl keys whose value 1 means the ARM feature is there.
_DARWIN_ARM_FEATURES = {"asimd": "hw.optional.AdvSIMD", "bf16": "hw.optional.arm.FEAT_BF16",
                        "sve": "hw.optional.arm.FEAT_SVE"}


def isa_family(arch: str) -> str | None:
    """``"x86"`` or ``"arm"`` for a ``platform.machine()`` value, None for other architectures."""
    arch = arch.lower()
    if arch in ("x86_64", "amd64", "i386", "i686", "x86"):
        return "x86"
    if arch in ("aarch64", "arm64") or arch.startswith("armv"):
        return "arm"
    return None


def _sysctl(key: str) -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def parse_cpuinfo(text: str) -> tuple[str | None, frozenset[str] | None]:
    """CPU model and feature flags from the text of Linux's ``/proc/cpuinfo`` (the first processor's: they are
    all alike); None for what it does not say."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    model = fields.get("model name") or fields.get("hardware") or fields.get("cpu model")
    if model is None and "cpu implementer" in fields:
        # ARM kernels name no model: the implementer and part numbers identify the core (0x41/0xd0c: Neoverse N1).
        model = f"ARM implementer {fields['cpu implementer']}, part {fields.get('cpu part', '?')}"
    flags = fields.get("flags") or fields.get("features")
    return model, None if flags is None else frozenset(flags.split())


def _darwin_cpu(family: str | None) -> tuple[str | None, frozenset[str] | None]:
    """CPU model and the flags that matter from ``sysctl`` (macOS)."""
    model = _sysctl("machdep.cpu.brand_string")
    if family == "arm":
        flags = frozenset(name for name, key in _DARWIN_ARM_FEATURES.items() if _sysctl(key) == "1")
        return model, flags
    features = " ".join(filter(None, (_sysctl("machdep.cpu.features"), _sysctl("machdep.cpu.leaf7_features"))))
    if not features:
        return model, None
    # sysctl spells them AVX2, AVX512F, …; /proc/cpuinfo avx2, avx512f, …
    return model, frozenset(f.lower().replace(".", "_") for f in features.split())


@functools.cache
def cpu_identity() -> tuple[str, frozenset[str] | None]:
    """This CPU's model name and feature flags (lower case, Linux's names); the flags are None where the system
    does not say (Windows, an unreadable /proc). Cached: neither changes while the process runs."""
    family = isa_family(platform.machine())
    model, flags = None, None
    if platform.system() == "Linux":
        try:
            model, flags = parse_cpuinfo(Path("/proc/cpuinfo").read_text(errors="replace"))
        except OSError:
            pass
    elif platform.system() == "Darwin":
        model, flags = _darwin_cpu(family)
    return model or platform.processor() or platform.machine() or "unknown CPU", flags


def relevant_isa(arch: str, flags: frozenset[str] | None) -> list[str] | None:
    """The instruction sets of :data:`RELEVANT_ISA` that ``flags`` has, in that order; None when unknown."""
    family = isa_family(arch)
    if flags is None or family is None:
        return None
    return [name for name in RELEVANT_ISA[family] if name in flags]


def has_native_bf16(arch: str, flags: frozenset[str] | None) -> bool | None:
    """Whether the CPU executes bf16 natively (:data:`BF16_UNITS`): avx512_bf16 or amx_bf16 on x86, bf16 on ARM.
    None when the flags are unknown or the architecture is neither."""
    family = isa_family(arch)
    if flags is None or family is None:
        return None
    return any(unit in flags for unit in BF16_UNITS[family])


@functools.cache
def _torch_build() -> dict[str, str | None]:
    """The BLAS and oneDNN torch was built with, from ``torch.__config__.show()``: ``blas`` (BLAS_INFO, e.g.
    ``mkl`` or ``open`` for OpenBLAS), ``mkl`` (MKL's version, if linked) and ``onednn`` (its version)."""
    import torch

    config = torch.__config__.show()

    def find(pattern: str) -> str | None:
        match = re.search(pattern, config)
        return match.group(1).strip() if match else None

    return {"blas": find(r"BLAS_INFO=([^,\s]+)"),
            "mkl": find(r"Math Kernel Library Version ([^\s-]+)"),
            "onednn": find(r"(?:MKL-DNN|oneDNN) (v[\d.]+)")}


def _version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def machine_stamp() -> dict[str, Any]:
    """What a CPU figure depends on, for every results table and ``tests/timings.json``.

    ``cpu`` (model name), ``arch``, ``os``, ``cores``; ``isa``: which of :data:`RELEVANT_ISA` the CPU has (None:
    could not be read); ``native_bf16``: whether it has bf16 units (:func:`has_native_bf16`); ``torch_cpu_capability``
    (the vector code ATen dispatches to: DEFAULT, AVX2, AVX512, SVE256 …); ``blas``, ``mkl``, ``onednn`` (torch's
    build); ``code_path_env``: the :data:`CODE_PATH_VARIABLES` that are set; ``torch_threads`` (intra-op, now);
    ``torch`` and ``triton`` versions.
    """
    import torch

    model, flags = cpu_identity()
    arch = platform.machine()
    return {
        "cpu": model,
        "arch": arch,
        "os": platform.system(),
        "cores": os.cpu_count(),
        "isa": relevant_isa(arch, flags),
        "native_bf16": has_native_bf16(arch, flags),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **_torch_build(),
        "code_path_env": {name: os.environ[name] for name in CODE_PATH_VARIABLES if name in os.environ},
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": _version_of("triton"),
    }


def bf16_note(machine: dict[str, Any]) -> str | None:
    """The line a table with CPU bf16 rows carries when ``machine`` (a :func:`machine_stamp`) has no bf16 units,
    or may not have them: the reader must not take its bf16-vs-fp32 ratio for what bf16 does elsewhere. None
    when the CPU has them."""
    if machine.get("native_bf16") is True:
        return None
    family = isa_family(machine.get("arch", ""))
    units = "/".join(BF16_UNITS[family]) if family else "bf16 instructions"
    consequence = ("bf16 runs emulated (each bf16 value widened to fp32 and rounded back) and is slower than fp32 "
                   "here; on a CPU with them, or on a GPU, bf16 is the faster one")
    if machine.get("native_bf16") is False:
        return f"this CPU has no bf16 units (no {units}): {consequence}."
    return f"this CPU's instruction sets could not be read; if it has no bf16 units ({units}), {consequence}."


def load_average() -> str:
    """How busy the machine was (1-minute load average on its cores): CPU timings depend on what else runs."""
    if not hasattr(os, "getloadavg"):
        return "unknown"
    return f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def command_line() -> str:
    """The command that started this process, as typed: ``python -m benchmarks.bench_ddp --smoke``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    program = f"-m {spec.name}" if spec is not None and spec.name else shlex.quote(sys.argv[0])
    return f"python {program} " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def environment(**extra: str) -> dict[str, Any]:
    """Device, versions, date and command (plus ``extra``, e.g. ``impl``), and under ``machine`` the
    :func:`machine_stamp`: what a reader needs to trust or reproduce a number. Every value is a string but
    ``machine``'s dict."""
    import torch

    machine = machine_stamp()
    if torch.cuda.is_available():
        device = f"{torch.cuda.get_device_name(0)} ×{torch.cuda.device_count()}"
    else:
        device = f"CPU ({machine['cpu']}, {machine['arch']}, {torch.get_num_threads()} threads)"
    return {
        "device": device,
        "load": load_average(),
        "torch": torch.__version__,
        "triton": machine["triton"],
        "python": sys.version.split()[0],
        **extra,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command_line().strip(),
        "machine": machine,
    }


def _stamp_value(value: Any) -> str:
    """A machine-stamp value as a table header shows it: lists space-separated, booleans yes/no, None unknown."""
    if value is None:
        return "unknown"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return " ".join(map(str, value)) or "none"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "none set"
    return str(value)


def stamp_lines(env: dict[str, Any]) -> list[str]:
    """``env`` (an :func:`environment`) as header lines: ``key: value`` pairs, then ``machine: …`` on its own."""
    lines = [" · ".join(f"{k}: {v}" for k, v in env.items() if k != "machine")]
    if "machine" in env:
        lines.append("machine: " + " · ".join(f"{k}: {_stamp_value(v)}" for k, v in env["machine"].items()))
    return lines


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])

    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def save_results(name: str, rows: list[dict], *, out_dir: Path, columns: list[str] | None = None,
                 title: str | None = None, stamp: dict[str, str] | None = None,
                 notes: list[str] | None = None) -> dict[str, Path]:
    """Print the table and write ``<name>.csv``, ``<name>.json`` and ``<name>.md`` into ``out_dir``; return
    their paths. ``stamp`` adds entries to the environment stamp; ``notes`` are lines a reader needs before the
    numbers (``Note:`` paragraphs in the markdown, ``# note:`` lines in the CSV, ``"notes"`` in the JSON)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(**(stamp or {}))
    notes = list(notes or [])
    table = markdown_table(rows, columns)
    header = "".join(f"{part}\n\n" for part in [f"## {title or name}", *stamp_lines(env),
                                                   *(f"Note: {n}" for n in notes)])
    print(header + table)
    paths = {"csv": out_dir / f"{name}.csv", "json": out_dir / f"{name}.json", "md": out_dir / f"{name}.md"}
    columns = columns or (list(rows[0]) if rows else [])
    with open(paths["csv"], "w", newline="") as f:
        f.write("".join(f"# {k}: {v}\n" for k, v in env.items() if k != "machine"))
        f.write("".join(f"# machine.{k}: {_stamp_value(v)}\n" for k, v in env["machine"].items()))
        f.write("".join(f"# note: {n}\n" for n in notes))
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    paths["json"].write_text(json.dumps({"environment": env, "notes": notes, "rows": rows}, indent=2, default=str))
    paths["md"].write_text(header + table + "\n")
    return paths
