"""Inside a worker: the loop that runs what the judge asks and sends back data (:mod:`kit.spawn.wire`).

A worker is a child of the zygote (:mod:`kit.spawn.zygote`) with one channel to the judge. The judge
sends requests (pickled: the judge is trusted, the worker is not); the worker answers each with one
message of data. Requests:

* ``{"op": "call", "fn", "args", "kwargs"}`` — run ``fn(*args, **kwargs)``; answer its value or its failure.
  A persistent worker serves call after call (the single-process checks of a whole session);
* ``{"op": "rank", "fn", "args", "kwargs", "rank", "world_size", "backend", "folder", "timeout"}`` — join a
  process group as one rank, run the function once, answer, leave the group and exit (``"breakpoints": False``:
  beside a rank 0 that runs in the judge, ``pytest --inline``, where ``breakpoint()`` does nothing);
* ``{"op": "import", "name"}`` — import a module (the grader's import check of a stage);
* ``{"op": "unavailable", "modules": {name: why}}`` — from now on, importing one of these modules fails at
  once with ``why`` (a module known to hang or fail at import, so a later stage that uses it says so
  instead of hanging again).

Answers are dicts: ``{"ok": True, "value": …}`` or ``{"ok": False, "failure": {type, kind, message,
traceback}}``. While a rank runs :func:`kit.checks.run_checks`, each finished check is sent at once as
``{"check": name, "ok": …}``: a hang later in the spawn keeps the checks that finished.

``pytest --inline`` (:func:`kit.spawn.parent.set_inline`) runs the same requests in the judge's own process
instead, so that ``breakpoint()`` stops in the terminal: :func:`call_inline` for a call, :func:`rank_inline` for
rank 0 of a spawn, with the arguments and answers copied as if they had travelled.
"""

from __future__ import annotations

import faulthandler
import importlib.abc
import io
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from . import checkbook, wire

__tracebackhide__ = True

_channel: Connection | None = None  # this worker's channel to the judge (None outside a worker)
# While rank 0 of a spawn runs in the judge's own process (``pytest --inline``): the checks it reported, and
# whether the other ranks were stopped (one failed or died: rank 0 must not wait for them between checks).
_inline_checks: dict[str, tuple[bool, Any]] | None = None
peers_stopped = threading.Event()
_JUDGE_MAIN = "__kit_judge_main__"  # where the judge's script is loaded, the first time one of its functions is


def _own_frames(tb):
    """The frames of a traceback that are not plumbing: a module that sets ``__tracebackhide__ = True`` (pytest's
    convention, which the kit's harness, comparisons and this package follow) is left out."""
    return [(frame, line) for frame, line in traceback.walk_tb(tb)
            if frame.f_globals.get("__tracebackhide__") is not True]


def error_report(exc: BaseException) -> dict[str, str]:
    """``{"type", "kind", "message", "traceback"}`` of an exception; the traceback without the kit's frames
    (:func:`_own_frames`).

    ``kind`` is what the judge turns it into: ``not_implemented`` (a stub), ``assertion`` (an
    ``AssertionError`` or ``pytest.fail``) or ``error`` (anything else).
    """
    frames = traceback.StackSummary.extract(_own_frames(exc.__traceback__))
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 — an exception whose __str__ itself fails
        message = repr(exc)
    kind_name = type(exc).__name__
    kind = ("not_implemented" if isinstance(exc, NotImplementedError)
            else "assertion" if isinstance(exc, AssertionError) or kind_name == "Failed"  # pytest.fail
            else "error")
    if not message and frames and kind != "not_implemented":  # a bare `assert x`: quote the line instead
        last = frames[-1]
        message = f"{kind_name} at {Path(last.filename).name}:{last.lineno}: {last.line}"
    return {"type": kind_name, "kind": kind, "message": message,
            "traceback": "".join(traceback.format_list(frames))}


def send(message: dict) -> None:
    """Send one message (made of data: see :func:`_run`) to the judge, stamped with the time it was sent
    (``CLOCK_MONOTONIC`` is one clock for every process: the judge orders the ranks' failures by it)."""
    assert _channel is not None, "send() is for workers"
    _channel.send_bytes(wire.encode({**message, "sent": time.monotonic()}))


