"""The processes a grading run starts, and stopping all of them — after a run, or when the grader is told to.

Every run's child is launched through :mod:`kit.grading.sandbox` in its own session (so it leads a process group)
with a unique ``KIT_GRADING_ID`` in its environment, which everything it starts inherits. After the run
the grader kills the group, every process still carrying the marker, and every orphan re-parented to
the grader (it is a child subreaper). The marker starts with the grader's pid, so
``KIT_GRADING_ID=<pid>-…`` finds every process a given grader started.

On SIGTERM, SIGINT or SIGHUP (a scheduler's time limit, Ctrl-C, a closed terminal) :func:`on_interrupt`
kills every active run at once and sets :data:`INTERRUPTED`; the runs then return what they have with
status ``interrupted``, the batch writes its gradebook, and the command exits with 128 + the signal. A
second signal exits immediately. If the grader is killed outright (SIGKILL), the sandbox's watchdog kills
the run instead.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading

from kit.grading.sandbox import MARKER_ENV, PR_SET_CHILD_SUBREAPER, alive, prctl, processes

INTERRUPTED = threading.Event()
_signal_received: list[int] = []
_active: dict[int, str] = {}  # pid of each running sandbox → its grading id
_lock = threading.RLock()  # re-entrant: the signal handler runs on the main thread, which may hold it


def new_grading_id() -> str:
    return f"{os.getpid()}-{secrets.token_hex(8)}"


def become_subreaper() -> None:
    # Orphans of graded runs (daemonised ranks, setsid'd sleepers) are re-parented to the grader, which kills them.
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def start(cmd: list[str], *, cwd, env: dict, output, grading_id: str, pass_fds: tuple[int, ...] = ()
          ) -> subprocess.Popen:
    """Start a run's sandbox in a new session and remember it, so that an interruption can kill it."""
    with _lock:
        if INTERRUPTED.is_set():
            raise InterruptedError("grading was interrupted")
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=pass_fds)
        _active[proc.pid] = grading_id
    return proc


def stop(proc: subprocess.Popen, *, grace: float = 3.0) -> None:
    """Stop a run's whole process group: SIGTERM, then SIGKILL after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    proc.wait()
    with _lock:
        _active.pop(proc.pid, None)


def kill_leftovers(grading_id: str) -> int:
    """Kill every process started for this grading run (by its environment marker) and every orphan
    re-parented to the grader. Returns how many were killed."""
    me, killed = os.getpid(), 0
    marker = f"{MARKER_ENV}={grading_id}".encode()
    for pid, ppid, _, state, environ in processes():
        if pid == me:
            continue
        with _lock:
            orphan = ppid == me and pid not in _active
        if alive(pid, state) and (orphan or marker in environ):
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        if orphan:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
    return killed


def kill_all_active() -> None:
    """SIGKILL every running run's process group and marked processes (no grace: we are stopping)."""
    with _lock:
        runs = dict(_active)
    for pid, grading_id in runs.items():
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        kill_leftovers(grading_id)


def on_interrupt(signum: int, frame) -> None:
    """Signal handler: the first signal stops every run and lets the grader write what it has."""
    if INTERRUPTED.is_set():
        kill_all_active()
        os._exit(128 + signum)
    _signal_received.append(signum)
    with _lock:
        INTERRUPTED.set()  # under the lock, so that no run starts after the kill below
    kill_all_active()


def install_interrupt_handlers() -> None:
    """Stop cleanly on SIGTERM, SIGINT and SIGHUP (call from the main thread)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_interrupt)


def interrupted_exit_code() -> int | None:
    """128 + the signal that interrupted grading, or None if it was not interrupted."""
    return 128 + _signal_received[0] if _signal_received else None
