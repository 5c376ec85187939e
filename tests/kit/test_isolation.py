"""Runs graded side by side cannot reach each other: a daemon one submission leaves on loopback does not cost a
correct co-submission (or the reference ranks that grade it) a point, and does not outlive its own grade.

The hijacker below is what a submission can start at import: a daemon (double fork, new session) that watches the
machine's TCP listeners on loopback (``/proc/net/tcp``) and connects to every new one, writing sequence numbers —
on the last commit without network namespaces, a gloo rank of a co-submission graded at the same time read them
as its peers' messages (17/27 and 24/27 for a correct submission that scores 27/27 alone). Each zygote now has a
network namespace of its own (:mod:`kit.spawn.contain`), so the daemon sees only its own run's listeners, and
its run's cgroup kills it when the grade ends. The batch is built at test time from ``reference/`` (the correct
co-submission) and ``student/`` (the hijacker's stubs), so no copy of either is committed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kit.grading import batch, running
from kit.spawn.contain import network_support

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "76543210"  # in the daemon's command line: how this test finds it afterwards

HIJACKER = f'''
# A loopback hijacker (tests/kit/test_isolation.py). Once per run; loopback only; ends by itself after 300 s.
import os as _os
import sys as _sys

_DAEMON = """# {TOKEN}
import socket, time
seen, connections, start = set(), [], time.monotonic()
while time.monotonic() < start + 40:  # hijacks for 40 s (the co-submission's tests), then only lingers
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            port = int(fields[1].rsplit(":", 1)[1], 16)
            if fields[3] == "0A" and port not in seen and len(connections) < 4000:  # a new listener
                seen.add(port)
                # gloo's listener pairs each incoming connection with a pending pair by the sequence number it
                # sends first: claim the first 32, one connection each, before the real peers connect.
                for seq in range(32):
                    try:
                        conn = socket.create_connection(("127.0.0.1", port), timeout=0.05)
                        conn.send(seq.to_bytes(8, "little"))
                        connections.append(conn)
                    except OSError:
                        break
    time.sleep(0.002)
time.sleep(max(0.0, start + 300 - time.monotonic()))  # alive past its grade, unless the grade kills it
"""


def _start_hijacker() -> None:
    try:  # once per run: the first process that imports the package
        _os.close(_os.open(_os.path.join(_os.environ.get("TMPDIR", "/tmp"), "hijacker.lock"),
                           _os.O_CREAT | _os.O_EXCL | _os.O_WRONLY))
    except OSError:
        return
    if _os.fork() == 0:
        _os.setsid()
        if _os.fork() == 0:
            _os.execve(_sys.executable, [_sys.executable, "-c", _DAEMON], {{}})
        _os._exit(0)


_start_hijacker()
'''


def _daemons() -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if TOKEN.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def _package(source: Path, dest: Path) -> None:
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


@pytest.mark.skipif(not network_support().startswith("yes"), reason="this kernel gives the grader no network "
                    "namespace: runs share loopback (INSTRUCTOR.md, threat model; kit doctor --grader)")
def test_a_loopback_hijacker_costs_its_co_submission_nothing(tmp_path):
    submissions = tmp_path / "submissions"
    _package(ROOT / "reference", submissions / "correct" / "student")
    _package(ROOT / "student", submissions / "hijacker" / "student")
    init = submissions / "hijacker" / "student" / "__init__.py"
    init.write_text(init.read_text() + HIJACKER)
    # The hijacker also stalls its own ranks (it cannot tell them apart): a 10 s idle limit ends those tests sooner.
    # A correct rank never goes 10 s without using any CPU.
    limits = running.Limits(timeout=600, per_test_timeout=120, idle_limit=10)
    results = {r.submission: r for r in batch.grade_batch(submissions, tmp_path / "out", stages=[4], limits=limits,
                                                          jobs=2, include_hidden=True).results}
    correct, hijacker = results["correct"], results["hijacker"]
    lost = [f"{t.name}: {t.output[:300]}" for t in correct.tests if t.score < t.points]
    assert correct.score == correct.max_score > 0, "the correct co-submission lost points:\n" + "\n".join(lost)
    assert hijacker.score == 0 and hijacker.max_score == correct.max_score
    assert not _daemons(), "the hijacker's daemon outlived its grade"
    assert "killed" in hijacker.message, f"the hijacker's grade must say its daemon was killed: {hijacker.message!r}"