def report_check(name: str, ok: bool, payload: Any) -> None:
    """While a rank runs several named checks: send one check's outcome now (see the module docstring).
    ``payload`` is the check's value (already normalised) or its failure report."""
    if _channel is not None:
        answer = _untampered({"ok": ok, **({"value": payload} if ok else {"failure": payload})})
        send({"check": name, **answer})
    elif _inline_checks is not None:  # a copy, as the judge would have read it from a worker
        _inline_checks[name] = (ok, wire.decode(wire.encode(payload)))


def from_main(module: str | None, path: str | None, qualname: str) -> Any:
    """A function or class of the judge's ``__main__``, found here: by module name (``python -m x``), else by
    loading the judge's script as ``__mp_main__`` (as multiprocessing does; its ``if __name__ ==
    "__main__"`` block does not run)."""
    import importlib.util

    if module:
        target = importlib.import_module(module)
    elif _JUDGE_MAIN in sys.modules:
        target = sys.modules[_JUDGE_MAIN]
    else:
        spec = importlib.util.spec_from_file_location("__mp_main__", path)
        target = importlib.util.module_from_spec(spec)
        sys.modules[_JUDGE_MAIN] = target
        spec.loader.exec_module(target)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def in_worker() -> bool:
    return _channel is not None


def in_rank() -> bool:
    """Whether this process is a rank of a spawn: a worker's, or rank 0 run inline in the judge (``--inline``)."""
    return _channel is not None or _inline_checks is not None


class _Unavailable(importlib.abc.MetaPathFinder):
    """Fails the import of modules known to hang or fail, at once and saying why."""

    def __init__(self) -> None:
        self.modules: dict[str, str] = {}

    def find_spec(self, name, path=None, target=None):
        why = self.modules.get(name)
        if why is not None:
            raise ImportError(why, name=name)
        return None


_unavailable = _Unavailable()


def _run(fn, args, kwargs, reraise: tuple[type[BaseException], ...] = ()) -> dict:
    """``fn``'s value as data, or its failure; a value that is not data fails, naming the part that is not. Nothing
    is taken from a process whose checks were tampered with (:mod:`kit.spawn.checkbook`), before or after.
    ``reraise``: exceptions that are not a failure of ``fn`` but the user's (inline: Ctrl-C, quitting the debugger)."""
    tampered = _untampered({"ok": True})
    if tampered["ok"] is not True:
        return tampered
    try:
        return _untampered({"ok": True, "value": wire.normalise(fn(*args, **kwargs),
                                                                f"what {getattr(fn, '__name__', fn)} returned")})
    except reraise:
        raise
    except (KeyboardInterrupt, SystemExit) as exc:
        return {"ok": False, "failure": error_report(exc)}
    except BaseException as exc:  # noqa: BLE001 — pytest.fail raises a BaseException too
        return {"ok": False, "failure": error_report(exc)}


def user_stops() -> tuple[type[BaseException], ...]:
    """What a person debugging inline raises to stop: Ctrl-C, or ``q`` in pdb (``bdb.BdbQuit``; under pytest, its
    pdb exits the session). Never a failure of the check it interrupts."""
    import bdb

    stops: tuple[type[BaseException], ...] = (KeyboardInterrupt, bdb.BdbQuit)
    try:
        from _pytest.outcomes import Exit
    except ImportError:  # not under pytest
        return stops
    return (*stops, Exit)


def call_inline(fn, args: tuple, kwargs: dict) -> dict:
    """``pytest --inline``: :func:`_run` in the judge's own process, so a ``breakpoint()`` in the implementation stops
    in the terminal. The arguments are copied as a worker receives them (pickled) and the answer as the judge
    reads one (:mod:`kit.spawn.wire`): a check cannot change the judge's tensors, nor the judge the check's."""
    args, kwargs = pickle.loads(pickle.dumps((args, kwargs)))
    return wire.decode(wire.encode(_run(fn, args, kwargs, user_stops())))


