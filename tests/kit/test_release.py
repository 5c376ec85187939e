"""Student generation and the student release: fresh stubs, no solution text shipped, a working release."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from instructor import release

ROOT = Path(__file__).resolve().parents[2]


def test_student_package_is_up_to_date():
    stale = release.stale_student_files()
    assert not stale, f"student/ is stale in {stale}: run `make student` (never edit student/ by hand)"


def test_strip_solutions_keeps_given_code_and_names_the_function():
    source = '''import torch

def f(x):
    """Docstring stays."""
    y = x + 1  # given
    # BEGIN SOLUTION double it (handout 09 §1)
    return 2 * y
    # END SOLUTION


class C:
    def g(self):
        # BEGIN SOLUTION say "hi"
        return "hi"
        # END SOLUTION
'''
    out, blocks = release.strip_solutions(source)
    assert "import torch" in out and '"""Docstring stays."""' in out and "y = x + 1  # given" in out
    assert "return 2 * y" not in out and 'return "hi"' not in out
    assert '    raise NotImplementedError("f: double it (handout 09 §1)")' in out
    assert '        raise NotImplementedError("C.g: say \\"hi\\"")' in out
    assert [b.function for b in blocks] == ["f", "C.g"]
    compile(out, "<stub>", "exec")


@pytest.mark.parametrize("source, message", [
    ("def f():\n    # BEGIN SOLUTION x\n    pass\n", "never closed"),
    ("def f():\n    # END SOLUTION\n", "without a matching"),
    ("def f():\n    # BEGIN SOLUTION\n    pass\n    # END SOLUTION\n", "needs a hint"),
    ("# BEGIN SOLUTION x\nx = 1\n# END SOLUTION\n", "inside a function"),
    ("def f():\n    # BEGIN SOLUTION a\n    # BEGIN SOLUTION b\n    # END SOLUTION\n", "nested"),
])
def test_malformed_markers_are_reported_with_their_line(source, message):
    with pytest.raises(release.MarkerError, match=message):
        release.strip_solutions(source, "reference/x.py")


def test_every_reference_module_has_solution_blocks():
    blocks = release.solution_blocks()
    modules = {b.path.parts[1] for b in blocks}
    assert "benchmarking.py" in modules
    assert all(b.text.strip() for b in blocks), "empty solution block"


@pytest.fixture(scope="module")
def built_release(tmp_path_factory) -> Path:
    """The student release, with the kit's virtualenv linked in as ``make setup`` would have made it."""
    out = release.build_release(tmp_path_factory.mktemp("rel") / "student-release")
    (out / ".venv").symlink_to(ROOT / ".venv")
    # The copies are older than the venv's setup stamp, so `make` does not re-run the installer.
    for name in ("pyproject.toml", "constraints-cpu.txt"):
        os.utime(out / name, (946684800, 946684800))
    return out


def _student_env(release_root: Path) -> dict[str, str]:
    """A student's shell in the release: the virtualenv activated, no instructor settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("LLMSYS_IMPL", "PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{release_root / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def _code_lines(text: str) -> list[str]:
    lines = (ln.strip() for ln in text.splitlines())
    return [ln for ln in lines if ln and not ln.startswith("#")]


def test_release_contains_no_solution_text(built_release: Path):
    """No whole solution block appears in any shipped file, nor a run of 3 solution lines outside the tests.

    Single lines are not checked: a one-line spec such as ``ctx.save_for_backward(q, k, v, o, L)`` or a
    generic ``on_cuda = torch.cuda.is_available()`` may rightly appear in a handout or a benchmark.
    """
    assert not (built_release / "reference").exists()
    assert not (built_release / "tests" / "hidden").exists()
    assert (built_release / "student" / "benchmarking.py").exists()
    shipped = {p: "\n".join(_code_lines(p.read_text(errors="ignore"))) for p in built_release.rglob("*")
               if p.is_file() and p.suffix in (".py", ".md", ".ipynb", ".txt", ".toml", ".sh", "")}
    # Given code ships by design: the kit, and reference code outside the markers.
    given = "\n".join(
        ["\n".join(_code_lines(release.strip_solutions(p.read_text())[0])) for p in (ROOT / "reference").rglob("*.py")]
        + ["\n".join(_code_lines(p.read_text())) for p in (ROOT / "kit").rglob("*.py")]
    )
    leaks = []
    for block in release.solution_blocks():
        lines = _code_lines(block.text)
        whole = "\n".join(lines)
        windows = {"\n".join(lines[i:i + 3]) for i in range(len(lines) - 2)}
        windows = {w for w in windows if len(w) >= 60 and w not in given}
        for path, text in shipped.items():
            if whole and whole in text:
                leaks.append(f"{path}: the whole solution of {block.function}")
            # Public tests hold independent references (a float64 attention, a plain training loop) that
            # may resemble a solution line for line; everything else must not.
            if "tests" not in path.relative_to(built_release).parts:
                leaks += [f"{path}: {w!r} from {block.function}" for w in windows if w in text]
    assert not leaks, "solution text leaked into the release:\n" + "\n".join(leaks[:20])


def test_release_contains_no_answer_key(built_release: Path):
    """The instructor's answer key never ships: not its templates or its renderer (instructor/), not a rendered
    key, and no line of a key's text in any shipped file."""
    assert (ROOT / "instructor" / "answers").is_dir(), "the answer key is missing from the instructor's kit"
    for path in ("instructor", "answers-output", "reference", "tests/hidden", "tests/kit", "CONTRIBUTING.md",
                 "INSTRUCTOR.md"):
        assert not (built_release / path).exists(), f"the student release contains {path}"
    handouts = "\n".join(p.read_text() for p in (ROOT / "handout").glob("*.md"))
    key_lines = {ln.strip() for p in (ROOT / "instructor" / "answers").glob("*") if p.is_file()
                 for ln in p.read_text().splitlines() if len(ln.strip()) >= 60}
    key_lines = {ln for ln in key_lines if ln not in handouts}  # a key may quote its problem's wording
    shipped = {p: p.read_text(errors="ignore") for p in built_release.rglob("*")
               if p.is_file() and p.suffix in (".py", ".md", ".ipynb", ".txt", ".toml", ".sh", "")}
    leaks = [f"{p.relative_to(built_release)}: {ln[:80]!r}" for p, text in shipped.items() for ln in key_lines
             if ln in text]
    assert not leaks, "answer-key text leaked into the release:\n" + "\n".join(leaks[:20])


