"""Stopping the grader stops everything it started; a stopped batch loses nothing and resumes.

The batches grade a toy stage (:mod:`toy_kit`), so a submission takes seconds. One submission hangs at
import — until the test removes a flag file — after starting a process that escapes its process group.
"""

from __future__ import annotations

import csv
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import toy_kit

from kit.grading.sandbox import MARKER_ENV, processes


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    return toy_kit.make(tmp_path_factory.mktemp("toy") / "kit")


def hanging(flag: Path) -> str:
    """The toy solution, but at import it leaves a process behind and waits as long as ``flag`` exists."""
    return toy_kit.solution().replace("from __future__ import annotations\n", f'''from __future__ import annotations

import os
import subprocess
import sys
import time

subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
while os.path.exists({str(flag)!r}):
    time.sleep(0.1)
''')


def marked(grader_pid: int) -> list[int]:
    """Live processes carrying the grading marker of this grader (``KIT_GRADING_ID=<pid>-…``)."""
    prefix = f"{MARKER_ENV}={grader_pid}-".encode()
    return [pid for pid, _, _, state, environ in processes()
            if state != "Z" and any(e.startswith(prefix) for e in environ)]


def gradebook(out: Path) -> dict[str, dict[str, str]]:
    if not (out / "gradebook.csv").exists():
        return {}
    with open(out / "gradebook.csv", newline="") as f:
        return {r["submission"]: r for r in csv.DictReader(f)}


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the grader exited ({proc.returncode}) before {what}: {proc.communicate()}")
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.2)


@pytest.mark.parametrize("sig, jobs", [(signal.SIGTERM, 1), (signal.SIGINT, 2)], ids=["SIGTERM", "SIGINT"])
def test_interrupted_batch_stops_everything_keeps_finished_rows_and_resumes(toy, tmp_path, sig, jobs):
    flag = tmp_path / "keep-hanging"
    flag.touch()
    folder, out = tmp_path / "batch", tmp_path / "grades"
    for name in ("a_ok", "b_ok", "d_ok"):
        toy_kit.submission(folder, name, toy_kit.solution())
    toy_kit.submission(folder, "c_hangs", hanging(flag))
    cmd = [sys.executable, "-m", "kit", "grade", "--batch", str(folder), "--out", str(out),
           "--stage", str(toy_kit.FIRST), "--jobs", str(jobs), "--import-timeout", "600"]
    proc = subprocess.Popen(cmd, cwd=toy, env=toy_kit.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    # With one worker, c_hangs holds it and d_ok never starts; with two, d_ok finishes beside it.
    finished = {"a_ok", "b_ok"} | ({"d_ok"} if jobs > 1 else set())
    # c_hangs is past its import check when its sandbox, pytest and the escaped sleeper all exist.
    wait_for(lambda: set(gradebook(out)) >= finished and len(marked(proc.pid)) >= 3, proc, "c_hangs hangs")

    sent = time.monotonic()
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, stdout + stderr
    assert time.monotonic() - sent < 15, "the grader must stop within a few seconds"
    assert not marked(proc.pid), "a process of the interrupted batch survived"

    book = gradebook(out)
    assert {n for n, r in book.items() if r["status"] == "ok"} == finished, book
    assert book["c_hangs"]["status"] == "interrupted" and book["c_hangs"]["score"] == "", book["c_hangs"]
    assert set(book) == finished | {"c_hangs"}
    assert not (out / "c_hangs" / "results.json").exists(), "an interrupted grading has no results.json"
    assert "run the same command again" in stderr

    flag.unlink()
    again = subprocess.run(cmd, cwd=toy, env=toy_kit.env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"skipped {len(finished)} submission(s)" in again.stdout, again.stdout
    regraded = {line.split()[0] for line in again.stdout.splitlines() if line.split()[:1] in (["c_hangs"], ["d_ok"])}
    assert regraded == {"c_hangs", "d_ok"} - finished, again.stdout
    book = gradebook(out)
    assert all(r["status"] == "ok" and r["score"] == "4" for r in book.values()), book
    if jobs == 1:  # never graded goes first, the one that took longest before (c_hangs) last
        assert (out / "d_ok" / "results.json").stat().st_mtime < (out / "c_hangs" / "results.json").stat().st_mtime


def test_a_changed_submission_is_regraded_and_force_regrades_all(toy, tmp_path):
    folder, out = tmp_path / "batch", tmp_path / "grades"
    for name in ("a", "b"):
        toy_kit.submission(folder, name, toy_kit.solution())
    cmd = ["grade", "--batch", str(folder), "--out", str(out), "--stage", str(toy_kit.FIRST)]
    first = toy_kit.run(toy, *cmd)
    assert first.returncode == 0 and "skipped" not in first.stdout, first.stdout + first.stderr
    (folder / "b" / "student" / "toy.py").write_text(toy_kit.solution().replace("return 2 * x", "return x + x + 1"))
    second = toy_kit.run(toy, *cmd)
    assert "skipped 1 submission(s)" in second.stdout and gradebook(out)["b"]["score"] == "3", second.stdout
    assert "regraded b: its files changed" in second.stdout, second.stdout
    forced = toy_kit.run(toy, *cmd, "--force")
    assert "skipped" not in forced.stdout and {ln.split()[0] for ln in forced.stdout.splitlines()[:2]} == {"a", "b"}


def test_a_changed_test_or_limit_regrades_and_says_why(tmp_path):
    """A grade stands only for the kit, tests and limits it was graded under (the resume hash covers them)."""
    kit = toy_kit.make(tmp_path / "kit")
    folder, out = tmp_path / "batch", tmp_path / "grades"
    toy_kit.submission(folder, "a", toy_kit.solution())
    cmd = ["grade", "--batch", str(folder), "--out", str(out), "--stage", str(toy_kit.FIRST)]
    assert toy_kit.run(kit, *cmd).returncode == 0
    assert "skipped 1 submission(s)" in toy_kit.run(kit, *cmd).stdout
    test_file = kit / "tests" / f"test_stage{toy_kit.FIRST}_toy.py"
    test_file.write_text(test_file.read_text().replace("== 5", "== 2 + 3"))
    changed = toy_kit.run(kit, *cmd)
    assert "skipped" not in changed.stdout, changed.stdout
    assert "regraded a: the kit, the tests or their recorded timings changed" in changed.stdout, changed.stdout
    stricter = toy_kit.run(kit, *cmd, "--idle-limit", "7")
    assert "regraded a: the grading limits changed" in stricter.stdout, stricter.stdout


def test_a_killed_grader_leaves_no_process_behind(toy, tmp_path):
    """SIGKILL cannot be caught: the sandbox's watchdog sees its grader gone and kills the run."""
    flag = tmp_path / "keep-hanging"
    flag.touch()
    sub = toy_kit.submission(tmp_path, "c_hangs", hanging(flag))
    proc = subprocess.Popen([sys.executable, "-m", "kit", "grade", "--impl", str(sub), "--stage", str(toy_kit.FIRST),
                             "--import-timeout", "600"], cwd=toy, env=toy_kit.env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for(lambda: len(marked(proc.pid)) >= 3, proc, "the submission hangs")
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while marked(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not marked(proc.pid), "processes of a SIGKILLed grader survived it"
