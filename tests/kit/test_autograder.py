"""The Gradescope bundle runs end to end: unzip, run_autograder, results.json — full marks and zero."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from instructor.autograder import build_autograder

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    zip_path = build_autograder(tmp_path_factory.mktemp("bundle") / "autograder.zip")
    source = zip_path.parent / "source"
    with zipfile.ZipFile(zip_path) as z:
        names = z.namelist()
        z.extractall(source)
    assert "setup.sh" in names and "run_autograder" in names
    assert not any(n.startswith(("reference/", "student/", "tests/kit/")) for n in names), names
    assert any(n.startswith("tests/hidden/") for n in names), "hidden tests belong in the bundle"
    for script in ("setup.sh", "run_autograder"):
        (source / script).chmod(0o755)
    # setup.sh would build .venv from PyPI; reuse ours (same pins) so the test runs offline and fast.
    (source / ".venv").symlink_to(ROOT / ".venv")
    return source


def _run(bundle: Path, submission: Path, results: Path) -> dict:
    env = {**os.environ, "AUTOGRADER_SOURCE": str(bundle), "AUTOGRADER_SUBMISSION": str(submission),
           "AUTOGRADER_RESULTS": str(results), "AUTOGRADER_ARGS": "--stage 1"}
    env.pop("LLMSYS_IMPL", None)
    proc = subprocess.run([str(bundle / "run_autograder")], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(results.read_text())


def test_bundle_gives_the_reference_full_marks(bundle, tmp_path):
    submission = tmp_path / "submission"
    shutil.copytree(ROOT / "student", submission / "student", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "reference" / "benchmarking.py", submission / "student" / "benchmarking.py")
    data = _run(bundle, submission, tmp_path / "results" / "results.json")
    assert data["max_score"] > 0 and data["score"] == data["max_score"], json.dumps(data, indent=1)[:3000]
    visibility = {t["visibility"] for t in data["tests"]}
    assert visibility == {"visible", "after_published"}, "public tests visible, hidden ones after publishing"
    assert data["stdout_visibility"] == "hidden"


def test_bundle_gives_the_stubs_zero(bundle, tmp_path):
    submission = tmp_path / "submission"
    shutil.copytree(ROOT / "student", submission / "student", ignore=shutil.ignore_patterns("__pycache__"))
    data = _run(bundle, submission, tmp_path / "results.json")
    assert data["score"] == 0 and data["max_score"] > 0
    assert all(t["status"] == "failed" for t in data["tests"])


def test_bundle_writes_results_for_an_empty_upload(bundle, tmp_path):
    (tmp_path / "empty").mkdir()
    data = _run(bundle, tmp_path / "empty", tmp_path / "results.json")
    assert data["score"] == 0 and "could not" in data["output"]


def _stand_ins(folder: Path, python3: str, apt_gives: str | None) -> Path:
    """A PATH of stand-ins: ``python3`` reporting version ``python3``, and an ``apt-get`` that, asked for
    ``python<apt_gives>``, installs it as a link to a real supported Python (and otherwise fails)."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    ok = 0 if tuple(int(x) for x in python3.split(".")) >= (3, 11) else 1
    (bin_dir / "python3").write_text(f'#!/bin/sh\n[ "$1" = "--version" ] && echo "Python {python3}"\nexit {ok}\n')
    wanted = f"python{apt_gives}" if apt_gives else "nothing"
    (bin_dir / "apt-get").write_text(
        f'#!/bin/sh\necho "apt-get $*" >> {folder}/apt.log\n'
        f'for a in "$@"; do [ "$a" = "{wanted}" ] && /bin/ln -sf {sys.executable} {bin_dir}/{wanted} && exit 0; done\n'
        '[ "$1" = "update" ] && exit 0\nexit 100\n')
    for script in bin_dir.iterdir():
        script.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("python3, apt_gives, chosen", [
    ("3.12.3", None, "python3"),           # Ubuntu 24.04: nothing to install
    ("3.10.12", "3.11", "python3.11"),     # Ubuntu 22.04: python3 is 3.10, python3.11 is a package
    ("3.10.12", None, None),               # nothing supported to be had: stop, and say what to do
])
def test_setup_finds_or_installs_a_supported_python(tmp_path, python3, apt_gives, chosen):
    from instructor.autograder import SETUP_SH

    script = tmp_path / "setup.sh"
    script.write_text(SETUP_SH)
    bin_dir = _stand_ins(tmp_path, python3, apt_gives)
    env = {"PATH": str(bin_dir), "AUTOGRADER_SOURCE": str(tmp_path), "KIT_SETUP_CHECK_ONLY": "1"}
    proc = subprocess.run(["/bin/bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    if chosen is None:
        assert proc.returncode != 0, proc.stdout + proc.stderr
        assert "needs Python >= 3.11" in proc.stderr and "python3 is Python 3.10.12" in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"using {bin_dir / chosen}" in proc.stdout, proc.stdout
    installed = (tmp_path / "apt.log").read_text() if (tmp_path / "apt.log").exists() else ""
    assert ("install" in installed) == (python3 < "3.11"), installed
