"""Launch a command under resource limits and a watchdog: ``python -m kit.grading.sandbox --memory-gb 8 -- CMD …``.

The grader starts every graded run through this launcher (in a new session, so the launcher leads the
run's process group) instead of ``preexec_fn``, which is unsafe when the grader runs several submissions
from threads. Limits apply to the command and everything it starts:

* address space (``RLIMIT_AS``) per process — skipped when CUDA is present, since the CUDA driver
  reserves far more virtual memory than it uses;
* size of any file written (``RLIMIT_FSIZE``), so megabytes of output cannot fill the disk;
* no core dumps.

With ``--grader-pid PID`` the launcher stays behind as a **watchdog**: it forks the command and waits for
it. If the grader dies — even by ``SIGKILL``, which it cannot catch — the watchdog notices within a
fraction of a second (its parent changes) and kills the whole run: its process group, every process
carrying the run's ``KIT_GRADING_ID`` marker, and the orphans re-parented to it (it is a child
subreaper). Polling the parent is deliberate: ``PR_SET_PDEATHSIG`` fires when the *thread* that forked
exits, and the grader forks from worker threads. The command itself gets ``PR_SET_PDEATHSIG`` towards the
single-threaded watchdog, so killing the watchdog kills the command too.

Where the kernel allows (root, or a delegated cgroup v2 subtree: :mod:`kit.spawn.contain`), the command runs in
a **cgroup of its own**, and everything it starts stays in it whatever it does (double forks, ``setsid``, an
empty environment, a main thread that exited while another runs, which ``/proc`` shows as a zombie). When the
command exits, or the grader dies, the watchdog kills the whole cgroup with ``cgroup.kill``, then sweeps the run
as above for anything outside it, and with ``--leftovers-file PATH`` writes how many processes it killed there.
Doing this in the watchdog, not the grader, is what attributes an orphan to the right submission: while the
watchdog lives, the run's orphans (even ones that cleared their environment) are its children, whereas the
grader, grading several submissions from threads, could not tell whose orphan it adopted.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import signal
import sys
import time
from collections.abc import Iterator

from kit import cuda_present

MARKER_ENV = "KIT_GRADING_ID"
KEY_FD_ENV = "KIT_GRADING_KEY_FD"  # the descriptor the grading log's key is read from (never the key itself)
POLL_S = 0.2
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def apply_limits(memory_gb: float | None, file_gb: float | None) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if file_gb:
        size = int(file_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    if memory_gb and not cuda_present():
        size = int(memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (size, size))


def prctl(option: int, value: int) -> None:
    """``prctl(2)`` on Linux; nothing elsewhere."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value)
        except OSError:
            pass


def alive(pid: int, state: str) -> bool:
    """Whether a process is running: not a zombie, or a zombie only in its main thread (a leader that left with the
    raw ``exit`` syscall while another thread runs shows ``Z`` and is alive)."""
    if state != "Z":
        return True
    try:
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:
        return False


def processes() -> Iterator[tuple[int, int, int, str, list[bytes]]]:
    """Every readable process as ``(pid, parent pid, process group, state, environment entries)``."""
    if not os.path.isdir("/proc"):
        return
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            yield int(entry), int(fields[1]), int(fields[2]), fields[0], environ
        except (OSError, IndexError, ValueError):
            continue


def _reap_children() -> dict[int, int]:
    """Collect every exited child without blocking: ``{pid: exit code, 128 + signal when killed}``."""
    done = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done[pid] = os.waitstatus_to_exitcode(status)
        done[pid] = 128 - done[pid] if done[pid] < 0 else done[pid]


def _kill_the_run(marker: bytes | None) -> int:
    """Kill everything of this run but the watchdog itself: its group, marked processes, adopted orphans.
    Returns how many processes were killed."""
    me, group, killed = os.getpid(), os.getpgrp(), 0
    for _ in range(20):  # orphans re-parent to the watchdog as their parents die: sweep until none is left
        found = 0
        for pid, ppid, pgrp, state, environ in processes():
            if pid != me and alive(pid, state) and (pgrp == group or ppid == me or (marker and marker in environ)):
                try:
                    os.kill(pid, signal.SIGKILL)
                    found += 1
                except OSError:
                    pass
        killed += found
        if not found:
            return killed
        time.sleep(0.05)
        _reap_children()
    return killed


def watch(command: list[str], grader_pid: int, memory_gb: float | None, file_gb: float | None,
          leftovers_file: str | None = None) -> int:
    """Run ``command`` in a child; return its exit code, or kill the run if the grader dies first.
    When the command exits, kill what it left running and write the count to ``leftovers_file``."""
    from kit.spawn.contain import Cgroup

    prctl(PR_SET_CHILD_SUBREAPER, 1)
    watchdog = os.getpid()
    grading_id = os.environ.get(MARKER_ENV)
    group, _ = Cgroup.create(f"kit-run-{grading_id or watchdog}")
    child = os.fork()
    if child == 0:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != watchdog:  # the watchdog died before prctl took effect
            os._exit(137)
        if group is not None and not group.add(os.getpid()):
            os._exit(126)  # a run that was to be contained never runs uncontained
        apply_limits(memory_gb, file_gb)
        os.execvp(command[0], command)
    key_fd = os.environ.get(KEY_FD_ENV)  # the grading log's key reached the command; the watchdog keeps no copy
    if key_fd and key_fd.isdigit():
        try:
            os.close(int(key_fd))
        except OSError:
            pass
    marker = f"{MARKER_ENV}={grading_id}".encode() if grading_id else None

    def kill_everything() -> int:
        killed = group.kill() if group is not None else 0
        return killed + _kill_the_run(marker)

    while True:
        exited = _reap_children()
        if child in exited:
            killed = kill_everything()
            if leftovers_file:
                with open(leftovers_file, "w") as f:
                    f.write(str(killed))
            return exited[child]
        if os.getppid() != grader_pid:
            kill_everything()
            return 137
        time.sleep(POLL_S)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kit.grading.sandbox")
    parser.add_argument("--memory-gb", type=float, default=None)
    parser.add_argument("--file-gb", type=float, default=None)
    parser.add_argument("--grader-pid", type=int, default=None, help="stay as a watchdog; kill the run if it dies")
    parser.add_argument("--leftovers-file", default=None,
                        help="with --grader-pid: write how many leftover processes were killed here")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command to run is required after --")
    if args.grader_pid:
        sys.exit(watch(command, args.grader_pid, args.memory_gb, args.file_gb, args.leftovers_file))
    apply_limits(args.memory_gb, args.file_gb)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
