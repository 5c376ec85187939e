"""``python -m instructor numerics``: the reference graded, public and hidden tests, on each CPU code path a grader
or a student's laptop may take. Every cell must give full marks (``make numerics``).

A CPU changes results through three switches, and this machine can take each path another CPU would:

* ``MKL_CBWR`` — the code path of MKL, the BLAS of torch's x86 wheels (every matmul): ``AUTO`` (this CPU's
  widest), ``COMPATIBLE`` (SSE2, the most generic), ``AVX2`` (an AMD EPYC or a laptop without AVX-512),
  ``AVX512`` (only where the CPU has it);
* ``ATEN_CPU_CAPABILITY`` — the vectorised kernels of ATen itself (element-wise ops, reductions, softmax):
  ``default`` (no SIMD), ``avx2``, ``avx512`` (where the CPU has it);
* ``ONEDNN_MAX_CPU_ISA`` — oneDNN's code path, which runs torch's bf16 and fp16 matmuls on a CPU: capped at
  ``AVX2`` it has no bf16 units, as on an AMD EPYC or a laptop (bf16 matmuls emulated, 40-270x slower here),
  ``SSE41`` the most generic.

The matrix is pruned to the cells that change a result, and says how:

* **threads**: the kit pins one torch thread in the judge and every rank (``kit/spawn/worker.py``,
  ``tests/conftest.py``), so a graded run never takes a 2-thread path: that axis is dropped;
* **a capability the CPU lacks** is skipped (an AVX2 machine has no ``AVX512`` or ``avx512`` cell), and the table
  says which were;
* **the pairs a machine can have**: a CPU's BLAS and ATen paths go together on real hardware (an AVX2 CPU runs
  both as AVX2), plus the two ends — the most generic of both, and the widest mismatch (MKL's AVX2 with
  ATen's scalar kernels), where summation orders differ most from the machine that recorded the tolerances.

``--cell auto`` picks one cell by the day of the year (CI grades one rotating cell on every run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Cell:
    name: str
    mkl_cbwr: str  # "" leaves MKL_CBWR unset (AUTO)
    aten: str  # "" leaves ATEN_CPU_CAPABILITY unset (this CPU's widest)
    onednn: str = ""  # "" leaves ONEDNN_MAX_CPU_ISA unset (this CPU's widest)
    needs: str = ""  # a /proc/cpuinfo flag the CPU must have, e.g. "avx512f"
    why: str = ""

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
        for name, value in zip(SWITCHES, (self.mkl_cbwr, self.aten, self.onednn)):
            if value:
                env[name] = value
        return env


SWITCHES = ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
CELLS = (
    Cell("native", "", "", why="this CPU's own paths"),
    Cell("avx2", "AVX2", "avx2", "AVX2", "avx2", "an AVX2 CPU without bf16 units (AMD EPYC, most laptops)"),
    Cell("avx512", "AVX512", "avx512", "AVX512_CORE", "avx512f", "an AVX-512 CPU without bf16 units"),
    Cell("generic", "COMPATIBLE", "default", "SSE41", why="the most generic paths everywhere (the slowest)"),
    Cell("mixed", "AVX2", "default", "AVX2", "avx2", "the widest mismatch: MKL's AVX2, ATen's scalar kernels"),
)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def choose(names: list[str] | None, flags: set[str]) -> tuple[list[Cell], list[str]]:
    """The cells to run (``names``, ``["auto"]`` for today's, or all) and notes on the ones this CPU cannot take."""
    available = [c for c in CELLS if not c.needs or c.needs in flags]
    skipped = [f"{c.name}: this CPU has no {c.needs}" for c in CELLS if c not in available]
    if names == ["auto"]:
        return [available[datetime.date.today().timetuple().tm_yday % len(available)]], skipped
    if names:
        unknown = sorted(set(names) - {c.name for c in CELLS})
        if unknown:
            raise SystemExit(f"--cell: unknown {unknown}; the cells are {[c.name for c in CELLS]}")
        chosen = [c for c in available if c.name in names]
        skipped = [s for s in skipped if s.split(":")[0] in names]
        return chosen, skipped
    return available, skipped


def grade(cell: Cell, out: Path, stages: str | None, hidden: bool) -> dict:
    """Grade the reference in ``cell``'s environment; its score, maximum and wall seconds."""
    result = out / f"{cell.name}.json"
    command = [sys.executable, "-m", "kit", "grade", "--impl", "reference", "--json", str(result)]
    command += ["--hidden"] if hidden else []
    command += ["--stage", stages] if stages else []
    start = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, env=cell.env(), capture_output=True, text=True)
    seconds = time.monotonic() - start
    if proc.returncode != 0 or not result.exists():
        return {"cell": cell.name, "score": None, "max": None, "seconds": seconds, "lost": [proc.stderr[-2000:]]}
    data = json.loads(result.read_text())
    lost = [f"{t['name']}: {t['output'][:400]}" for t in data["tests"] if t["score"] < t["max_score"]]
    return {"cell": cell.name, "score": data["score"], "max": data["max_score"], "seconds": seconds, "lost": lost}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m instructor numerics", description=__doc__.split("\n")[0])
    parser.add_argument("--cell", help="comma-separated cells (" + ", ".join(c.name for c in CELLS) +
                        "), or auto for today's; default all this CPU can take")
    parser.add_argument("--stage", help="stages to grade, e.g. 6 or 1,6 (default all)")
    parser.add_argument("--public", action="store_true", help="public tests only (default: with the hidden tests)")
    parser.add_argument("--out", default=str(ROOT / "numerics-output"), help="where each cell's results.json goes")
    args = parser.parse_args(argv)
    cells, skipped = choose(args.cell.split(",") if args.cell else None, cpu_flags())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, failed = [], False
    for n, cell in enumerate(cells, 1):
        print(f"[{n}/{len(cells)}] {cell.name}: MKL_CBWR={cell.mkl_cbwr or 'AUTO'} "
              f"ATEN_CPU_CAPABILITY={cell.aten or 'native'} ONEDNN_MAX_CPU_ISA={cell.onednn or 'native'} "
              f"({cell.why}) …", flush=True)
        row = grade(cell, out, args.stage, not args.public)
        rows.append(row)
        full = row["score"] is not None and row["score"] == row["max"]
        failed |= not full
        print(f"    {row['score']}/{row['max']} in {row['seconds']:.0f} s" + ("" if full else " — NOT full marks:"))
        for line in row["lost"]:
            print(f"      {line}")
    print("\n| cell | MKL_CBWR | ATEN_CPU_CAPABILITY | ONEDNN_MAX_CPU_ISA | score | wall s |")
    print("|---|---|---|---|---|---|")
    by_name = {c.name: c for c in CELLS}
    for row in rows:
        cell = by_name[row["cell"]]
        print(f"| {cell.name} | {cell.mkl_cbwr or 'AUTO'} | {cell.aten or 'native'} | {cell.onednn or 'native'} | "
              f"{row['score']}/{row['max']} | {row['seconds']:.0f} |")
    for note in skipped:
        print(f"skipped {note}")
    command = "python -m instructor numerics " + " ".join(sys.argv[1:] if argv is None else argv)
    record = {"rows": rows, "skipped": skipped, "date": datetime.date.today().isoformat(), "command": command}
    (out / "matrix.json").write_text(json.dumps(record, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