def test_every_command_the_release_lists_works_there(built_release: Path, tmp_path: Path):
    """`python -m kit --help` in the release lists only what works there; each one is typed here."""
    env = _student_env(built_release)

    def kit(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kit", *args], cwd=built_release, env=env, capture_output=True,
                              text=True, timeout=timeout)

    listed = kit("--help")
    commands = re.search(r"\{([a-z,-]+)\}", listed.stdout).group(1).split(",")
    assert set(commands) == {"grade", "autograde", "check-handout", "stages", "doctor", "nsys-summary",
                             "leaderboard"}, commands
    nvtx = tmp_path / "nvtx.csv"
    nvtx.write_text("Time (%),Total Time (ns),Instances,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Style,Range\n"
                    "100.0,1000,1,1000.0,1000.0,1000,1000,0.0,PushPop,forward\n")
    runs = {
        "grade": ["grade", "--stage", "1"],
        "autograde": ["autograde", "--submission", str(built_release), "--results", str(tmp_path / "r.json"),
                      "--stage", "1"],
        "check-handout": ["check-handout"], "stages": ["stages"], "doctor": ["doctor"],
        "nsys-summary": ["nsys-summary", str(nvtx)],
        # The naive step needs no student code: the gate and one timed step of the cpu task, an entry written.
        "leaderboard": ["leaderboard", "--task", "cpu", "--step", "naive", "--warmup", "0", "--steps", "1",
                        "--out", str(tmp_path / "entries")],
    }
    for name in commands:
        proc = kit(*runs[name])
        assert proc.returncode == 0, f"`python -m kit {' '.join(runs[name])}` in the release:\n{proc.stdout[-2000:]}" \
                                     f"{proc.stderr[-2000:]}"
    for gone in ("release", "mutants", "answers", "autograder"):
        assert kit(gone).returncode == 2, f"`python -m kit {gone}` should be an unknown command in the release"
    assert json.loads((tmp_path / "r.json").read_text())["score"] == 0, "the autograder grades the stubs as 0"


def test_release_links_resolve(built_release: Path):
    """Every relative link in every markdown file the release ships (README, handout, benchmark tables, …) points at a
    file the release has; the instructor's guide is not shipped, and README's pointer to it is dropped, not left
    dangling (``release.INSTRUCTOR_ONLY_LINE``)."""
    assert (ROOT / "INSTRUCTOR.md").is_file(), "the instructor's guide is missing from the instructor's kit"
    assert not (built_release / "INSTRUCTOR.md").exists(), "the student release contains INSTRUCTOR.md"
    assert "INSTRUCTOR.md" in (ROOT / "README.md").read_text(), "README.md should point instructors to INSTRUCTOR.md"
    readme = (built_release / "README.md").read_text()
    assert "INSTRUCTOR.md" not in readme and release.INSTRUCTOR_ONLY_LINE not in readme, (
        "the release's README still names INSTRUCTOR.md, which it does not ship")
    pages = sorted(p for p in built_release.rglob("*.md") if ".venv" not in p.relative_to(built_release).parts)
    assert built_release / "README.md" in pages and any(p.parent.name == "handout" for p in pages)
    broken = []
    for page in pages:
        # Code (fenced blocks and `spans`) is not prose: `kernel[grid](...)` is a call, not a link.
        prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", page.read_text(), flags=re.S))
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", prose):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(built_release)} → {target}")
    assert not broken, "links to files the release does not have:\n" + "\n".join(broken)


