"""The judge's side of its workers: the zygote, the persistent worker, spawns of ranks, and their limits.

Everything here runs in the process that decides (pytest, a notebook, a benchmark) and never runs a
submission's code: workers do (:mod:`kit.spawn.worker`), forked from a warm zygote (:mod:`kit.spawn.zygote`).
What comes back is data (:mod:`kit.spawn.wire`). A request — one call in the persistent worker, or one
spawn of N ranks — ends in one of four ways: every process answered; one failed (its report, and the
others' for a moment more); one died without a word (its exit status and last stderr lines); or a limit
ran out (:mod:`kit.spawn.watch`: CPU budget, idle limit, wall clock), in which case each live process's
Python stack is dumped before it is killed, so the message says where it was stuck.
"""

from __future__ import annotations

import atexit
import io
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from types import FunctionType
from typing import Any

from kit.setup.portable import portable

from . import wire
from .confine import Rules
from .fresh import Spawner
from .watch import TreeWatch
from .zygote import PRELOAD, TRAINING_PRELOAD, Child, Zygote

__tracebackhide__ = True  # pytest: the kit's plumbing is not part of a student's traceback

POLL_S = 0.2  # how often the judge reads the workers' CPU while it waits for them
GRACE_S = 1.0  # after a first failure, how long the other ranks get to report theirs
IDLE_DEFAULT_S = 30.0  # no progress for this long, unfinished: a hang (see kit.spawn.watch)


# ----------------------------------------------------------------------------------------------------
# Limits of the test in progress (the grading plugin sets them per test; defaults elsewhere)
# ----------------------------------------------------------------------------------------------------


@dataclass
class Allowance:
    """What the workers of the current test may still use: ``cpu`` seconds of CPU in all, ``idle`` seconds
    without any at a stretch, ``wall`` seconds of wall clock from now; ``spent`` counts the CPU they used
    (``make timings`` records it)."""

    cpu: float = float("inf")
    idle: float = IDLE_DEFAULT_S
    wall: float = float("inf")
    spent: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def wall_left(self) -> float:
        return self.wall - (time.monotonic() - self.started)


_allowance = Allowance()


def allowance() -> Allowance:
    return _allowance


def set_allowance(value: Allowance) -> Allowance:
    """Make ``value`` the current test's allowance; returns the previous one."""
    global _allowance
    previous, _allowance = _allowance, value
    return previous


# ----------------------------------------------------------------------------------------------------
# The zygote and the persistent worker of this process
# ----------------------------------------------------------------------------------------------------


@dataclass
class _Workers:
    rules: Rules | None = None
    scratch: dict[bool, Path] = field(default_factory=dict)  # trusted? → its zygote's scratch folder
    zygotes: dict[bool, Zygote | Spawner] = field(default_factory=dict)  # trusted? → the zygote (or spawner)
    worker: Child | None = None
    unavailable: dict[str, str] = field(default_factory=dict)  # module → why it cannot be imported
    lock: threading.RLock = field(default_factory=threading.RLock)


_workers = _Workers()
_inline = False  # pytest --inline: the implementation's checks run in this process (see set_inline)


def set_inline(on: bool) -> None:
    """``pytest --inline``, for debugging one test: from now on a single-process check runs in this process, and
    rank 0 of a spawn too (the other ranks in workers, as usual), so that a ``breakpoint()`` in the implementation
    stops in the terminal. The grader refuses it (:mod:`kit.grading.plugin`): a check run here is neither
    confined nor limited, and a submission's code would run in the process that decides."""
    global _inline
    _inline = on


def inline() -> bool:
    return _inline


_debuggers: list[Any] = []  # the pdb sessions opened while a check runs inline (the grading plugin notes them)


def note_debugger(pdb: Any) -> None:
    """A pdb session opened (pytest's ``pytest_enter_pdb``): if the person quits it, the inline check ends."""
    _debuggers.append(pdb)


def _debugger_quit() -> bool:
    return any(getattr(pdb, "quitting", False) for pdb in _debuggers)


def _end_if_the_debugger_quit() -> None:
    """After an inline check: ``q`` in pdb ends the pytest session, even where the check caught what pdb raised (a
    check that records what a call raised catches every exception)."""
    quit_, _debuggers[:] = _debugger_quit(), []
    if quit_:
        import pytest

        pytest.exit("Quitting debugger")


