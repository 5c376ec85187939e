"""The Gradescope autograder bundle: ``make autograder`` → ``dist/autograder.zip``.

Gradescope unzips the bundle into ``/autograder/source``, runs ``setup.sh`` once when the image is
built, then ``run_autograder`` for each submission (uploaded to ``/autograder/submission``), which must
leave ``/autograder/results/results.json``. The bundle holds the kit, the public and hidden tests and the
handout (for the per-problem breakdown) — never ``reference/`` and never a ``student/`` package: the
submission's ``student/**/*.py`` is copied into a clean staging copy of the kit for each run.

Every path is configurable through the environment, so the same bundle runs locally in tests:
``AUTOGRADER_SOURCE``, ``AUTOGRADER_SUBMISSION``, ``AUTOGRADER_RESULTS``.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kit.grading.running import Limits

ROOT = Path(__file__).resolve().parent.parent
BUNDLE_ITEMS = ("kit", "tests", "handout", "pyproject.toml", "constraints-cpu.txt")
BUNDLE_EXCLUDE = ("tests/kit", "__pycache__", ".pytest_cache")

SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once while building the autograder image (Ubuntu, as root).
set -euo pipefail
cd "${AUTOGRADER_SOURCE:-/autograder/source}"
if ! command -v python3 >/dev/null || ! python3 -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
    apt-get update && apt-get install -y python3 python3-pip python3-venv
fi
python3 -m venv .venv
.venv/bin/python -m kit.bootstrap
# Graded code runs as an unprivileged user that cannot write the kit or the results folder.
id -u grader >/dev/null 2>&1 || useradd --create-home --shell /usr/sbin/nologin grader || true
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for each submission; it must leave results.json behind whatever happens.
set -uo pipefail
SOURCE="${AUTOGRADER_SOURCE:-/autograder/source}"
cd "$SOURCE"
PY="$SOURCE/.venv/bin/python"
[ -x "$PY" ] || PY=python3
exec "$PY" -m kit autograde \\
    --submission "${AUTOGRADER_SUBMISSION:-/autograder/submission}" \\
    --results "${AUTOGRADER_RESULTS:-/autograder/results/results.json}" ${AUTOGRADER_ARGS:-}
"""


def build_autograder(out: Path = ROOT / "dist" / "autograder.zip", root: Path = ROOT) -> Path:
    """Write the bundle; returns its path."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in (("setup.sh", SETUP_SH), ("run_autograder", RUN_AUTOGRADER)):
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o755 << 16
            z.writestr(info, text)
        for item in BUNDLE_ITEMS:
            src = root / item
            paths = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
            for path in paths:
                rel = path.relative_to(root).as_posix()
                if any(rel.startswith(x) or f"/{x}/" in f"/{rel}" for x in BUNDLE_EXCLUDE) or rel.endswith(".pyc"):
                    continue
                z.write(path, rel)
    return out


def autograde(submission: Path, results: Path, *, stages: list[int] | None = None,
              limits: Limits | None = None) -> dict:
    """Grade one uploaded submission with the public and hidden tests; always write ``results``."""
    from kit.grading.reporting import gradescope_json
    from kit.grading.running import grade

    results.parent.mkdir(parents=True, exist_ok=True)
    try:
        result = grade(str(submission), stages=stages, include_hidden=True, limits=limits)
        data = gradescope_json(result)
        if result.status == "error":
            data["output"] = "The autograder could not run the tests on this submission. " + result.message
    except Exception as exc:  # the results file must exist even when grading itself failed
        data = {"score": 0, "execution_time": 0, "tests": [], "stdout_visibility": "hidden",
                "output": f"The autograder could not grade this submission: {type(exc).__name__}: {exc}"}
    tmp = results.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, results)
    return data
