"""A student's own machine (kit.setup.portable): the portable path needs nothing Linux-only, Triton's absence is a skip
that says why, and the grader refuses both the portable path and any platform but Linux.

Linux stands in for macOS here: ``LLMSYS_PORTABLE=1`` forces the portable path, ``LLMSYS_FORCE_NO_TRITON=1`` hides
Triton. The full proof (stages 1, 2, 4, 5 and 6 of the reference at full marks and the stubs at 0 on the portable
path) is `.ci/run`'s opt-in run and the measurements in the README; these are the quick checks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kit.grading import reporting, scoring
from kit.setup.portable import NEEDS_TRITON, grader_refusal, triton_missing_error

ROOT = Path(__file__).resolve().parents[2]

# Installed in every process of the probe (sitecustomize on PYTHONPATH): records what the kit's own code does that
# is Linux-only. A read of /proc by psutil on Linux is psutil's business (on macOS it asks the kernel otherwise).
AUDIT = textwrap.dedent('''
    import os, sys

    _KIT = os.path.join(os.environ["KIT_ROOT"], "kit") + os.sep
    _LOG = os.environ["KIT_AUDIT_LOG"]
    _STDLIB = os.path.dirname(os.__file__) + os.sep

    def _caller():
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith((_STDLIB, "<frozen")):
            frame = frame.f_back
        return frame.f_code.co_filename if frame is not None else ""

    def _kit_on_stack():
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(_KIT):
                return frame.f_code.co_filename
            frame = frame.f_back
        return ""

    def _hook(event, args):
        what = ""
        if event in ("open", "os.listdir", "os.scandir") and args and str(args[0]).startswith("/proc"):
            if _caller().startswith(_KIT):
                what = f"{event} {args[0]} from {_caller()}"
        elif event == "ctypes.dlsym" and len(args) > 1 and str(args[1]) in ("prctl", "syscall", "unshare"):
            what = f"ctypes {args[1]} from {_kit_on_stack()}" if _kit_on_stack() else ""
        elif event == "os.fork" and _kit_on_stack():
            what = f"os.fork from {_kit_on_stack()}"
        if what:
            with open(_LOG, "a") as f:
                f.write(f"{os.getpid()} {what}\\n")

    sys.addaudithook(_hook)
''')

PROBE = textwrap.dedent('''
    import torch
    import torch.distributed as dist


    def rank_sum() -> float:
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return t.item()


    def twice(x: torch.Tensor) -> torch.Tensor:
        return 2 * x
''')

MAIN = textwrap.dedent('''
    import torch

    from kit.checks import Worker, run_check
    from kit.spawn import parent, run_on_ranks
    from probe import rank_sum, twice

    assert run_on_ranks(rank_sum, 2, timeout=120) == [3.0, 3.0]
    assert run_check(rank_sum, 2, timeout=120) == [3.0, 3.0]
    assert torch.equal(Worker().call(twice, torch.ones(3)), 2 * torch.ones(3))
    print("confinement:", parent.confinement())
    print("kinds:", sorted(type(z).__name__ for z in parent._workers.zygotes.values()))
''')


def _probe(tmp_path: Path, portable: bool) -> tuple[subprocess.CompletedProcess, str]:
    (tmp_path / "sitecustomize.py").write_text(AUDIT)
    (tmp_path / "probe.py").write_text(PROBE)
    log = tmp_path / "audit.log"
    log.write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "KIT_ROOT": str(ROOT),
           "KIT_AUDIT_LOG": str(log), "LLMSYS_PORTABLE": "1" if portable else "0"}
    run = subprocess.run([sys.executable, "-c", MAIN], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=400)
    return run, log.read_text()


def test_portable_path_forks_nothing_and_reads_no_proc_by_hand(tmp_path) -> None:
    run, audit = _probe(tmp_path, portable=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "kinds: ['Spawner']" in run.stdout and "the portable path" in run.stdout, run.stdout
    assert audit == "", f"the portable path did Linux-only things:\n{audit}"


def test_the_audit_sees_what_the_linux_path_does(tmp_path) -> None:
    # The same probe on the grader's path: the zygote forks, prctl, /proc. Proves the audit above can see them.
    if not sys.platform.startswith("linux"):
        pytest.skip("the zygote path is Linux's")
    run, audit = _probe(tmp_path, portable=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "kinds: ['Zygote']" in run.stdout, run.stdout
    assert "os.fork" in audit and "ctypes prctl" in audit and "/proc/" in audit, audit


def test_the_grader_refuses_the_portable_path(monkeypatch) -> None:
    run = subprocess.run([sys.executable, "-m", "kit", "grade", "--stage", "1"], cwd=ROOT,
                         env={**os.environ, "LLMSYS_PORTABLE": "1"}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "LLMSYS_PORTABLE=1 is set" in run.stderr, run.stderr
    monkeypatch.setattr(sys, "platform", "darwin")
    assert "the grader runs on Linux only" in (grader_refusal() or "")


def test_triton_missing_is_recognised_only_without_triton(monkeypatch) -> None:
    monkeypatch.setenv("LLMSYS_FORCE_NO_TRITON", "1")
    for message in ("No module named 'triton'", "No module named 'triton.language'; 'triton' is not a package",
                    "import of triton halted; None in sys.modules"):
        assert triton_missing_error("ModuleNotFoundError", message), message
    assert not triton_missing_error("ModuleNotFoundError", "No module named 'tritonx'")
    assert not triton_missing_error("ValueError", "No module named 'triton'")


def test_tests_that_need_triton_are_skipped_saying_so() -> None:
    # Stage 7's AdamW needs no Triton and runs; its fused loss needs it and is skipped, with the reason; nothing errs.
    files = ["tests/test_stage7_adamw.py", "tests/test_stage7_fused_loss.py"]
    run = subprocess.run([sys.executable, "-m", "pytest", *files, "--impl", "reference", "-q", "-rs",
                          "-p", "no:cacheprovider"], cwd=ROOT,
                         env={**os.environ, "LLMSYS_FORCE_NO_TRITON": "1"}, capture_output=True, text=True,
                         timeout=600)
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert re.search(r"\d+ passed", summary) and re.search(r"\d+ skipped", summary), summary
    assert "error" not in summary and "failed" not in summary, summary
    assert "test_stage7_fused_loss.py:" in run.stdout and NEEDS_TRITON in run.stdout, run.stdout[-4000:]


def test_the_score_table_says_which_tests_need_triton() -> None:
    tests = [scoring.TestResult("tests/test_stage3_flash_attention.py::test_a", 3, 2.0, False, status="skipped"),
             scoring.TestResult("tests/test_stage3_flash_attention.py::test_b", 3, 2.0, False, status="skipped"),
             scoring.TestResult("tests/test_stage7_adamw.py::test_c", 7, 1.0, False, status="passed", score=1.0),
             scoring.TestResult("tests/test_stage7_fused_loss.py::test_d", 7, 1.0, False, status="skipped")]
    table = reporting.format_table(scoring.GradeResult("reference", tests=tests))
    assert f"Stage 3: 2 of 2 tests skipped: {NEEDS_TRITON}" in table, table
    assert f"Stage 7: 1 of 2 tests skipped: {NEEDS_TRITON}" in table, table
    assert "What to work on first" not in table, "a skipped test is not the student's to fix"
    statuses = {t["status"] for t in reporting.gradescope_json(scoring.GradeResult("reference", tests=tests))["tests"]}
    assert statuses == {"passed", "failed"}
