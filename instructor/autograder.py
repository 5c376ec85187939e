"""The Gradescope bundle: ``make autograder`` (``python -m instructor autograder``) → ``dist/autograder.zip``.

Gradescope unzips the bundle into ``/autograder/source``, runs ``setup.sh`` once when the image is
built, then ``run_autograder`` for each submission (uploaded to ``/autograder/submission``), which must
leave ``/autograder/results/results.json``. The bundle holds the kit, the public and hidden tests and the
handout (for the per-problem breakdown) — never ``reference/`` and never a ``student/`` package: the
submission's ``student/**/*.py`` is copied into a clean staging copy of the kit for each run.

Every path is configurable through the environment, so the same bundle runs locally in tests:
``AUTOGRADER_SOURCE``, ``AUTOGRADER_SUBMISSION``, ``AUTOGRADER_RESULTS``. What ``run_autograder`` calls,
``python -m kit autograde``, is the kit's (:mod:`kit.grading.autograde`): it ships in the bundle; this
builder does not.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from kit.grading import tree

ROOT = Path(__file__).resolve().parent.parent
BUNDLE_ITEMS = ("kit", "tests", "handout", "pyproject.toml", "constraints-cpu.txt")
BUNDLE_EXCLUDE = ("tests/kit",)

SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once while building the autograder image (Ubuntu, as root).
set -euo pipefail
cd "${AUTOGRADER_SOURCE:-/autograder/source}"

# A Python the kit supports (>= 3.11). Ubuntu 22.04's python3 is 3.10, and `apt-get install python3` gives
# 3.10 again: look for python3.13 ... python3.11 first, then install one by its versioned name.
supported() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; }
find_python() {
    for candidate in python3 python3.13 python3.12 python3.11; do
        if command -v "$candidate" >/dev/null && supported "$candidate"; then command -v "$candidate"; return 0; fi
    done
    return 1
}
if ! PYTHON=$(find_python); then
    echo "setup.sh: no Python >= 3.11 here (python3 is $(python3 --version 2>&1 || echo missing)); installing one"
    apt-get update >/dev/null || true
    for version in 3.13 3.12 3.11; do
        if apt-get install -y "python$version" "python$version-venv" >/dev/null 2>&1 && PYTHON=$(find_python); then
            break
        fi
    done
fi
if ! PYTHON=$(find_python); then
    echo "setup.sh: the kit needs Python >= 3.11, and none could be installed on this image" \\
         "(python3 is $(python3 --version 2>&1 || echo missing)). Choose a base image with Python >= 3.11" \\
         "in Gradescope's autograder settings (Ubuntu 24.04 has 3.12), or add the deadsnakes PPA here." >&2
    exit 1
fi
echo "setup.sh: using $PYTHON ($("$PYTHON" --version 2>&1))"
[ -n "${KIT_SETUP_CHECK_ONLY:-}" ] && exit 0
"$PYTHON" -m venv .venv
.venv/bin/python -m kit.setup.bootstrap
# Says whether this image meets the grader's floor (CPUs, memory, Landlock for confined workers).
.venv/bin/python -m kit doctor --grader || true
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
        for rel in tree.files(BUNDLE_ITEMS, root=root, exclude=BUNDLE_EXCLUDE):
            z.write(root / rel, rel)
    return out
