"""`make lab`: JupyterLab serves the notebooks on the kit's .venv kernel, headless, and stops cleanly.

The test starts `make lab` on a free port of 127.0.0.1 without a browser, in its own process group, fetches a
notebook and the kernel specs over HTTP (a bounded number of tries, a bounded time), then stops the group and
checks that no process of it is left.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
START_S = 120  # JupyterLab starts in a few seconds; a loaded 2-core machine may take tens


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 — 127.0.0.1 only
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_make_lab_serves_a_notebook_on_the_kit_kernel(tmp_path: Path) -> None:
    pytest.importorskip("jupyterlab", reason="JupyterLab is optional on a GPU image (make lab says how to add it)")
    port, token = _free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "PYTHONPATH"))}
    # The user's Jupyter config and runtime files stay out of it: a scratch folder for both.
    env |= {"JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    args = f"--no-browser --ServerApp.token={token} --ServerApp.open_browser=False"
    log = (tmp_path / "lab.log").open("w")
    proc = subprocess.Popen(["make", "--no-print-directory", "lab", f"LAB_PORT={port}", f"LAB_ARGS={args}"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        status, body = 0, b""
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status, body = _get(f"{base}/api/contents/01_benchmarking.ipynb?token={token}")
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                status = 0
            if status == 200:
                break
            time.sleep(1)
        logged = (tmp_path / "lab.log").read_text()[-3000:]
        assert proc.poll() is None, f"make lab exited with {proc.returncode}:\n{logged}"
        assert status == 200, f"no notebook at {base} within {START_S} s (last status {status}):\n{logged}"
        notebook = json.loads(body)
        assert notebook["type"] == "notebook" and notebook["content"]["cells"], notebook.get("name")
        assert _get(f"{base}/api/contents/01_benchmarking.ipynb")[0] in (401, 403), "the token must be required"
        status, body = _get(f"{base}/api/kernelspecs?token={token}")
        specs = json.loads(body)
        kernel = specs["kernelspecs"][specs["default"]]["spec"]
        assert Path(kernel["argv"][0]).resolve() == (ROOT / ".venv" / "bin" / "python").resolve(), kernel["argv"]
        assert notebook["content"]["metadata"]["kernelspec"]["name"] == specs["default"]
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGTERM)  # make, JupyterLab and any kernel: the group this test started
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        log.close()
    assert not _group_alive(proc.pid), "a process of `make lab` outlived the test"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the test's own closed connections linger
        s.bind(("127.0.0.1", port))  # no server listens there any more
        s.listen()