def confine_workers(rules: Rules | None) -> None:
    """Confine every worker started from now on (the grader does; a running zygote is replaced)."""
    with _workers.lock:
        _workers.rules = rules
        shutdown()


def confinement() -> str:
    """In words, how this process's workers are confined (starts the zygote if it is not running)."""
    return _zygote().confinement


def start_zygote() -> None:
    """Start this process's zygote and return at once: its imports (3 s of one CPU) then overlap whatever the
    caller does meanwhile (pytest collecting a stage's test files: 3 s of the other CPU). The first fork waits
    until it is ready; if it failed to start, that fork raises its error, where a test reports it. (The
    reference ranks' zygote still starts when a test first needs it: started early, it only competed for
    the same two CPUs, and it cost 3 CPU-seconds to every run whose tests never got that far, as the stubs'.)"""
    _zygote()


def mark_unavailable(modules: dict[str, str]) -> None:
    """Make importing these modules fail at once with the given reason, in every worker from now on."""
    with _workers.lock:
        _workers.unavailable.update(modules)
        worker = _workers.worker
    if worker is not None:
        _ask(worker, {"op": "unavailable", "modules": modules})


def _scratch(trusted: bool = False) -> Path:
    folder = _workers.scratch.get(trusted)
    if folder is None or not folder.exists():
        folder = _workers.scratch[trusted] = Path(tempfile.mkdtemp(prefix="kit-reference-" if trusted else
                                                                    "kit-workers-"))
    return folder


def _zygote(trusted: bool = False) -> Zygote | Spawner:
    """The zygote of the workers that run the implementation, or (``trusted``) of the reference ranks, which
    never load it: a distributed reference (torch's DDP, ``fully_shard``) computed by the judge's own code,
    out of reach of the submission's processes (another scratch folder, another confinement domain). On the
    portable path (:mod:`kit.setup.portable`), a :class:`~kit.spawn.fresh.Spawner` instead: fresh interpreters."""
    with _workers.lock:
        zygote = _workers.zygotes.get(trusted)
        if zygote is None or not zygote.alive():
            scratch = _scratch(trusted)
            (scratch / "home").mkdir(exist_ok=True)
            env = dict(os.environ)
            env.update(TMPDIR=str(scratch), PYTHONDONTWRITEBYTECODE="1")
            if trusted:
                env["KIT_NO_IMPLEMENTATION"] = "1"
            rules = _workers.rules
            if rules is not None:  # confined workers write only their scratch: their home (and caches) too
                env["HOME"] = str(scratch / "home")
                env["XDG_CACHE_HOME"] = str(scratch / "home" / ".cache")
            if rules is not None and not trusted:
                rules = Rules(read=rules.read, list_only=rules.list_only, write=[*rules.write, str(scratch)])
            from .worker import in_worker

            preload = PRELOAD if in_worker() else PRELOAD + TRAINING_PRELOAD
            if portable():  # never a grade (kit.setup.portable.grader_refusal): nothing to confine or contain
                zygote = _workers.zygotes[trusted] = Spawner(env)
            else:
                zygote = _workers.zygotes[trusted] = Zygote(scratch, None if trusted else rules, env, preload,
                                                            contain=_workers.rules is not None)
        return zygote


def shutdown() -> int:
    """Stop the persistent worker and the zygotes (a later request starts new ones). Returns how many processes the
    workers had left running (daemons, found in the zygotes' cgroups where there are some), now killed."""
    leftovers = 0
    with _workers.lock:
        # The persistent worker and what it runs (a zygote of its own, when an implementation spawns ranks) are
        # the kit's; anything else in a zygote's cgroup was left running by a worker.
        expected = set(TreeWatch([_workers.worker.pid]).pids()) if _workers.worker is not None else set()
        for zygote in _workers.zygotes.values():
            leftovers += zygote.close(expected)
        if _workers.worker is not None:
            _kill([_workers.worker])
            _workers.worker = None
        _workers.zygotes.clear()
        for folder in _workers.scratch.values():
            shutil.rmtree(folder, ignore_errors=True)
        _workers.scratch.clear()
    return leftovers


atexit.register(shutdown)


def _fork(name: str, trusted: bool = False) -> Child:
    child = _zygote(trusted).fork({}, Path.cwd(), name)
    if _workers.unavailable:
        _ask(child, {"op": "unavailable", "modules": dict(_workers.unavailable)})
    return child


