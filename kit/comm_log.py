"""Record, in one rank, every collective it issues, the waits on them and marks of your own, in order.

    with CommLog() as log:
        loss.backward()                       # collectives launched from autograd hooks are seen too
        log.mark("backward returned")
        ddp.finish_gradient_synchronization()
    log.collectives("all_reduce")             # [Event(kind="collective", op="all_reduce", nbytes=4224, ...)]
    log.bytes_by_op()                         # {"all_reduce": 25344}: payload per collective, groups of 2+
    print(log.format())                       # one line per event, for a failure message

Every ``torch.distributed`` collective reaches the dispatcher as an operator ``torch.ops.c10d.<name>``
(``allreduce_``, ``_allgather_base_``, ``send``, …), whoever calls it — user code, an autograd hook in
backward, torch's own DDP. :class:`CommLog` is a ``TorchDispatchMode`` that sees each one and records a
canonical name, the bytes this rank hands in, the global ranks of its group and its ``async_op`` flag
(read through the operator's schema, so positional and keyword calls look the same). While it is active,
every way of completing an async collective is recorded as a wait on it, whichever idiom the code uses:
``Work.wait()``; the Work's future (``get_future()``) waited on directly, through a ``then()`` chain, or with
``torch.futures.wait_all``/``collect_all``. Functional collectives (``torch.ops._c10d_functional``) are
recorded as well, their ``wait_tensor`` as a wait (on the collective whose output it waits for). A
blocking collective (``async_op=False``) needs no wait.

Nothing needs the implementation's cooperation, and it observes only what any correct implementation
must do: which collectives, how many bytes, on which group, and in which order relative to the marks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CommLog", "Event", "events_from_data", "format_events"]

__tracebackhide__ = True  # pytest: the kit's plumbing is not part of a student's traceback

# c10d operator → (canonical collective, the argument holding what this rank hands in; None: no payload)
C10D = {
    "allreduce_": ("all_reduce", "tensors"), "allreduce_coalesced_": ("all_reduce", "tensors"),
    "allgather_": ("all_gather", "input_tensors"), "_allgather_base_": ("all_gather", "input_tensor"),
    "allgather_coalesced_": ("all_gather", "input_list"),
    "allgather_into_tensor_coalesced_": ("all_gather", "inputs"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"), "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "alltoall_": ("all_to_all", "input_tensors"), "alltoall_base_": ("all_to_all", "input"),
    "broadcast_": ("broadcast", "tensors"), "reduce_": ("reduce", "tensors"),
    "gather_": ("gather", "input_tensors"), "scatter_": ("scatter", "input_tensors"),
    "send": ("send", "tensors"), "recv_": ("recv", "tensors"), "recv_any_source_": ("recv", "tensors"),
    "barrier": ("barrier", None), "monitored_barrier_": ("barrier", None),
}
# _c10d_functional operator (its overload packet name) → canonical collective; the payload is the first argument.
FUNCTIONAL = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_out": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "broadcast_": "broadcast", "isend": "send", "irecv": "recv",
}


@dataclass(frozen=True)
class Event:
    """One entry of a :class:`CommLog`; picklable, so a rank can return its log to the test."""

    kind: str  # "collective", "wait" or "mark"
    op: str = ""  # collective: "all_reduce", "all_gather", …; wait: the op waited on ("" if unknown)
    nbytes: int = 0  # collective: bytes of the tensors this rank hands in
    group: tuple[int, ...] = ()  # collective: global ranks of its process group (() if unknown)
    async_op: bool | None = None  # collective: its async_op flag (None: the op has none, e.g. send)
    target: int | None = None  # wait: index in ``events`` of the collective waited on (None if unknown)
    label: str = ""  # mark: its text

    def __str__(self) -> str:
        if self.kind == "mark":
            return self.label
        if self.kind == "wait":
            return f"wait({self.op or '?'}{'' if self.target is None else f' #{self.target}'})"
        flag = {True: "async", False: "sync", None: ""}[self.async_op]
        return f"{self.op}({', '.join(x for x in (f'{self.nbytes} B', flag, f'group {list(self.group)}') if x)})"


def events_from_data(data: list) -> list[Event]:
    """In the judge: a rank's :meth:`CommLog.as_data` back as events (any malformed entry fails loudly)."""
    events = []
    for entry in data:
        fields = dict(entry)
        fields["group"] = tuple(fields.get("group", ()))
        events.append(Event(**fields))
    return events


