"""The dev container and the clean-machine test (``make test-clean-machine``), checked without running either: the
Dockerfile and .devcontainer/devcontainer.json run the kit's one set-up script, the clean-machine test runs that same
script and then the README's Quick start commands (read from the README), pip's sources go in read-only, and a
Python older than 3.11 gets a message that says what to install. Nothing here builds a root file system or an image:
``make test-clean-machine`` does the first (minutes, root); the second needs a container engine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from instructor import clean_machine, release
from kit.setup import bootstrap, python_check

ROOT = Path(__file__).resolve().parents[2]


def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))


def _devcontainer() -> dict:
    """devcontainer.json is JSON with comments (JSONC); this one keeps its comments on lines of their own."""
    text = (ROOT / ".devcontainer" / "devcontainer.json").read_text()
    return json.loads("\n".join(line for line in text.splitlines() if not line.lstrip().startswith("//")))


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def test_the_clean_machine_runs_the_set_up_then_the_readme_quick_start():
    commands = clean_machine.readme_commands()
    assert len(commands) == 2, f"the README's Quick start lists {commands}: the issue promises two commands"
    for command in commands:
        words = command.split()
        assert words[0] == "make" and words[1] in _makefile_targets(), f"{command!r} is no Makefile target"
    assert clean_machine.SETUP == "make setup" and "setup" in _makefile_targets()
    assert clean_machine.steps() == [("set-up", "make setup")] + [(f"README: {c}", c) for c in commands]
    assert [cmd for _, cmd in clean_machine.steps("1")[1:]] == [f"{c} STAGE=1" for c in commands]


def test_readme_commands_read_the_first_bash_block_of_quick_start(tmp_path: Path):
    readme = tmp_path / "README.md"
    readme.write_text("# Kit\n\n```bash\nmake nope\n```\n\n## Quick start\n\ntext\n\n```bash\nmake a    # one\n\n"
                      "make b\n```\n\n```bash\nmake c\n```\n")
    assert clean_machine.readme_commands(readme) == ["make a", "make b"]
    readme.write_text("# Kit\n\nno quick start\n")
    with pytest.raises(ValueError, match="Quick start"):
        clean_machine.readme_commands(readme)


def test_the_dockerfile_is_thin_and_runs_the_same_set_up_script():
    instructions = _dockerfile_instructions()
    base = [arg for op, arg in instructions if op == "FROM"]
    assert base == ["python:3.11-slim-bookworm"], base  # multi-arch (amd64, arm64); the kit's minimum Python
    runs = [arg for op, arg in instructions if op == "RUN"]
    assert any(re.search(rf"(^|\s){clean_machine.SETUP}$", run) for run in runs), runs
    assert not any("pip install" in run or "kit.setup.bootstrap" in run for run in runs), (
        "the image installs through `make setup` only, the script the clean-machine test runs")
    copied = [arg for op, arg in instructions if op == "COPY"]
    assert copied == [". ."], copied
    assert any(op == "ARG" and arg.startswith("TORCH_INDEX=") and bootstrap.TORCH_CPU_INDEX in arg
               for op, arg in instructions), "the CPU index named up front is bootstrap's own retry index"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored, "a host's .venv must not reach the image: it makes its own"


def test_the_devcontainer_builds_the_dockerfile_and_runs_the_same_set_up_script():
    config = _devcontainer()
    assert config["build"] == {"dockerfile": "../Dockerfile", "context": ".."}
    assert config["postCreateCommand"] == clean_machine.SETUP
    workdir = [arg for op, arg in _dockerfile_instructions() if op == "WORKDIR"]
    assert workdir == [config["workspaceFolder"]], "the image's .venv is at the folder the container opens"
    assert any("target=${containerWorkspaceFolder}/.venv" in m and "type=volume" in m for m in config["mounts"])
    assert "--shm-size=2g" in config["runArgs"]


def test_the_release_ships_the_dev_container(tmp_path: Path):
    for name in ("Dockerfile", "README.md", ".gitignore", ".dockerignore"):
        (tmp_path / name).write_text("x\n")
    for folder in (".devcontainer", ".ci", "kit"):
        (tmp_path / folder).mkdir()
    parts = release.release_parts(tmp_path)  # not a git checkout: every entry at the top, hidden ones filtered
    assert {"Dockerfile", ".devcontainer", ".dockerignore", ".gitignore", "kit"} <= set(parts)
    assert ".ci" not in parts


def test_the_readme_points_macos_and_windows_at_the_dev_container():
    readme = (ROOT / "README.md").read_text()
    first_screen = readme[: readme.index("## Student workflow")]
    assert "On macOS or Windows" in first_screen and "Reopen in Container" in first_screen
    assert "docker build -t llmsys ." in first_screen and "WSL2" in first_screen


def test_pip_sources_bind_configs_and_the_local_folders_they_name(tmp_path: Path):
    wheels, index = tmp_path / "wheels", tmp_path / "pypi" / "simple"
    wheels.mkdir()
    index.mkdir(parents=True)
    (tmp_path / "pypi" / "files").mkdir()
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nfind-links = {wheels}\nextra-index-url = file://{index} https://example.invalid/x\n"
                    f"constraint = {tmp_path / 'absent.txt'}\n")
    env = {"PIP_CONFIG_FILE": str(conf), "PIP_FIND_LINKS": str(wheels / "sub"), "XDG_CONFIG_DIRS": str(tmp_path),
           "PIP_DEFAULT_TIMEOUT": "9", "HOME": str(tmp_path)}
    (wheels / "sub").mkdir()
    sources = clean_machine.pip_sources(env, home=tmp_path / "nohome")
    assert conf in sources.files
    # The index's parent (its pages link to ../../files/…); wheels/sub is inside wheels; the absent file is left out.
    assert set(sources.binds) >= {conf, wheels, tmp_path / "pypi"}
    assert wheels / "sub" not in sources.binds and index not in sources.binds
    assert sources.env == {"PIP_CONFIG_FILE": str(conf), "PIP_FIND_LINKS": str(wheels / "sub"),
                           "PIP_DEFAULT_TIMEOUT": "9"}
    assert clean_machine.guest_env(sources, env)["HOME"] == "/root", "only GUEST_ENV and PIP_* go in"


def test_the_chroot_command_binds_read_only_and_passes_only_its_environment():
    cmd = clean_machine.chroot_command(Path("/r"), "make setup", [Path("/opt/wheels")], {"PIP_X": "1"})
    assert cmd[:5] == ["unshare", "--mount", "--pid", "--fork", "--kill-child"]
    script = cmd[-1]
    assert "mount --bind /opt/wheels /r/opt/wheels && mount -o remount,bind,ro /r/opt/wheels" in script
    assert "mount -t proc proc /r/proc" in script and "tmpfs /r/dev/shm" in script
    assert "exec chroot /r /usr/bin/env -i PIP_X=1 /bin/bash -c" in script and "make setup" in script


def test_a_too_old_python_is_told_what_to_install():
    text = python_check.message((3, 9, 2), "/usr/bin/python3", venv=None)
    assert clean_machine.TOO_OLD_MARK in text and "Python 3.9.2" in text
    assert "make setup PYTHON=python3.11" in text and "dev container" in text
    assert python_check.too_old((3, 9, 2)) and not python_check.too_old((3, 11, 0))
    assert "rm -rf /x/.venv" in python_check.message((3, 10, 0), "/x/.venv/bin/python", venv="/x/.venv")
    setup_recipe = (ROOT / "Makefile").read_text().split("$(STAMP): ")[1].split("\n\n")[0]
    assert setup_recipe.index("-m kit.setup.python_check") < setup_recipe.index("-m venv"), (
        "make setup checks the Python before it makes .venv with it")
    proc = subprocess.run([sys.executable, "-m", "kit.setup.python_check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == ""


def test_bootstrap_stops_on_a_too_old_python_before_anything_else(monkeypatch, capsys):
    monkeypatch.setattr(python_check, "too_old", lambda *a: True)
    assert bootstrap.main([]) == 1
    assert clean_machine.TOO_OLD_MARK in capsys.readouterr().err


def test_a_too_old_suite_passes_only_when_every_step_stops_clearly():
    clear = clean_machine.Step("set-up", "make setup", status=2, tail=[f"make setup: {clean_machine.TOO_OLD_MARK}"])
    trace = clean_machine.Step("set-up", "make setup", status=1,
                               tail=["Traceback (most recent call last):", "ModuleNotFoundError: No module named 'x'"])
    assert clean_machine.verdict("bullseye", [clear, clear])[0]
    assert not clean_machine.verdict("bullseye", [clear, trace])[0]
    assert not clean_machine.verdict("bookworm", [clear])[0]
    assert clean_machine.verdict("bookworm", [clean_machine.Step("set-up", "make setup", status=0)])[0]
