"""`make setup` (kit.setup.bootstrap): installs only what is missing, offline when nothing is, from a wheel folder
without an index, and says exactly what is missing when it cannot proceed. No test here touches .venv:
pip runs with ``--target`` into a temporary folder, on a fake requirement."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kit.setup import bootstrap

pytestmark = pytest.mark.kit

FAKE = "llmsys-fake-dep"


def versions(**present: str):
    """A ``version_of`` for :func:`bootstrap.plan` with these distributions installed (underscores as dashes)."""
    table = {k.replace("_", "-"): v for k, v in present.items()}
    return lambda name: table.get(name.lower())


GPU_IMAGE = dict(torch="2.11.0+cu130", triton="3.6.0", numpy="2.5.2", einops="0.8.1", matplotlib="3.10.0",
                 tqdm="4.67.1", pytest="8.4.0")


def test_gpu_keeps_numpy_and_treats_nvtx_and_dev_tools_as_optional():
    p = bootstrap.plan(bootstrap.requirements(), gpu=True, version_of=versions(**GPU_IMAGE))
    assert not any(r.startswith(("torch", "triton", "numpy")) for r in p.missing), p.missing
    names = {r.split(">")[0].split("<")[0].split("=")[0] for r in p.missing}
    assert names == {"nvtx", "psutil", "pytest-xdist", "nbclient", "nbformat", "ipykernel", "jupytext", "ruff",
                     "jupyterlab"}
    assert p.required_missing == []


def test_triton_and_nvtx_are_required_only_where_they_have_wheels():
    # Triton ships Linux wheels only, nvtx none for macOS (pip download --only-binary=:all: --platform
    # macosx_14_0_arm64 finds neither): elsewhere `make setup` installs everything else (README, On macOS or Windows).
    def names(platform: str) -> set[str]:
        reqs = bootstrap.requirements_for(platform)
        assert all(";" not in r for r in reqs), "markers are evaluated and dropped"
        return {bootstrap.Requirement(r).name for r in reqs}

    assert {"torch", "numpy", "psutil", "triton", "nvtx"} <= names("linux")
    assert "triton" not in names("darwin") and "nvtx" not in names("darwin")
    assert {"torch", "numpy", "psutil", "einops", "pytest"} <= names("darwin")
    assert "triton" not in names("win32") and "nvtx" in names("win32")


def test_plan_skips_a_requirement_whose_marker_does_not_hold_here():
    p = bootstrap.plan(["triton>=3.2; sys_platform == 'plan9'", "einops>=0.8"], gpu=False, version_of=versions())
    assert p.missing == ["einops>=0.8"] and p.present == []


def test_cpu_applies_the_numpy_pin_of_constraints_cpu():
    p = bootstrap.plan(bootstrap.requirements(), gpu=False, pins=bootstrap.constraints(),
                       version_of=versions(**GPU_IMAGE))
    assert "numpy" in p.missing, "numpy 2.5 breaks the CPU interpreter: constraints-cpu.txt pins numpy<2.4"
    assert any(r.startswith("torch") for r in p.missing), "a CUDA torch is not the CPU pin"


def test_numpy_pin_is_cpu_only():
    assert not any(r.replace(" ", "").startswith("numpy<") for r in bootstrap.requirements()), (
        "pyproject must not pin numpy<2.4: that pin is for the CPU interpreter (constraints-cpu.txt)")
    assert "numpy<2.4" in bootstrap.constraints()


def test_gpu_missing_torch_is_required():
    image = {k: v for k, v in GPU_IMAGE.items() if k != "torch"}
    p = bootstrap.plan(bootstrap.requirements(), gpu=True, version_of=versions(**image))
    assert [r for r in p.required_missing if r.startswith("torch")], p.required_missing


def test_too_old_counts_as_missing():
    p = bootstrap.plan(["einops>=0.8"], gpu=True, version_of=versions(einops="0.6.0"))
    assert p.missing == ["einops>=0.8"]


def test_nothing_missing_calls_no_pip(monkeypatch, capsys):
    """This machine (.venv) has everything: setup must not call pip, index disabled or not."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    calls = []
    for gpu in (False, True):
        assert bootstrap.setup(gpu=gpu, wheels=None, run=lambda cmd: calls.append(cmd) or 1) == 0
    assert calls == [], f"pip was called although nothing is missing: {calls}"
    assert "pip not called" in capsys.readouterr().out


