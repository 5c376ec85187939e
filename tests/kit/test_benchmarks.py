"""Every benchmark runs end to end at smoke size and writes its stamped results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("bench_*.py"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=[p.stem for p in BENCHMARKS])
def test_benchmark_smoke(script: Path, tmp_path: Path) -> None:
    # No PYTHONPATH: a benchmark must run as `python benchmarks/<name>.py` from a fresh shell.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{script.name} --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    results = list(tmp_path.glob("*.json"))
    assert results, f"{script.name} wrote no JSON results into --out"
    for path in results:
        env_stamp = json.loads(path.read_text())["environment"]
        for key in ("device", "torch", "date", "command"):
            assert env_stamp.get(key), f"{path.name} lacks the {key!r} stamp"
    assert "|" in proc.stdout, f"{script.name} printed no markdown table"
