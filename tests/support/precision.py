"""Stage 2 harness shared by the public and the hidden tests (handout/02-mixed-precision.md).

* The test's own activation-memory instrument: :func:`saved_bytes_independent` (a pack hook of its own)
  and :func:`checkpointed_by_test` (its own ``torch.utils.checkpoint`` around segments of blocks). The judge
  uses them to compute the bytes a forward must save; they never call the implementation.
* Loops run step by step in a worker: :func:`stepwise` records what each step did until one raises, and
  :class:`Steps` reads the records in the judge, meeting the worker's failure where the test meets the
  first value the failing step never recorded — so a test that used to run the implementation step by
  step still reports the first wrong value before a later crash, in the same order as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from kit.model import cross_entropy

# ------------------------------------------------------------------------------------------------------
# Activation memory, measured by the test itself


def saved_bytes_independent(model, inputs, targets, dtype) -> int:
    """What autograd saves in one forward + loss, measured by the test's own pack hook (handout 02 §6 rules:
    each storage once at its full size; leaves that require grad and their views not counted). Autocast
    runs on the inputs' device type."""
    storages = {}

    def pack(t):
        base = t._base if t._base is not None else t
        if not (base.is_leaf and base.requires_grad):
            storages.setdefault((t.device, t.untyped_storage().data_ptr()), t.untyped_storage())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(inputs.device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(inputs)
        cross_entropy(logits, targets)
    return sum(st.nbytes() for st in storages.values())


class Segments(torch.nn.Module):
    """The test's own checkpointing: k consecutive blocks under one non-reentrant torch.utils.checkpoint."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def _run(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self._run, x, use_reentrant=False)


def checkpointed_by_test(model, k: int):
    """``model`` (the kit's TransformerLM) with its blocks in :class:`Segments` of ``k``, in place."""
    blocks = list(model.layers)
    model.layers = torch.nn.ModuleList(Segments(blocks[i:i + k]) for i in range(0, len(blocks), k))
    return model


# ------------------------------------------------------------------------------------------------------
# Loops in a worker, judged step by step


def stepwise(step: Callable[[int, dict], None], n: int, final: Callable[[], Any] | None = None) -> dict:
    """In a worker: ``step(i, record)`` for ``i`` in ``range(n)``, each filling its ``record`` (a dict) as it
    goes, then ``final()`` (what the loop left behind: the parameters, …). Stops at the first exception:
    the records made before it come back with the failure (``kit.spawn.worker.error_report``), for
    :class:`Steps` in the judge. A stub's ``NotImplementedError`` comes back the same way."""
    from kit.spawn.worker import error_report

    records: list[dict] = []
    try:
        for i in range(n):
            record: dict = {}
            records.append(record)
            step(i, record)
        value = final() if final is not None else None
    except Exception as exc:  # noqa: BLE001 — any failure of the implementation is the test's finding
        return {"steps": records, "final": None, "failure": error_report(exc)}
    return {"steps": records, "final": value, "failure": None}


class Steps:
    """In the judge: what :func:`stepwise` brought back from check ``check``. ``steps.get(i, key)`` is what
    step ``i`` recorded under ``key``; if the loop failed before recording it, the worker's failure is raised
    there, as the same kind of error as :meth:`kit.checks.Worker.call` raises (a stub as
    ``NotImplementedError``). ``steps.final()`` likewise."""

    def __init__(self, got: dict, check: str):
        self.records = list(got["steps"])
        self.failure = got["failure"]
        self._final = got["final"]
        self.check = check

    def get(self, i: int, key: str) -> Any:
        __tracebackhide__ = True
        if i < len(self.records) and key in self.records[i]:
            return self.records[i][key]
        raise self._exception()

    def final(self) -> Any:
        __tracebackhide__ = True
        if self.failure is not None:
            raise self._exception()
        return self._final

    def _exception(self) -> BaseException:
        from kit.checks import Failure

        if self.failure is None:  # a test asked for a value its own worker function never records
            raise KeyError(f"check {self.check!r} recorded no such value and did not fail")
        return Failure.from_report(self.check, -1, self.failure).exception()
