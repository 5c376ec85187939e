"""kit.nvtx_ranges: a machine without the ``nvtx`` package keeps ``nvtx.annotate`` (torch.cuda.nvtx on CUDA,
nothing without it), and ``kit doctor`` says which backend is in use."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import kit.nvtx_ranges
import kit.setup.doctor

pytestmark = pytest.mark.kit


@pytest.fixture
def without_nvtx_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvtx", None)  # `import nvtx` now raises ImportError
    yield importlib.reload(kit.nvtx_ranges)
    monkeypatch.undo()
    importlib.reload(kit.nvtx_ranges)


def test_fallback_uses_torch_cuda_nvtx_on_cuda(without_nvtx_package, monkeypatch):
    ranges = without_nvtx_package
    assert ranges.BACKEND.startswith("torch.cuda.nvtx") and ranges.nvtx.annotate is ranges.annotate
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda msg: calls.append(("push", msg)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))

    @ranges.nvtx.annotate("step")
    def step():
        with ranges.nvtx.annotate("forward", color="blue"):
            pass

    step()
    assert calls == [("push", "step"), ("push", "forward"), ("pop",), ("pop",)]


def test_fallback_is_a_no_op_without_cuda(without_nvtx_package, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda msg: pytest.fail("range_push without CUDA"))
    with without_nvtx_package.nvtx.annotate("forward"):
        value = 1
    assert value == 1


def test_doctor_says_ranges_fall_back(without_nvtx_package):
    report = kit.setup.doctor.report()
    assert "NVTX ranges fall back to torch.cuda.nvtx" in report, report


def test_package_is_used_when_installed():
    pytest.importorskip("nvtx")
    assert kit.nvtx_ranges.BACKEND.startswith("nvtx package")
    assert kit.nvtx_ranges.nvtx is sys.modules["nvtx"]