def test_nothing_missing_end_to_end_offline():
    env = {"PIP_NO_INDEX": "1", "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "kit.setup.bootstrap", "--gpu"], cwd=bootstrap.ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pip not called" in proc.stdout and "+ " not in proc.stdout


def make_wheel(folder: Path, name: str = FAKE, version: str = "1.0") -> Path:
    """A minimal pure-Python wheel of ``name`` (one module) written by hand: no build backend needed."""
    dist, mod = name.replace("-", "_"), name.replace("-", "_")
    files = {
        f"{mod}.py": "VALUE = 42\n",
        f"{dist}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                             "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record_path = f"{dist}-{version}.dist-info/RECORD"
    files[record_path] = "\n".join(record + [f"{record_path},,"]) + "\n"
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


@pytest.fixture
def fake_requirement(monkeypatch, tmp_path):
    """pyproject lists only ``llmsys-fake-dep>=1.0`` (missing); pip installs with --target into tmp_path."""
    monkeypatch.setattr(bootstrap, "requirements", lambda: [f"{FAKE}>=1.0"])
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no network: an attempt to reach an index fails at once
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    target = tmp_path / "site"
    calls: list[list[str]] = []

    def run(cmd: list[str]) -> int:
        calls.append(cmd)
        return subprocess.call(cmd + ["--target", str(target), "--no-compile"], timeout=120)

    return run, calls, target


def test_missing_package_installs_from_the_wheel_folder(fake_requirement, tmp_path):
    run, calls, target = fake_requirement
    wheels = tmp_path / "wheelhouse"
    wheels.mkdir()
    make_wheel(wheels)
    assert bootstrap.setup(gpu=True, wheels=wheels, run=run, version_of=lambda name: None) == 0
    assert len(calls) == 1 and "--no-index" in calls[0] and str(wheels) in calls[0]
    assert (target / "llmsys_fake_dep.py").exists(), "the wheel was not installed"


def test_missing_package_without_wheels_says_what_and_how(fake_requirement, capsys):
    run, calls, _ = fake_requirement
    assert bootstrap.setup(gpu=True, wheels=None, run=run, version_of=lambda name: None) == 1
    out = capsys.readouterr().out
    assert f"- {FAKE}>=1.0" in out, out
    assert "make wheelhouse" in out and "WHEELS=wheelhouse" in out and "make setup GPU=1" in out, out


def test_wheels_folder_that_does_not_exist(fake_requirement, tmp_path, capsys):
    run, calls, _ = fake_requirement
    assert bootstrap.setup(gpu=True, wheels=tmp_path / "nope", run=run, version_of=lambda name: None) == 2
    assert calls == [] and FAKE in capsys.readouterr().out


def test_only_optional_missing_on_gpu_is_not_fatal(monkeypatch, capsys):
    monkeypatch.setattr(bootstrap, "requirements", lambda: ["nvtx>=0.2.10", "einops>=0.8"])
    rc = bootstrap.setup(gpu=True, wheels=None, run=lambda cmd: 1, version_of=versions(einops="0.8.1"))
    out = capsys.readouterr().out
    assert rc == 0 and "torch.cuda.nvtx" in out and "nvtx>=0.2.10" in out


def test_download_command_targets_the_gpu_machine(tmp_path):
    cmd = bootstrap.download_command(tmp_path, python_version="3.12")
    assert cmd[cmd.index("download") - 1] == "pip" and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "manylinux_2_17_x86_64" in cmd
    assert any(c.startswith("nvtx") for c in cmd) and any(c.startswith("pytest") for c in cmd)
    assert not any(c.startswith(("torch", "triton", "numpy")) for c in cmd), "the CUDA image brings those"
    assert not any(c.startswith("jupyterlab") for c in cmd), "the GPU machine runs notebooks headless: no lab"
    assert any(r.startswith("jupyterlab") for r in bootstrap.requirements()), "a CPU setup installs JupyterLab"


def test_prune_wheelhouse_drops_what_the_cuda_machine_keeps(tmp_path):
    for name in ("numpy-2.5.5-cp312-cp312-manylinux_2_28_x86_64.whl", "torch-2.11.0-cp312-none-any.whl",
                 "nvtx-0.2.17-cp312-cp312-manylinux2014_x86_64.whl", "tqdm-4.67.1-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    dropped = bootstrap.prune_wheelhouse(tmp_path)
    assert sorted(w.name.split("-")[0] for w in dropped) == ["numpy", "torch"]
    assert sorted(w.name.split("-")[0] for w in tmp_path.glob("*.whl")) == ["nvtx", "tqdm"]


def test_gpu_venv_over_a_venv_with_everything_needs_no_pip(tmp_path):
    """`make setup GPU=1` end to end, index disabled: a --system-site-packages venv made by an interpreter
    that is itself a venv (this .venv, like a GPU image's /opt/torch/.venv) sees its packages through
    --link-site, and bootstrap --gpu then finds nothing missing and calls no pip."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)
    env = {"PIP_NO_INDEX": "1", "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PATH": "/usr/bin:/bin"}
    link = subprocess.run([sys.executable, "-m", "kit.setup.bootstrap", "--link-site", str(venv)], cwd=bootstrap.ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert link.returncode == 0, link.stderr
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "kit.setup.bootstrap", "--gpu"], cwd=bootstrap.ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pip not called" in proc.stdout and "\n+ " not in proc.stdout, proc.stdout
    assert "torch" in proc.stdout.split("present:")[1]


def test_gpu_install_pins_the_cuda_machines_torch_triton_numpy(monkeypatch):
    monkeypatch.setattr(bootstrap, "requirements", lambda: ["einops>=0.8"])
    seen = []

    def run(cmd):
        seen.append((cmd, Path(cmd[cmd.index("-c") + 1]).read_text()))
        return 0

    assert bootstrap.setup(gpu=True, wheels=None, run=run, version_of=versions(**{**GPU_IMAGE, "einops": None})) == 0
    cmd, pins = seen[0]
    assert pins.split() == ["torch==2.11.0+cu130", "triton==3.6.0", "numpy==2.5.2"], pins
    assert str(bootstrap.CONSTRAINTS) not in cmd and cmd[-1] == "einops>=0.8"


def test_linux_cpu_install_retries_torch_from_pytorchs_cpu_index(monkeypatch, capsys):
    """PyPI's Linux torch 2.13.0 is the CUDA build and needs triton 3.7.1 (the kit pins 3.6.0), so a laptop that sees
    only PyPI fails the first resolve; the retry adds PyTorch's CPU index. The index is never tried first."""
    monkeypatch.setattr(bootstrap, "requirements", lambda: ["torch==2.13.0", "einops>=0.8"])
    monkeypatch.setattr(bootstrap.sys, "platform", "linux")
    seen: list[list[str]] = []

    def run(cmd):
        seen.append(cmd)
        return 1 if len(seen) == 1 else 0

    assert bootstrap.setup(gpu=False, wheels=None, run=run, version_of=lambda name: None) == 0
    assert len(seen) == 2 and bootstrap.TORCH_CPU_INDEX not in seen[0]
    assert seen[1][seen[1].index("--extra-index-url") + 1] == bootstrap.TORCH_CPU_INDEX
    assert "CPU wheels" in capsys.readouterr().out


@pytest.mark.parametrize(("missing", "gpu", "wheels", "platform"), [
    (["einops>=0.8"], False, None, "linux"),             # torch is not what failed
    (["torch==2.13.0"], True, None, "linux"),            # a CUDA machine keeps its own torch
    (["torch==2.13.0"], False, Path("w"), "linux"),      # a wheel folder means no index at all
    (["torch==2.13.0"], False, None, "darwin"),          # PyPI's macOS torch is the CPU build
])
def test_no_cpu_index_retry_where_it_cannot_help(missing, gpu, wheels, platform):
    assert not bootstrap.needs_torch_cpu_index(missing, gpu=gpu, wheels=wheels, platform=platform)


def test_download_can_skip_what_the_target_has(tmp_path):
    cmd = bootstrap.download_command(tmp_path, python_version="3.12", skip=("matplotlib", "Ruff"))
    assert not any(c.startswith(("matplotlib", "ruff")) for c in cmd) and any(c.startswith("nvtx") for c in cmd)