def rank_inline(request: dict) -> tuple[dict, dict[str, tuple[bool, Any]]]:
    """``pytest --inline``: be rank ``request["rank"]`` of a spawn in the judge's own process (the other ranks are
    workers). Returns the final answer and the checks reported on the way; the process group is left, and the
    environment is as it was before."""
    global _inline_checks
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "KIT_RANK_FOLDER")
    saved = {name: os.environ.get(name) for name in names}
    peers_stopped.clear()
    _inline_checks = {}
    args, kwargs = pickle.loads(pickle.dumps((request["args"], request["kwargs"])))
    request = {**request, "args": args, "kwargs": kwargs}
    try:
        answer = wire.decode(wire.encode({**_rank(request, user_stops()), "sent": time.monotonic()}))
        return answer, _inline_checks
    finally:
        _inline_checks = None
        _leave_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _rank(request: dict, reraise: tuple[type[BaseException], ...] = ()) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    from .rank import default_gloo_interface

    rank, world = request["rank"], request["world_size"]
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), KIT_RANK_FOLDER=request["folder"])
    if request.get("breakpoints") is False:  # a rank beside rank 0 inline (pytest --inline): breakpoint() does nothing
        os.environ["PYTHONBREAKPOINT"] = "0"
    try:
        if request["backend"] == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:
            default_gloo_interface()
        dist.init_process_group(request["backend"], init_method=f"file://{request['folder']}/store", rank=rank,
                                world_size=world, timeout=datetime.timedelta(days=1))  # the judge stops a hang
        # Every rank has finished connecting before any runs ahead: a rank that returned at once and left could
        # otherwise close its connections while a slower peer is still completing gloo's full mesh.
        dist.barrier()
    except BaseException as exc:  # noqa: BLE001
        return {"ok": False, "failure": error_report(exc)}
    return _run(request["fn"], request["args"], request["kwargs"], reraise)


def _leave_process_group() -> None:
    # After the rank's report is sent, never before: destroying the group closes gloo's connections, and a peer
    # still in a collective then fails with "Connection closed by peer" — a report that must not overtake the
    # cause's own.
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class _CheckUnpickler(pickle.Unpickler):
    """Reads a request, finding each function and class it names in the checkbook (what the kit's and the test
    modules held before any submission code ran), not in the live modules a submission may have rewritten."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return checkbook.resolve(module, name)
        except (KeyError, AttributeError):
            return super().find_class(module, name)


def _untampered(answer: dict) -> dict:
    """``answer``, unless the submission changed the checks or the kit in this process: then a failure saying what."""
    changed = checkbook.tampering()
    if changed is None:
        return answer
    return {"ok": False, "failure": {
        "type": "Tampered", "kind": "error", "traceback": "",
        "message": f"the checks in this worker were tampered with ({changed}): the graded code must not change the "
                   "kit or the tests, so no value from this worker is taken (the instructor guide, What a grade can be "
                   "trusted for)"}}


def serve(channel: Connection, stacks: int, test_modules: list[str] = ()) -> None:
    """The worker's loop: answer requests until the judge closes the channel (or after one rank). ``stacks``: the
    descriptor of the file the judge reads this worker's Python stacks from when it stops answering;
    ``test_modules``: the judge's test modules, imported before the fork, whose checks go in the checkbook."""
    global _channel
    _channel = channel
    checkbook.write(list(test_modules))  # first: no submission code has run in this process yet
    # The judge dumps this worker's stack there when it stops answering (faulthandler; a hang in C shows too).
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    sys.meta_path.insert(0, _unavailable)
    if os.environ.get("KIT_NO_IMPLEMENTATION"):  # a reference rank: the judge's code only
        _unavailable.modules.update({name: f"{name}: reference ranks never load the implementation"
                                     for name in ("student", "reference")})
    import torch

    torch.set_num_threads(1)  # as the judge and every rank: the same kernels, the same rounding
    while True:
        try:
            data = channel.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            stream = io.BytesIO(data)
            for entry in pickle.load(stream):  # test folders the judge imported from since the zygote started
                if entry not in sys.path:
                    sys.path.append(entry)
            request = _CheckUnpickler(stream).load()
        except Exception as exc:  # noqa: BLE001 — e.g. a check function this worker cannot import
            send({"ok": False, "failure": error_report(exc)})
            continue
        op = request["op"]
        if op == "call":
            send(_run(request["fn"], request["args"], request["kwargs"]))
        elif op == "rank":
            try:
                send(_rank(request))
            finally:
                _leave_process_group()
            return
        elif op == "import":
            send(_run(lambda name: importlib.import_module(name) and None, (request["name"],), {}))
        elif op == "unavailable":
            _unavailable.modules.update(request["modules"])
            send({"ok": True, "value": None})
        else:
            send({"ok": False, "failure": {"type": "ValueError", "kind": "error", "message": f"unknown op {op!r}",
                                           "traceback": ""}})
