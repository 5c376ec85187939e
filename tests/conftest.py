"""One suite grades either implementation: ``pytest --impl reference`` or ``--impl student`` (default).

The tests never run the implementation in this process. They reach it through the ``worker`` fixture
(``worker.call(check, *args)``) or spawned ranks (``kit.checks``): a check runs in a worker process, loads
the implementation with ``kit.impl.load()`` and returns data, which the test compares with what it
computes itself. So the same files grade the student package, the reference, or a staged submission,
and no submission can reach the code that decides (``$LLMSYS_IMPL``, which the workers read, carries the
choice).

Every test in a ``test_stage*.py`` file carries one ``stageN`` marker and a ``points(n)`` marker; the
grader turns them into a score. The ``stageN`` markers are registered here from the stage registry
(:mod:`kit.stages`), and a test's marker must be the stage whose test files (``Stage.tests``) hold it.
``gpu`` tests are skipped, loudly, on machines without CUDA and are not graded. ``tests/kit`` holds the
kit's own tests (grader, release, spawn helper), never graded.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit import impl as impl_module
from kit import stages as registry

# torch is imported where it is first needed, not here: the worker zygote starts when the session does
# (kit.grading.plugin) and imports torch itself, so this process's own import of torch (1.5–2 s of one CPU),
# now in the collection of the first test file, runs beside it on the other CPU instead of before it.
if TYPE_CHECKING:
    from kit.checks import Worker

TESTS = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    for stage in registry.STAGES:
        config.addinivalue_line("markers", f"{stage.marker}: Stage {stage.number} — {stage.title}")
    choice = impl_module.selected(config.getoption("--impl"))
    # Workers, spawned ranks and notebook kernels inherit the environment, so they load the same package.
    os.environ[impl_module.ENV_VAR] = choice


@pytest.hookimpl(trylast=True)  # after the plugin's, which starts the zygote
def pytest_sessionstart(session: pytest.Session) -> None:
    import torch

    # The judge's own computations (the expected values) use one thread, as every rank does: a reference
    # trained here runs the same kernels as one trained in a rank, so "bit for bit" means what it says.
    torch.set_num_threads(1)


def pytest_report_header(config: pytest.Config) -> str:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only"
    return f"llm-systems-lab: grading impl={impl_module.selected()} · torch {torch.__version__} · {device}"


def _stage_of_file(path: Path) -> int | None:
    """The registered stage whose test files include ``path``, or None."""
    for stage in registry.STAGES:
        if path in stage.test_paths(TESTS.parent):
            return stage.number
    return None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A ``-m`` expression that names its stages (``-m stageN``, ``-m "stage1 or stage3"``, the grader's
    ``"(stage1 or stage3) and not hidden"``: ``kit.stages.selected_by``) selects tests of the files
    ``kit/stages.py`` lists for those stages only (the check below holds every marked test to its file's
    stage), so the other files are not imported at all: a quarter of the 4 s a stage's run spends collecting
    on 2 cores. Any other selection collects everything, as pytest does."""
    chosen = registry.selected_by(config.getoption("markexpr"))
    if chosen is None or any(n not in registry.numbers() for n in chosen):
        return None
    wanted = [p for n in chosen for p in registry.get(n).test_paths(TESTS.parent)]
    path = Path(collection_path).resolve()
    if path.is_dir():
        return None if any(p.is_relative_to(path) for p in wanted) else True
    return None if path in wanted or path.suffix != ".py" or not path.name.startswith("test_") else True


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """A test module that cannot even be imported without Triton, on a machine without it, is skipped saying so
    (``kit.setup.portable.NEEDS_TRITON``), never a collection error. (A test that needs Triton in its worker is skipped
    by ``kit.checks`` when the worker reports the missing module.)"""
    report = yield
    if report.failed and isinstance(collector, pytest.Module):
        from kit.setup.portable import NEEDS_TRITON, triton_missing_error

        text = str(report.longrepr)
        if "ModuleNotFoundError" in text and triton_missing_error("ModuleNotFoundError", text):
            report.outcome, report.longrepr = "skipped", (str(collector.path), None, f"Skipped: {NEEDS_TRITON}")
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    problems = []
    owners: dict[Path, int | None] = {}
    for item in items:
        path = Path(str(item.path))
        if not path.name.startswith("test_stage") and any(m.name[:5] == "stage" and m.name[5:].isdigit()
                                                          for m in item.iter_markers()):
            problems.append(f"{item.nodeid}: stage markers belong to the stage's own test files (kit/stages.py), "
                            "which `pytest -m stageN` alone collects")
        if path.name.startswith("test_stage"):
            stages = [m.name for m in item.iter_markers() if m.name[:5] == "stage" and m.name[5:].isdigit()]
            if "impl" in getattr(item, "fixturenames", ()):
                problems.append(f"{item.nodeid}: a graded test reaches the implementation through the worker "
                                "fixture or spawned ranks (kit.checks), never in the judge's process")
            has_points = item.get_closest_marker("points") is not None
            is_gpu = item.get_closest_marker("gpu") is not None
            owner = owners[path] if path in owners else owners.setdefault(path, _stage_of_file(path))
            if len(set(stages)) != 1:
                problems.append(f"{item.nodeid}: needs exactly one stageN marker, has {stages}")
            elif owner is None or stages[0] != f"stage{owner}":
                problems.append(f"{item.nodeid}: marked {stages[0]}, but kit/stages.py lists this file under "
                                + (f"stage {owner}" if owner else "no stage"))
            if not has_points and not is_gpu:
                problems.append(f"{item.nodeid}: graded tests need a points(n) marker")
            if is_gpu and has_points:
                problems.append(f"{item.nodeid}: gpu tests are checks, not graded: drop points(n)")
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU — this check runs on GPU machines only"))
    if problems:
        raise pytest.UsageError("test suite markers are inconsistent:\n  " + "\n  ".join(problems))
    _composed_tests_last(items)


