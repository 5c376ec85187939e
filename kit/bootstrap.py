"""Install the kit's dependencies into the current interpreter (``make setup`` calls this inside .venv).

Reads them from pyproject.toml so there is one list. The kit itself is not installed: it runs from the
repository (or a grading copy of it), so ``student`` always means the folder next to the tests.

    python -m kit.bootstrap                 # CPU machine: pins from constraints-cpu.txt
    python -m kit.bootstrap --gpu           # CUDA machine: keep the torch + triton already installed
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def requirements(gpu: bool) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + list(project["optional-dependencies"]["dev"])
    if gpu:
        # The CUDA build of torch brings the triton it was built with; do not replace either.
        reqs = [r for r in reqs if r.split(">")[0].split("=")[0].split("<")[0].strip() not in ("torch", "triton")]
    return reqs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="keep the installed CUDA torch and triton")
    args = parser.parse_args()
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if not args.gpu:
        cmd += ["-c", str(ROOT / "constraints-cpu.txt")]
    cmd += requirements(args.gpu)
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