def test_release_test_command_grades_the_stubs_as_zero(built_release: Path):
    proc = subprocess.run(["make", "test", "STAGE=1"], cwd=built_release, env=_student_env(built_release),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"`make test` failed in the release:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    results = json.loads((built_release / "grading-output" / "results.json").read_text())
    assert results["max_score"] > 0 and results["score"] == 0, proc.stdout[-3000:]
    assert "| Total |" in proc.stdout, "the score table is missing"
    assert "implement time_fn" in proc.stdout, "the score table should say what to implement first"


def test_release_help_lists_student_targets_only(built_release: Path):
    proc = subprocess.run(["make", "help"], cwd=built_release, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    targets = {line.split()[1] for line in proc.stdout.splitlines() if line.strip().startswith("make ")}
    assert {"grade", "test", "setup", "lint", "doctor"} <= targets, proc.stdout
    instructor = {"student", "check-student", "release", "autograder", "soak", "test-reference", "test-kit", "answers",
                  "mutants", "timings", "gpu-check", "new-stage", "check-kernels"}
    assert not targets & instructor, f"`make help` in the release lists instructor targets: {targets & instructor}"
    assert "everything CI checks" not in proc.stdout and "grade student/" in proc.stdout


# ------------------------------------------------------------------------------ the documented commands, literally

# Commands a student is told to type: the README's "Student workflow" and each chapter's test commands.
DOC_COMMAND = re.compile(r"^(?:\.venv/bin/)?pytest\b|^python -m pytest\b|^make (?:grade|test)\b")


def _documented_commands() -> list[tuple[str, str]]:
    """``(where, command)`` for every test command in a bash block of the README's student workflow or of a
    handout chapter, as written (a trailing ``# or: <command>`` offers a second one)."""
    readme = (ROOT / "README.md").read_text()
    workflow = readme.split("## Student workflow", 1)[1].split("\n## ", 1)[0]
    sources = [("README.md (Student workflow)", workflow)]
    sources += [(f"handout/{p.name}", p.read_text()) for p in sorted((ROOT / "handout").glob("*.md"))]
    commands: list[tuple[str, str]] = []
    seen: set[str] = set()
    for where, text in sources:
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S):
            for line in block.splitlines():
                command, _, comment = line.strip().partition("#")
                alternative = comment.strip().removeprefix("or:").strip() if comment.strip().startswith("or:") else ""
                for c in (command.strip(), alternative):
                    # `pytest …` in an activated virtualenv is `.venv/bin/pytest …`: run each command once.
                    if DOC_COMMAND.match(c) and c.removeprefix(".venv/bin/") not in seen:
                        seen.add(c.removeprefix(".venv/bin/"))
                        commands.append((where, c))
    return commands


def test_documented_commands_are_found():
    commands = [c for _, c in _documented_commands()]
    assert ".venv/bin/pytest -m stage1" in commands and "make grade STAGE=1" in commands, commands
    assert any(c.startswith(".venv/bin/pytest -m stage3") for c in commands), commands


def test_handout_test_commands_work_without_an_active_venv():
    """A handout's `pytest …` in a shell whose virtualenv is not active finds another pytest, or none, and fails
    with `No module named 'torch'`: every test command in a code block names the kit's .venv."""
    plain = [f"{where}: {c}" for where, c in _documented_commands()
             if where.startswith("handout/") and not c.startswith((".venv/bin/", "make "))]
    assert not plain, "handout commands that need an activated venv:\n" + "\n".join(plain)


@pytest.mark.parametrize("where, command", _documented_commands(), ids=lambda x: x)
def test_documented_command_runs_as_written_in_the_release(built_release: Path, where: str, command: str):
    """Typed in the release, each documented command runs the stage's tests: they fail on the stubs with the stubs'
    NotImplementedError, never with a usage or import error. The shell has no virtualenv active, as a student's
    fresh terminal: the commands must name .venv themselves (or go through make)."""
    env = _student_env(built_release)
    env["PATH"] = env["PATH"].split(os.pathsep, 1)[1]  # _student_env put .venv/bin first: a fresh shell has not
    proc = subprocess.run(command, shell=True, cwd=built_release, env=env, capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout + proc.stderr
    where_and_what = f"`{command}` from {where} (exit {proc.returncode}):\n{out[-3000:]}"
    assert "Error importing plugin" not in out and "No module named" not in out, where_and_what
    if command.startswith("make"):
        assert proc.returncode == 0 and "| Total |" in out and "implement " in out, where_and_what
    else:
        assert proc.returncode == 1, where_and_what  # 1: tests ran and failed; 2–5: interrupted, usage, no tests
        assert "NotImplementedError" in out and re.search(r"\d+ failed", out), where_and_what