def _stage_marker(item: pytest.Item) -> int | None:
    return registry.stage_of(item)


def _composed_tests_last(items: list[pytest.Item]) -> None:
    """A test module that sets ``RUN_AFTER_UNITS = True`` runs after the other tests of its stage.

    Its tests compose the pieces the stage's other tests check one at a time (Stage 6's 4D training), so a
    mistake in one piece fails first the test that names it, not the composition (run with ``-x``).
    """
    deferred: dict[str | None, list[pytest.Item]] = {}
    rest: list[pytest.Item] = []
    for item in items:
        module = getattr(item, "module", None)
        if getattr(module, "RUN_AFTER_UNITS", False):
            deferred.setdefault(_stage_marker(item), []).append(item)
        else:
            rest.append(item)
    if not deferred:
        return
    last = {_stage_marker(item): i for i, item in enumerate(rest)}
    ordered: list[pytest.Item] = []
    for i, item in enumerate(rest):
        ordered.append(item)
        stage = _stage_marker(item)
        if last.get(stage) == i:
            ordered += deferred.pop(stage, [])
    for leftover in deferred.values():
        ordered += leftover
    items[:] = ordered


@pytest.fixture(scope="session")
def worker() -> Worker:
    """The session's worker: ``worker.call(check, *args)`` runs a module-level ``check`` there (it loads the
    implementation with ``kit.impl.load()``) and returns its data (see :mod:`kit.checks`)."""
    from kit.checks import Worker

    return Worker()


@pytest.fixture(autouse=True)
def _built_here(request: pytest.FixtureRequest) -> None:
    """A test marked ``builds(rule)`` fails when the submission had PyTorch's own implementation do that work
    (tests/support/rules.py): a wrapper loses the points of what it skipped."""
    if request.node.get_closest_marker("builds") is not None:
        from tests.support import rules

        rules.gate(request)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    import torch

    # Same seeds for every test: grading one submission twice gives the same score.
    torch.manual_seed(0)
    random.seed(0)