class _Pickler(pickle.Pickler):
    """Pickles functions and classes of the judge's ``__main__`` (a benchmark run with ``python -m``, a
    script) by where they can be imported from, since a worker's ``__main__`` is another module."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type | FunctionType) and getattr(obj, "__module__", None) == "__main__":
            from .worker import from_main

            main = sys.modules["__main__"]
            spec = getattr(main, "__spec__", None)
            name = spec.name if spec is not None and spec.name != "__main__" else None
            return from_main, (name, getattr(main, "__file__", None),
                               obj.__qualname__)
        return NotImplemented


def _ask(child: Child, request: dict) -> None:
    buffer = io.BytesIO()
    # Two pickles: the judge's path first, so that the worker can import the test folders collected since its
    # zygote started (which the request's functions are pickled by name from) before it reads the request.
    pickle.dump([p for p in sys.path if p], buffer)
    _Pickler(buffer).dump(request)
    child.conn.send_bytes(buffer.getvalue())
    if request["op"] == "unavailable":
        child.conn.recv_bytes(wire.MAX_BYTES)  # its acknowledgement


def _stop(children: list[Child]) -> None:
    """SIGKILL each child and what it started (its channel and files stay open: what it sent can still be read)."""
    for child in children:
        if child.is_live_child():
            for pid in TreeWatch([child.pid]).pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


def _kill(children: list[Child]) -> None:
    for child in children:
        try:
            child.conn.close()
        except OSError:
            pass
        child.close_files()
    _stop(children)
    for zygote in list(_workers.zygotes.values()):  # a spawner reaps its own children (kit.spawn.fresh)
        if isinstance(zygote, Spawner):
            zygote.poll_exits()


# ----------------------------------------------------------------------------------------------------
# One request: send, collect answers, enforce the limits
# ----------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What the processes of one request said: per process its final answer (``{"ok", "value"|"failure"}``),
    the checks it reported on the way (``{name: (ok, value or failure)}``), and how the request ended."""

    n: int
    finals: dict[int, dict] = field(default_factory=dict)
    checks: list[dict[str, tuple[bool, Any]]] = field(default_factory=list)
    died: dict[int, int | None] = field(default_factory=dict)  # process → exit code, for those without an answer
    errors_first: list[int] = field(default_factory=list)  # processes whose answer was a failure, in order
    limit: str = ""  # "", or what ran out: "cpu", "idle", "wall"
    limits: tuple[float, float, float] = (0.0, 0.0, 0.0)  # when it ran out: CPU spent, CPU budget, idle limit
    stacks: dict[int, str] = field(default_factory=dict)
    stderr: dict[int, list[str]] = field(default_factory=dict)
    cpu: float = 0.0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.checks = [{} for _ in range(self.n)]


def _forward(child: Child) -> None:
    """What a worker wrote to stdout and stderr reaches ours (pytest captures it per test) as it grows, once.
    Read through the judge's own descriptors of the worker's files, never by path (:mod:`.zygote`)."""
    for source, fd in ((child.stdout, 1), (child.stderr, 2)):
        done = child.forwarded.get(source, 0)
        data = child.read(source, done)
        if data:
            child.forwarded[source] = done + len(data)
            os.write(fd, data)


STDERR_TAIL_BYTES = 1 << 16  # the end of a dead worker's stderr that its report quotes (gloo's last words)


def stderr_tail(child: Child, lines: int = 8) -> list[str]:
    start = max(0, child.size(child.stderr) - STDERR_TAIL_BYTES)
    text = child.read(child.stderr, start, STDERR_TAIL_BYTES).decode(errors="replace")
    return [line for line in text.splitlines() if line.strip()][-lines:]


def _dump_stacks(children: list[Child], which: list[int]) -> dict[int, str]:
    """Each live process's Python stack (innermost call first), through the faulthandler it registered."""
    for r in which:
        if children[r].is_live_child():
            try:
                os.kill(children[r].pid, signal.SIGUSR1)
            except OSError:
                pass
    time.sleep(0.5)
    return {r: children[r].read(children[r].stacks, 0, STACK_BYTES).decode(errors="replace").strip() for r in which}


STACK_BYTES = 1 << 20  # a stack dump longer than this is a worker flooding its stack file: the start is enough


def _exit_code(child: Child) -> int | None:
    zygotes = list(_workers.zygotes.values())
    deadline = time.monotonic() + 1.0
    while zygotes and time.monotonic() < deadline:
        for zygote in zygotes:
            zygote.poll_exits()
            if child.pid in zygote.exit_codes:
                return zygote.exit_codes[child.pid]
        time.sleep(0.02)
    return None


