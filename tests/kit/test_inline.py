"""``pytest --inline``: a ``breakpoint()`` in the implementation stops in the terminal, and the grader refuses it.

The pseudo-terminal tests stage a submission as the grader does (``kit.grading.staging``): the reference as the
student's package, with a ``breakpoint()`` put into Stage 1's ``time_fn`` (a single-process check) and into Stage
4's DDP construction (run on 3 ranks: rank 0 in the pytest process, ranks 1 and 2 in workers). pytest runs one
test in that tree under a pseudo-terminal (``pty.fork``), as a student would in theirs: the test waits for pdb's
prompt at that line, continues, and the test passes; or quits, and the run ends.
"""

from __future__ import annotations

import ast
import os
import pty
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kit.grading.staging import stage_submission

ROOT = Path(__file__).resolve().parents[2]
STOP = "    if not globals().setdefault('_STOPPED', []):\n        _STOPPED.append(1)\n        breakpoint()\n"


def _break_in(source: Path, qualname: str) -> None:
    """Put a ``breakpoint()`` (taken once per process) first in the body of function ``qualname`` of ``source``."""
    text = source.read_text()
    tree = ast.parse(text)
    scope: list = tree.body
    for part in qualname.split("."):
        node = next(n for n in scope if isinstance(n, ast.ClassDef | ast.FunctionDef) and n.name == part)
        scope = node.body
    first = node.body[0]
    lines = text.splitlines(keepends=True)
    indent = " " * first.col_offset
    stop = "".join(indent + line[4:] + "\n" for line in STOP.rstrip("\n").split("\n"))
    lines.insert(first.lineno - 1, stop)
    source.write_text("".join(lines))


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A grading tree whose ``student`` package is the reference with the two breakpoints."""
    base = tmp_path_factory.mktemp("inline")
    student = base / "submission" / "student"
    shutil.copytree(ROOT / "reference", student, ignore=shutil.ignore_patterns("__pycache__"))
    _break_in(student / "benchmarking.py", "time_fn")
    _break_in(student / "ddp.py", "DataParallelBase.__init__")
    stage_submission(base / "submission", base / "tree")
    return base / "tree"


def _under_a_terminal(cwd: Path, args: list[str], answer: str, timeout: float = 300.0) -> tuple[str, str, int]:
    """Run ``python -m pytest ARGS`` in ``cwd`` under a pseudo-terminal; at pdb's first prompt, type ``answer``.
    Returns the output up to that prompt, all of it, and the exit status."""
    env = {**os.environ, "LLMSYS_IMPL": "student", "PYTHONDONTWRITEBYTECODE": "1", "TERM": "dumb"}
    env.pop("PYTEST_ADDOPTS", None)
    pid, fd = pty.fork()
    if pid == 0:  # the child: pytest, its terminal the pseudo-terminal
        os.chdir(cwd)
        os.execve(sys.executable, [sys.executable, "-m", "pytest", *args], env)
    output, at_prompt = b"", None
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            output += chunk
            if at_prompt is None and b"(Pdb)" in output:
                at_prompt = output.decode(errors="replace")
                os.write(fd, answer.encode())
        else:
            os.kill(pid, 9)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return at_prompt or "", output.decode(errors="replace"), os.waitstatus_to_exitcode(status)


def test_breakpoint_stops_in_a_single_process_check(tree) -> None:
    at_prompt, output, code = _under_a_terminal(
        tree, ["tests/test_stage1_benchmarking.py", "--inline", "-k", "test_time_fn_statistics", "-q",
               "-p", "no:cacheprovider"], "c\n")
    assert at_prompt, f"pdb never prompted:\n{output[-3000:]}"
    assert "student/benchmarking.py" in at_prompt and "time_fn()" in at_prompt, at_prompt[-2000:]
    assert code == 0 and "1 passed" in output, output[-3000:]


def test_breakpoint_stops_in_rank_zero_of_a_spawn(tree) -> None:
    at_prompt, output, code = _under_a_terminal(
        tree, ["tests/test_stage4_ddp.py", "--inline", "-k", "test_ranks_agree_after_construction", "-q",
               "-p", "no:cacheprovider"], "p dist.get_rank(), dist.get_world_size()\nc\n")
    assert at_prompt, f"pdb never prompted:\n{output[-3000:]}"
    assert "student/ddp.py" in at_prompt and "__init__()" in at_prompt, at_prompt[-2000:]
    assert "(0, 3)" in output, f"the prompt was not rank 0's of 3:\n{output[-3000:]}"
    assert code == 0 and "1 passed" in output, output[-3000:]


def test_quitting_the_debugger_in_rank_zero_ends_the_run(tree) -> None:
    # Ranks 1 and 2 wait for rank 0 in a collective: quitting must stop them too, not leave pytest waiting.
    started = time.monotonic()
    at_prompt, output, code = _under_a_terminal(
        tree, ["tests/test_stage4_ddp.py", "--inline", "-k", "test_ranks_agree_after_construction", "-q",
               "-p", "no:cacheprovider"], "q\n")
    assert at_prompt, f"pdb never prompted:\n{output[-3000:]}"
    assert code != 0 and "Quitting debugger" in output, output[-3000:]
    assert time.monotonic() - started < 200, "the run did not end when the debugger quit"


def test_the_grader_refuses_inline() -> None:
    grade = subprocess.run([sys.executable, "-m", "kit", "grade", "--inline", "--stage", "1"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert grade.returncode == 2 and "--inline is for debugging" in grade.stderr, grade.stderr
    plugin = subprocess.run([sys.executable, "-m", "pytest", "tests/test_stage1_benchmarking.py", "--inline",
                             "--grading-log", os.devnull, "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert plugin.returncode != 0 and "--inline is for debugging" in plugin.stdout + plugin.stderr, (
        plugin.stdout[-2000:] + plugin.stderr[-2000:])
