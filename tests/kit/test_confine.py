"""A grading worker is confined: it reads what the tests need, writes only its scratch, cannot touch the judge."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kit.checks import Worker
from kit.grading.plugin import worker_rules
from kit.spawn import parent
from kit.spawn.confine import landlock_abi

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(landlock_abi() < 1, reason="this kernel has no Landlock: workers run unconfined "
                                                          "here (INSTRUCTOR.md, threat model)")


def _try(what: str, action) -> str:
    try:
        action()
    except OSError as exc:
        return f"{what}: {type(exc).__name__}"
    return f"{what}: allowed"


def _probe(root: str, judge: int, log: str) -> list[str]:
    root_path = Path(root)
    return [
        _try("read kit", lambda: (root_path / "kit" / "checks.py").read_text()),
        _try("read student", lambda: (root_path / "student" / "__init__.py").read_text()),
        _try("read a public test", lambda: (root_path / "tests" / "conftest.py").read_text()),
        _try("read reference", lambda: (root_path / "reference" / "ddp.py").read_text()),
        _try("read a hidden test", lambda: next((root_path / "tests" / "hidden").glob("test_*.py")).read_text()),
        _try("read the grading log", lambda: Path(log).read_text()),
        _try("read home", lambda: os.listdir(os.path.expanduser("~root"))),
        _try("write kit", lambda: (root_path / "kit" / "forged.py").write_text("x = 1\n")),
        _try("write tests", lambda: (root_path / "tests" / "timings.json").open("a").close()),
        _try("write scratch", lambda: Path(os.environ["TMPDIR"], "mine.txt").write_text("fine")),
        _try("signal the judge", lambda: os.kill(judge, 0)),
        _try("read the judge's memory", lambda: open(f"/proc/{judge}/mem", "rb").read(1)),
    ]


@pytest.fixture
def confined():
    rules = worker_rules(ROOT, "student")
    rules.read.append(__file__)  # this test's own probe (tests/kit is out of a grading worker's reach)
    parent.confine_workers(rules)
    yield
    parent.confine_workers(None)


def test_a_grading_worker_reads_what_tests_need_and_nothing_else(confined, tmp_path) -> None:
    log = tmp_path / "events.jsonl"
    log.write_text("{}\n")
    assert parent.confinement().startswith("landlock ABI"), parent.confinement()
    seen = Worker().call(_probe, str(ROOT), os.getpid(), str(log))
    expected = [
        "read kit: allowed", "read student: allowed", "read a public test: allowed",
        "read reference: PermissionError", "read a hidden test: PermissionError",
        "read the grading log: PermissionError", "read home: PermissionError",
        "write kit: PermissionError", "write tests: PermissionError", "write scratch: allowed",
        "signal the judge: PermissionError" if landlock_abi() >= 6 else "signal the judge: allowed",
        "read the judge's memory: PermissionError",
    ]
    assert seen == expected
    assert not (ROOT / "kit" / "forged.py").exists()