def _decode(data: bytes) -> dict:
    try:
        message = wire.decode(data)
    except Exception as exc:  # noqa: BLE001 — anything a worker sends that is not data is its failure
        return {"ok": False, "failure": {"type": "NotData", "kind": "error", "traceback": "",
                                         "message": f"the worker sent something that is not data: {exc}"}}
    return message if isinstance(message, dict) else {"ok": False, "failure": {
        "type": "NotData", "kind": "error", "traceback": "", "message": "the worker sent a message that is not a dict"}}


def collect(children: list[Child], *, timeout: float, stop_early: bool = True) -> Outcome:
    """Wait for one final answer from each child, within the current test's limits and ``timeout``."""
    outcome = Outcome(len(children))
    pending = {child.conn: r for r, child in enumerate(children)}
    watch = TreeWatch([c.pid for c in children])
    budget = _allowance
    startup = sum(c.startup_cpu for c in children)  # fresh interpreters' imports (kit.spawn.fresh), once each
    for child in children:
        child.startup_cpu = 0.0
    stop_at = None
    while pending:
        for conn in wait(list(pending), timeout=POLL_S):
            r = pending[conn]
            try:
                message = _decode(conn.recv_bytes(wire.MAX_BYTES))
            except (EOFError, OSError):
                del pending[conn]
                outcome.died[r] = None
                continue
            if "check" in message:  # a check finished inside a rank: keep it whatever happens later
                name = wire.field(message, "check", str, "?")
                ok = message.get("ok") is True
                outcome.checks[r][name] = (ok, message.get("value") if ok else message.get("failure"))
                continue
            outcome.finals[r] = message
            del pending[conn]
            if message.get("ok") is not True:
                outcome.errors_first.append(r)
        for child in children:
            _forward(child)
        outcome.cpu = watch.sample()
        now = time.monotonic()
        if stop_early and stop_at is None and (outcome.errors_first or outcome.died) and pending:
            stop_at = now + GRACE_S  # the others' failures, usually consequences, for the message
        if stop_at is not None and now >= stop_at:
            break
        if pending:
            if budget.spent + outcome.cpu > budget.cpu + startup:
                outcome.limit = "cpu"
            elif watch.idle_for() > budget.idle:
                outcome.limit = "idle"
            elif watch.wall() > timeout or budget.wall_left() <= 0:
                outcome.limit = "wall"
            if outcome.limit:
                outcome.limits = (budget.spent + outcome.cpu, budget.cpu, budget.idle)
                outcome.stacks = _dump_stacks(children, sorted(pending.values()))
                break
    outcome.seconds = watch.wall()
    budget.spent += outcome.cpu
    # Answers that arrive in one poll come in no particular order: the failure sent first is the cause, the others
    # (a peer's "connection closed") its consequences.
    outcome.errors_first.sort(key=lambda r: wire.field(outcome.finals[r], "sent", float, float("inf")))
    for r in outcome.died:
        outcome.died[r] = _exit_code(children[r])
        outcome.stderr[r] = stderr_tail(children[r])
    for child in children:
        _forward(child)
    return outcome


# ----------------------------------------------------------------------------------------------------
# The two kinds of request
# ----------------------------------------------------------------------------------------------------


