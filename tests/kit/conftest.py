"""The kit's own tests (grader, release, spawn helper, tuning): not graded, run against the reference."""

import pytest

from kit import impl as impl_module


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/kit/" in str(item.path):
            item.add_marker(pytest.mark.kit)


@pytest.fixture(scope="session")
def impl() -> impl_module.Implementation:
    """The implementation in this process, for the kit's own tests of it (tuning caches, compile checks).
    Graded tests never have it: they reach the implementation through workers (kit.checks)."""
    return impl_module.load()


@pytest.fixture
def launches(tmp_path):
    """Start real launchers (torchrun, SLURM's daemons) with :class:`launching.Processes`: every process they
    start is marked, and whatever is still alive when the test ends is killed — and then must be gone."""
    from launching import Processes

    procs = Processes(tmp_path)
    yield procs
    procs.close()
    left = procs.leftovers()
    assert not left, "processes survived SIGKILL at teardown:\n" + "\n".join(left)
