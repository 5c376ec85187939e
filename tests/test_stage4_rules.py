"""Stage 4's rule: the student builds data parallelism; torch's ``DistributedDataParallel`` and its C++ ``Reducer``
may not build it for them.

A DDP class that holds or subclasses ``torch.nn.parallel.DistributedDataParallel`` (or builds its
``torch.distributed.Reducer`` itself) averages the gradients correctly — torch's DDP is what the hidden tests compare
with — so only this rule tells it from one the student wrote (handout 04, What is graded). The judge below runs each
of the four classes through construction, two synchronised steps and a ``no_sync`` micro-batch on 2 ranks under
:func:`kit.grading.library_rules.watch`; :mod:`tests.support.rules` adds a reading of the source and, when the rule
is broken, fails every test marked ``builds("torch-ddp")`` with the same message.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import kit.impl
from kit.checks import run_check
from kit.grading import library_rules
from tests.support import rules

pytestmark = pytest.mark.stage4

WORLD = 2
CLASSES = ("NaiveDDP", "FlatDDP", "DDPIndividualParameters", "DDPBucketed")


def _wrap(ddp, cls: str, model: nn.Module):
    if cls == "DDPBucketed":
        return ddp.DDPBucketed(model, bucket_size_mb=0.0005)  # several buckets: 524 bytes, smaller than fc1.weight
    return getattr(ddp, cls)(model)


def _steps(ddp_model: nn.Module, rank: int) -> None:
    """Two synchronised steps, then a micro-batch inside no_sync followed by one that communicates."""
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        ddp_model.on_train_batch_start()
        ddp_model(torch.randn(4, 8, generator=g)).square().mean().backward()
        ddp_model.finish_gradient_synchronization()
    ddp_model.on_train_batch_start()
    with ddp_model.no_sync():
        ddp_model(torch.randn(4, 8, generator=g)).square().mean().backward()
    ddp_model(torch.randn(4, 8, generator=g)).square().mean().backward()
    ddp_model.finish_gradient_synchronization()


def _ddp_workload() -> dict:
    """On each rank: every class constructed, trained and synchronised, watched. Returns the violations, and what
    raised per class (a class that is still a stub must not keep the others from being checked)."""
    ddp = kit.impl.load().ddp
    rank = dist.get_rank()
    failed: dict[str, str] = {}
    with library_rules.watch(["torch-ddp"]) as seen:
        for cls in CLASSES:
            torch.manual_seed(rank)
            model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
            try:
                wrapper = _wrap(ddp, cls, model)
                seen.check_object(wrapper)
                _steps(wrapper, rank)
            except Exception as exc:  # noqa: BLE001 — a stub or a bug: the behaviour tests report it
                failed[cls] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return {"violations": seen.as_data(), "failed": failed}


@rules.judge("torch-ddp")
def _judge_ddp(request: pytest.FixtureRequest) -> list[dict]:
    ranks = run_check(_ddp_workload, WORLD, timeout=120)
    violations: list[dict] = []
    for got in ranks:
        violations += [v for v in got["violations"] if v not in violations]
    failed = {cls: why for got in ranks for cls, why in got["failed"].items()}
    if not violations and failed:
        # Nothing seen, but not every class ran: an unchecked class is not a kept rule.
        cls, why = next(iter(failed.items()))
        raise RuntimeError(f"{cls} (construction, two steps, no_sync) raised {why}"
                           + (f"; {len(failed) - 1} other class(es) raised too" if len(failed) > 1 else ""))
    # A class derived from torch's DDP is the headline (its __init__ and forward calls follow from it): first.
    return sorted(violations, key=lambda v: v["how"] != "derives")


@pytest.mark.points(1)
def test_builds_its_own_data_parallelism(request) -> None:
    """NaiveDDP, FlatDDP, DDPIndividualParameters and DDPBucketed neither wrap nor subclass torch's
    DistributedDataParallel, nor build its C++ Reducer."""
    rules.assert_kept("torch-ddp", request, (
        "the DDP workload failed with {error}. "
        "Make the training tests of every class pass first (handout 04 §2–§5)."))