def spawn(fn: Callable[..., Any], world_size: int, backend: str, args: tuple, kwargs: dict,
          timeout: float, *, trusted: bool = False) -> Outcome:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks joined in one process group (``trusted``:
    reference ranks, which cannot load the implementation; see :func:`_zygote`)."""
    if _inline and not trusted:
        return _spawn_inline(fn, world_size, backend, args, kwargs)
    folder = Path(tempfile.mkdtemp(prefix="ranks-", dir=_scratch(trusted)))
    children: list[Child] = []
    try:
        for rank in range(world_size):
            children.append(_fork(f"rank{rank}", trusted))
        for rank, child in enumerate(children):
            _ask(child, {"op": "rank", "fn": fn, "args": args, "kwargs": kwargs, "rank": rank,
                         "world_size": world_size, "backend": backend, "folder": str(folder), "timeout": timeout})
        return collect(children, timeout=timeout)
    finally:
        _kill(children)
        shutil.rmtree(folder, ignore_errors=True)


def _spawn_inline(fn: Callable[..., Any], world_size: int, backend: str, args: tuple, kwargs: dict) -> Outcome:
    """:func:`spawn` with rank 0 in this process, in the foreground (:func:`set_inline`): ranks 1… start first, in
    workers, and are collected by a thread, which stops them if one fails (so that rank 0 is not left waiting in
    a collective). No limit applies: a person may be stepping through rank 0."""
    from .worker import peers_stopped, rank_inline

    folder = Path(tempfile.mkdtemp(prefix="ranks-", dir=_scratch()))
    children: list[Child] = []
    others: list[Outcome] = []
    request = {"op": "rank", "fn": fn, "args": args, "kwargs": kwargs, "world_size": world_size, "backend": backend,
               "folder": str(folder), "timeout": float("inf")}

    def collect_others() -> None:
        others.append(collect(children, timeout=float("inf")))
        if others[0].errors_first or others[0].died or others[0].limit:
            _kill(children)
            peers_stopped.set()  # rank 0 may be waiting for them between checks (kit.checks)

    def stop_others_when_the_debugger_quits() -> None:
        # A check may catch what quitting pdb raises and go on: rank 0 then waits for ranks in a collective it left.
        while thread.is_alive():
            if _debugger_quit():
                _stop(children)
                peers_stopped.set()
                return
            time.sleep(0.2)

    thread = threading.Thread(target=collect_others, name="kit-inline-ranks", daemon=True)
    try:
        for rank in range(1, world_size):
            children.append(_fork(f"rank{rank}"))
        for rank, child in enumerate(children, start=1):
            _ask(child, {**request, "rank": rank, "breakpoints": False})  # no terminal there: pdb would quit
        thread.start()
        threading.Thread(target=stop_others_when_the_debugger_quits, name="kit-inline-quit", daemon=True).start()
        final, checks = rank_inline({**request, "rank": 0})
        if final.get("ok") is not True:
            _stop(children)  # they may be waiting for rank 0 in a collective it left
    except BaseException:  # Ctrl-C, quitting the debugger
        _stop(children)
        raise
    finally:
        if thread.is_alive():
            thread.join()
        _kill(children)
        shutil.rmtree(folder, ignore_errors=True)
    _end_if_the_debugger_quit()
    outcome = Outcome(world_size)
    outcome.finals[0], outcome.checks[0] = final, checks
    rest = others[0] if others else Outcome(len(children))
    for r in range(1, world_size):
        if r - 1 in rest.finals:
            outcome.finals[r] = rest.finals[r - 1]
        outcome.checks[r] = rest.checks[r - 1]
        for mine, theirs in ((outcome.died, rest.died), (outcome.stacks, rest.stacks), (outcome.stderr, rest.stderr)):
            if r - 1 in theirs:
                mine[r] = theirs[r - 1]
        if r not in outcome.finals and r not in outcome.died:  # never answered (its collector itself failed)
            outcome.died[r] = None
    outcome.limit, outcome.limits, outcome.cpu, outcome.seconds = rest.limit, rest.limits, rest.cpu, rest.seconds
    outcome.errors_first = [r for r, final in outcome.finals.items() if final.get("ok") is not True]
    outcome.errors_first.sort(key=lambda r: wire.field(outcome.finals[r], "sent", float, float("inf")))
    return outcome


def call(fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, *, timeout: float = 600.0,
         op: str = "call") -> Outcome:
    """Run ``fn(*args, **kwargs)`` in this process's persistent worker (started on first use; replaced
    after it hung, ran away or died); inline (:func:`set_inline`), a call runs in this process."""
    if _inline and op == "call":
        from .worker import call_inline

        outcome = Outcome(1)
        outcome.finals[0] = call_inline(fn, tuple(args), dict(kwargs or {}))
        _end_if_the_debugger_quit()
        return outcome
    with _workers.lock:
        if _workers.worker is None:
            _workers.worker = _fork("worker")
        worker = _workers.worker
        request = {"op": op, "name": fn} if op == "import" else {"op": op, "fn": fn, "args": args,
                                                                   "kwargs": kwargs or {}}
        try:
            _ask(worker, request)
        except OSError:  # it died since its last request: a fresh one
            _kill([worker])
            _workers.worker = worker = _fork("worker")
            _ask(worker, request)
        outcome = collect([worker], timeout=timeout)
        if outcome.limit or outcome.died:
            _kill([worker])
            _workers.worker = None
        return outcome
