"""How a distributed entry point starts: under ``torchrun`` (any number of nodes), or alone on this machine.

Every distributed command of the kit — the Stage 6 trainer (``python -m student.parallel.train_4d``), the DDP,
ZeRO, FSDP, pipeline and 4D benchmarks, the whole-step leaderboard (``python -m kit leaderboard``) — runs either
way (``bench_collectives`` spawns its own ranks and refuses):

* **alone** (``python -m …``): this process spawns the ranks on this machine with
  :func:`kit.spawn.run_on_ranks` and is not one of them;
* **under a launcher** (``torchrun``, on one node or several; SLURM runs one ``torchrun`` per node): this process
  *is* one rank. Its rank and the world come from the launcher's environment — ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` — which :func:`launched` reads.

:func:`on_ranks` hides the difference: it returns every rank's value either way, so a benchmark's ``main``
is the same code in both cases (only rank 0 writes its tables: :func:`is_main`).

**Launched wrongly, it says so in seconds.** A launch the program cannot use raises :class:`LaunchError`
(the commands print its message and exit with status 2) *before* any rank waits for a peer: a world size the
program cannot use (a mesh whose axes do not multiply to ``WORLD_SIZE``), a ``RANK`` without the rendezvous
variables, ``srun`` starting several copies without ``torchrun`` (each would train alone). A rank whose peers
never come — a node not started, a wrong ``MASTER_ADDR`` — gives up after ``$LLMSYS_RENDEZVOUS_TIMEOUT``
seconds (default 120; collectives keep torch's own timeout) and names the address it waited at.
(``torchrun`` itself waits up to its ``--rdzv-conf join_timeout``, 600 s by default, for a node that never
joins, then exits.)

**Backend.** NCCL when this node has a CUDA device for each of its ranks (``LOCAL_WORLD_SIZE``), else gloo;
``LLMSYS_BACKEND=gloo|nccl`` decides instead (a CPU run on GPU nodes, say).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Launch", "LaunchError", "backend_for", "describe", "exit_on_launch_error", "is_main", "join", "launched",
           "leave", "on_ranks", "require_world_size", "world_size", "world_sizes"]

BACKEND_ENV = "LLMSYS_BACKEND"
RENDEZVOUS_TIMEOUT_ENV = "LLMSYS_RENDEZVOUS_TIMEOUT"
DEFAULT_RENDEZVOUS_TIMEOUT = 120.0
#: What torchrun sets in every rank it starts; RANK and WORLD_SIZE alone say "a launcher started me".
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
HOW_TO_LAUNCH = ("start every node's ranks with torchrun (torchrun --nnodes N --nproc-per-node G --rdzv-backend "
                 "c10d --rdzv-endpoint HEAD:PORT -m …), or run `python -m …` without a launcher to spawn the ranks "
                 "on this machine")


class LaunchError(RuntimeError):
    """This process was started in a way the program cannot use; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class Launch:
    """This rank as its launcher started it (read from the environment by :func:`launched`)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    nodes: int | None  # torchrun's GROUP_WORLD_SIZE; None when the launcher does not say
    torchrun: bool  # started by torchrun's agent (TORCHELASTIC_RUN_ID), not by hand


def _int_var(env: Mapping[str, str], name: str, minimum: int) -> int:
    value = env[name]
    try:
        number = int(value)
    except ValueError:
        raise LaunchError(f"${name} must be an integer, got {value!r}") from None
    if number < minimum:
        raise LaunchError(f"${name} must be ≥ {minimum}, got {number}")
    return number


def launched(environ: Mapping[str, str] | None = None) -> Launch | None:
    """This process's rank under a launcher, or ``None`` when no launcher started it (run alone).

    A launcher sets ``RANK`` and ``WORLD_SIZE``; a process with neither is alone. The kit's own spawned ranks
    (``KIT_RANK_FOLDER`` in their environment) are not a launcher's: they already belong to a process group.

    Raises:
        LaunchError: a launcher's variables are incomplete or inconsistent (a ``RANK`` without
            ``MASTER_ADDR``, a rank outside ``[0, WORLD_SIZE)``), or ``srun`` started several tasks without
            ``torchrun``: each would run the whole job alone.
    """
    env = os.environ if environ is None else environ
    if "KIT_RANK_FOLDER" in env:
        return None
    if "RANK" not in env and "WORLD_SIZE" not in env:
        tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
        if env.get("SLURM_STEP_ID") is not None and tasks and tasks.isdigit() and int(tasks) > 1:
            raise LaunchError(
                f"srun started this as task {env.get('SLURM_PROCID', '?')} of {tasks} without torchrun: each task "
                "would spawn and train its own ranks alone. Run one torchrun per node under srun (see "
                "student/parallel/train_4d.slurm), or a single task")
        return None
    missing = [name for name in LAUNCHER_VARS if name not in env]
    if missing:
        present = ", ".join(f"{n}={env[n]}" for n in LAUNCHER_VARS if n in env)
        raise LaunchError(
            f"{present} is set but not {', '.join('$' + n for n in missing)}: a rank needs all of "
            f"{', '.join('$' + n for n in LAUNCHER_VARS)} to find the others (the rendezvous). "
            f"{HOW_TO_LAUNCH[0].upper()}{HOW_TO_LAUNCH[1:]}")
    world = _int_var(env, "WORLD_SIZE", 1)
    rank = _int_var(env, "RANK", 0)
    if rank >= world:
        raise LaunchError(f"$RANK ({rank}) must be < $WORLD_SIZE ({world})")
    local_rank = _int_var(env, "LOCAL_RANK", 0)
    local_world = _int_var(env, "LOCAL_WORLD_SIZE", 1) if "LOCAL_WORLD_SIZE" in env else world
    port = _int_var(env, "MASTER_PORT", 1)
    nodes = _int_var(env, "GROUP_WORLD_SIZE", 1) if "GROUP_WORLD_SIZE" in env else None
    return Launch(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                  master_addr=env["MASTER_ADDR"], master_port=port, nodes=nodes,
                  torchrun="TORCHELASTIC_RUN_ID" in env)


def describe(launch: Launch) -> str:
    """How the job was launched, for a result's stamp: ``torchrun: 4 ranks, 2 node(s) × 2`` (``environment:`` when
    the variables were set by something other than torchrun's agent). The command alone does not say how many
    processes, on how many machines, ran it."""
    nodes = f", {launch.nodes} node(s) × {launch.local_world_size}" if launch.nodes else ""
    return f"{'torchrun' if launch.torchrun else 'environment'}: {launch.world_size} ranks{nodes}"


def world_size(requested: int | None, default: int, *, option: str) -> int:
    """How many ranks a command runs on: ``$WORLD_SIZE`` under a launcher, else ``requested or default``.

    ``option`` names the command-line option that sets ``requested`` (for the message).

    Raises:
        LaunchError: under a launcher, ``requested`` is given and is not ``$WORLD_SIZE``.
    """
    launch = launched()
    if launch is None:
        return requested or default
    if requested is not None and requested != launch.world_size:
        raise LaunchError(f"{option} {requested} asks for {requested} ranks, but the launcher started "
                          f"WORLD_SIZE={launch.world_size} (--nnodes × --nproc-per-node): leave out {option} "
                          f"under torchrun, or start {requested} ranks")
    return launch.world_size


def world_sizes(requested: list[int] | None, default: list[int], *, option: str) -> list[int]:
    """The rank counts a command that sweeps several runs: ``[$WORLD_SIZE]`` under a launcher (one process
    group, one world), else ``requested or default``.

    Raises:
        LaunchError: under a launcher, ``requested`` is given and is not ``[$WORLD_SIZE]``.
    """
    launch = launched()
    if launch is None:
        return list(requested or default)
    if requested and list(requested) != [launch.world_size]:
        raise LaunchError(f"{option} {' '.join(map(str, requested))}: under a launcher this command runs once, on "
                          f"the WORLD_SIZE={launch.world_size} ranks it started; leave out {option}, or launch once "
                          "per world size")
    return [launch.world_size]


def require_world_size(needed: int, what: str, launch: Launch) -> None:
    """Raise :class:`LaunchError` unless the launcher started exactly ``needed`` ranks (``what`` needs them)."""
    if launch.world_size != needed:
        nodes = f"{launch.nodes} node(s) × " if launch.nodes else ""
        raise LaunchError(
            f"{what} needs {needed} ranks, but the launcher started WORLD_SIZE={launch.world_size} "
            f"({nodes}{launch.local_world_size} per node; torchrun: --nnodes × --nproc-per-node). Start {needed} "
            f"ranks, or ask for {launch.world_size}")


def backend_for(launch: Launch | None, world: int) -> str:
    """``$LLMSYS_BACKEND`` if set, else NCCL when every rank on this node gets its own GPU, else gloo."""
    chosen = os.environ.get(BACKEND_ENV, "").strip().lower()
    if chosen:
        if chosen not in ("gloo", "nccl"):
            raise LaunchError(f"${BACKEND_ENV} must be gloo or nccl, got {chosen!r}")
        return chosen
    import torch

    per_node = launch.local_world_size if launch else world
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= per_node else "gloo"


def _rendezvous_timeout() -> float:
    value = os.environ.get(RENDEZVOUS_TIMEOUT_ENV, "")
    try:
        seconds = float(value) if value else DEFAULT_RENDEZVOUS_TIMEOUT
    except ValueError:
        raise LaunchError(f"${RENDEZVOUS_TIMEOUT_ENV} must be a number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise LaunchError(f"${RENDEZVOUS_TIMEOUT_ENV} must be > 0, got {value!r}")
    return seconds


def _is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (OSError, ValueError):
        return False


def join(launch: Launch, backend: str | None = None) -> str:
    """Join the launcher's process group as ``launch.rank``; return the backend. Idempotent.

    gloo gets one torch thread per rank (as :mod:`kit.spawn`'s ranks) and, when every rank is on this machine
    (one torchrun node, or a loopback ``MASTER_ADDR``), the loopback interface; NCCL gets the GPU ``LOCAL_RANK``. The
    rendezvous — every rank connecting to ``MASTER_ADDR:MASTER_PORT`` — is bounded by
    ``$LLMSYS_RENDEZVOUS_TIMEOUT`` seconds; collectives keep torch's default timeout.

    Raises:
        LaunchError: the other ranks did not all arrive in time (the message names the address).
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_backend()
    backend = backend or backend_for(launch, launch.world_size)
    if backend == "gloo":
        torch.set_num_threads(1)
        # gloo binds to the interface its hostname resolves to; with every rank on this machine (one torchrun
        # node, or a rendezvous on a loopback address as in the tests) that may be unreachable in a container,
        # and loopback always works. Across machines the hostname's interface is the right one.
        if "GLOO_SOCKET_IFNAME" not in os.environ and (launch.nodes == 1 or _is_loopback(launch.master_addr)):
            from kit.spawn.rank import default_gloo_interface

            default_gloo_interface()
    else:
        torch.cuda.set_device(launch.local_rank)
    timeout = _rendezvous_timeout()
    try:
        store, rank, world = next(dist.rendezvous("env://", rank=launch.rank, world_size=launch.world_size,
                                                  timeout=datetime.timedelta(seconds=timeout)))
    except (RuntimeError, TimeoutError, ValueError) as exc:  # DistStoreError, DistNetworkError: RuntimeErrors
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")
        raise LaunchError(
            f"did not meet the other ranks at MASTER_ADDR:MASTER_PORT = "
            f"{launch.master_addr}:{launch.master_port} within {timeout:g} s (${RENDEZVOUS_TIMEOUT_ENV}): {first}. "
            f"Every rank must be started, all with the same rendezvous address: {HOW_TO_LAUNCH}") from exc
    store.set_timeout(datetime.timedelta(minutes=30))  # the rendezvous is over: gloo's set-up waits as long as usual
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    return backend


def on_ranks(fn: Callable[..., Any], world: int, args: tuple = (), *, timeout: float = 600.0,
             backend: str | None = None, what: str = "this command") -> list[Any]:
    """``fn(*args)`` on every rank; returns the values by rank, wherever this process stands.

    Alone, spawns ``world`` ranks with :func:`kit.spawn.run_on_ranks` (``timeout``: its last-resort wall clock).
    ``backend`` defaults to :func:`backend_for`.
    Under a launcher, this process is one of the ranks: it checks that the launcher started ``world`` ranks,
    joins the process group, runs ``fn`` and gathers every rank's value (then leaves it: :func:`leave`). ``what`` names
    the command in messages.

    Raises:
        LaunchError: under a launcher, ``world`` is not ``$WORLD_SIZE``, or the rendezvous failed.
        kit.spawn.RankFailedError, kit.spawn.RankTimeoutError: alone, a rank failed or hung.
    """
    launch = launched()
    backend = backend or backend_for(launch, world)
    if launch is None:
        from kit.spawn import run_on_ranks

        return run_on_ranks(fn, world, args=args, timeout=timeout, backend=backend)
    import torch.distributed as dist

    require_world_size(world, what, launch)
    join(launch, backend)
    value = fn(*args)
    values: list[Any] = [None] * launch.world_size
    dist.all_gather_object(values, value)
    leave()
    return values


def leave() -> None:
    """Leave the process group cleanly, on every rank together (call it where every rank does).

    Objects that hold the group — a DDP wrapper with its hooks, a reference cycle — are collected first, so that
    destroying the group really closes its connections now rather than at interpreter exit; a barrier then makes
    sure no rank closes them while a peer is still in the last collective. (A rank that tore gloo down at exit,
    its peer still connected, died with "terminate called without an active exception" under torchrun.)
    """
    import gc

    import torch.distributed as dist

    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def is_main() -> bool:
    """Whether this process speaks for the job: rank 0 under a launcher, and always when run alone."""
    launch = launched()
    return launch is None or launch.rank == 0


class exit_on_launch_error(contextlib.ContextDecorator):  # noqa: N801 — a decorator's name, like contextlib's
    """Around a command's ``main`` (decorator or ``with``): a :class:`LaunchError` prints ``<command>: <message>``
    and exits with status 2.

    Every rank prints it (each node's log then says why its ranks stopped), prefixed with the rank when there is
    one; no traceback, since nothing is wrong with the code.
    """

    def __init__(self, command: str):
        self.command = command

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None or not issubclass(exc_type, LaunchError):
            return False
        rank = os.environ.get("RANK") if "KIT_RANK_FOLDER" not in os.environ else None
        where = f" (rank {rank} of {os.environ.get('WORLD_SIZE', '?')})" if rank is not None else ""
        print(f"{self.command}{where}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2)