def format_events(events: list[Event]) -> str:
    """Events as one line, ``#index event`` for collectives (the index a wait points back at)."""
    return ", ".join(f"#{i} {e}" if e.kind == "collective" else str(e) for i, e in enumerate(events))


def _nbytes(payload: Any) -> int:
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    if isinstance(payload, (list, tuple)):
        return sum(_nbytes(p) for p in payload)
    return 0


def _group_ranks(group: Any) -> tuple[int, ...]:
    try:
        if isinstance(group, str):  # functional collectives name their group
            group = dist.distributed_c10d._resolve_process_group(group)
        elif not isinstance(group, dist.ProcessGroup):
            group = dist.ProcessGroup.unbox(group)
        return tuple(dist.get_process_group_ranks(group))
    except Exception:  # a group torch does not know by that handle: record the collective anyway
        return ()


def _storage_key(tensor: Any) -> int:
    """Where a tensor's data lives (a wrapper subclass such as AsyncCollectiveTensor: its inner tensor's)."""
    for candidate in (tensor, getattr(tensor, "elem", None)):
        try:
            return candidate.untyped_storage().data_ptr()
        except Exception:  # noqa: BLE001 — a wrapper without storage of its own
            continue
    return id(tensor)


def _bound(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The operator's arguments by schema name, defaults filled in: positional and keyword calls alike."""
    schema = func._schema.arguments
    bound = {a.name: a.default_value for a in schema if a.has_default_value()}
    bound.update(zip((a.name for a in schema), args))
    bound.update(kwargs)
    return bound


class CommLog(TorchDispatchMode):
    """A dispatch mode recording collectives, waits and marks in :attr:`events`, in the order they happen."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []
        # id(Work or Future) → (the handle, kept alive; the indices of the collectives it completes)
        self._works: dict[int, tuple[Any, list[int]]] = {}
        self._outputs: dict[int, int] = {}  # a functional collective's output storage → its collective's index

    # -- recording ------------------------------------------------------------------------------------

    def mark(self, label: str) -> None:
        """Add a mark of your own (``log.mark("grad ready: fc1.weight")``) between the recorded events."""
        self.events.append(Event("mark", label=label))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace == "c10d" and any("ProcessGroup" in str(a.type) for a in func._schema.arguments):
            self._collective(func, args, kwargs, out, *C10D.get(name, (name.strip("_"), None)))
        elif namespace == "_c10d_functional" and name in FUNCTIONAL:
            bound = _bound(func, args, kwargs)
            self.events.append(Event("collective", FUNCTIONAL[name], _nbytes(args[0]),
                                     _group_ranks(bound.get("group_name")), async_op=True))
            for tensor in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(tensor, torch.Tensor):  # wait_tensor later names the collective by its output
                    self._outputs[_storage_key(tensor)] = len(self.events) - 1
        elif namespace == "_c10d_functional" and name == "wait_tensor":
            index = self._outputs.get(_storage_key(args[0])) if args else None
            self.events.append(Event("wait", self.events[index].op if index is not None else "", target=index))
        return out

    def _collective(self, func, args, kwargs, out, op: str, payload: str | None) -> None:
        bound = _bound(func, args, kwargs)
        group = next(bound.get(a.name) for a in func._schema.arguments if "ProcessGroup" in str(a.type))
        event = Event("collective", op, _nbytes(bound.get(payload)) if payload else 0, _group_ranks(group),
                      async_op=bound.get("async_op"))
        self.events.append(event)
        work = out[-1] if isinstance(out, tuple) else out
        try:
            work = dist.distributed_c10d.Work.unbox(work)  # the very object the caller gets back
        except Exception:
            return
        self._works[id(work)] = (work, [len(self.events) - 1])

    def _waited(self, handle: Any) -> None:
        """A completion the caller waited for: a Work, or a Future of one (or of several, collect_all)."""
        _, targets = self._works.get(id(handle), (None, [None]))
        for index in targets:
            op = self.events[index].op if index is not None else ""
            self.events.append(Event("wait", op, target=index))

    def _track(self, handle: Any, targets: list[int]) -> None:
        if targets:
            self._works[id(handle)] = (handle, targets)  # kept alive: pybind hands back this same wrapper

    def __enter__(self) -> CommLog:
        # Every way the caller can complete an async collective and see its result: Work.wait(); the Work's
        # future (get_future) waited on, or chained with then() and that waited on, or collected with
        # collect_all/wait_all. Functional collectives complete with wait_tensor (a dispatched op, above).
        work_cls, future_cls, c = dist.distributed_c10d.Work, torch._C.Future, torch._C
        self._originals = [(work_cls, "wait", work_cls.wait), (work_cls, "get_future", work_cls.get_future),
                           (future_cls, "wait", future_cls.wait), (future_cls, "then", future_cls.then),
                           (c, "_collect_all", c._collect_all)]
        log = self
        wait_work, get_future, wait_future, then, collect_all = (o[2] for o in self._originals)

        def work_wait(work, *args, **kwargs):
            log._waited(work)
            return wait_work(work, *args, **kwargs)

        def work_get_future(work, *args, **kwargs):
            future = get_future(work, *args, **kwargs)
            log._track(future, log._works.get(id(work), (None, []))[1])
            return future

        def future_wait(future, *args, **kwargs):
            if id(future) in log._works:  # a future of no recorded collective completes nothing recorded
                log._waited(future)
            return wait_future(future, *args, **kwargs)

        def future_then(future, *args, **kwargs):
            chained = then(future, *args, **kwargs)
            log._track(chained, log._works.get(id(future), (None, []))[1])
            return chained

        def collect(futures, *args, **kwargs):
            combined = collect_all(futures, *args, **kwargs)
            log._track(combined, [i for f in futures for i in log._works.get(id(f), (None, []))[1]])
            return combined

        work_cls.wait, work_cls.get_future, future_cls.wait, future_cls.then = (work_wait, work_get_future,
                                                                                 future_wait, future_then)
        c._collect_all = collect
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in self._originals:
            setattr(owner, name, original)
        self._works.clear()  # release the Work and Future handles
        self._outputs.clear()
        return super().__exit__(*exc)

    # -- reading --------------------------------------------------------------------------------------

    def collectives(self, op: str | None = None) -> list[Event]:
        """The collective events (of one canonical ``op``, e.g. ``"all_reduce"``, if given), in order."""
        return [e for e in self.events if e.kind == "collective" and (op is None or e.op == op)]

    def bytes_by_op(self, min_group_size: int = 2) -> dict[str, int]:
        """Bytes handed to each kind of collective; groups smaller than ``min_group_size`` move nothing."""
        out: dict[str, int] = {}
        for e in self.collectives():
            if len(e.group) >= min_group_size and e.op != "barrier":
                out[e.op] = out.get(e.op, 0) + e.nbytes
        return out

    def format(self) -> str:
        """The events as one line, for a failure message (see :func:`format_events`)."""
        return format_events(self.events)

    def as_data(self) -> list[dict]:
        """The events as plain dicts, what a rank returns to the judge (:func:`events_from_data` reads them)."""
        return [dict(e.__dict__) for e in self.events]
