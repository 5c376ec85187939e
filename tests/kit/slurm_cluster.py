"""A SLURM cluster of two nodes on this one machine, started and stopped by a test (``make test-cluster``).

Debian's ``slurm-wlm`` runs two ``slurmd`` on one host when each has its own node name (``slurmd -N n1``), port,
spool folder and pid file, so the cluster has **two nodes**, ``n1`` and ``n2``, both reached at 127.0.0.1, each
claiming 32 CPUs and 8 GPUs (``SlurmdParameters=config_overrides`` lets a node claim more than the machine has;
the "GPUs" are eight links to ``/dev/null``: the CPU build of torch never opens them). A batch script written for
two 8-GPU nodes is then accepted as it is. Everything lives in one temporary folder: a private munge key and
socket (``AuthInfo=socket=…``), ``slurm.conf`` and ``gres.conf``, state, spool and logs; the daemons run in the
foreground as children of the test, marked like every process of :class:`launching.Processes`, and stop with it.
No system file is read or written. Needs root (``slurmd`` starts jobs as their user) and the packages
``slurm-wlm munge``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from launching import ROOT, Processes, Run, free_port

INSTALL = "apt-get install -y slurm-wlm munge"
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
DAEMONS = ("munged", "slurmctld", "slurmd", "slurmscriptd")  # what stays up between jobs
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}


def missing() -> list[str]:
    """What this machine lacks to run the cluster (empty when nothing)."""
    lacking = [p for p in PROGRAMS if shutil.which(p) is None]
    if os.geteuid() != 0:
        lacking.append("root (slurmd starts each job as its user)")
    return lacking


def _config(folder: Path, *, nodes: list[str], ports: dict[str, int], gpus: int, cpus: int) -> str:
    host = socket.gethostname().split(".")[0]
    lines = [
        "ClusterName=llmsys-test",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ports['slurmctld']}",
        f"SlurmdPort={ports['slurmd']}",
        "AuthType=auth/munge",
        f"AuthInfo=socket={folder}/munge/socket",
        "CredType=cred/munge",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={folder}/state",
        f"SlurmdSpoolDir={folder}/spool/%n",
        f"SlurmctldPidFile={folder}/slurmctld.pid",
        f"SlurmdPidFile={folder}/slurmd-%n.pid",
        f"SlurmctldLogFile={folder}/log/slurmctld.log",
        f"SlurmdLogFile={folder}/log/slurmd-%n.log",
        # No cgroups, no accounting daemon: what a container without systemd can run.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=2",
        "KillWait=5",  # seconds between SIGTERM and SIGKILL when a job ends badly
        "SlurmdParameters=config_overrides",
        "GresTypes=gpu",
    ]
    lines += [f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[n]} CPUs={cpus} Gres=gpu:{gpus} "
              "State=UNKNOWN" for n in nodes]
    lines.append(f"PartitionName=test Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


@dataclass
class Cluster:
    """A running cluster: ``submit`` a batch script, ``wait`` for the job, ``stop`` everything."""

    folder: Path
    procs: Processes
    nodes: list[str]
    daemons: list[Run] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a client command (and, through sbatch, of a job): marked, this cluster's config."""
        return self.procs.env(SLURM_CONF=str(self.conf), **extra)

    def command(self, *args: str, env: dict[str, str] | None = None, timeout: float = 30) -> str:
        proc = subprocess.run(list(args), cwd=ROOT, env=env or self.env(), capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}\n"
                                 + self.logs())
        return proc.stdout

    def logs(self, chars: int = 3000) -> str:
        parts = [run.tail(chars) for run in self.daemons]
        for log in sorted((self.folder / "log").glob("*.log")):
            parts.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def submit(self, script: Path, *, output: Path, env: dict[str, str], options: tuple[str, ...] = ()) -> int:
        """``sbatch`` ``script`` from the repository root with ``env`` added to the job's environment; the job id."""
        out = self.command("sbatch", "--parsable", f"--output={output}", *options, str(script), env=self.env(**env))
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields of the job."""
        text = self.command("scontrol", "show", "job", "-o", str(job_id))
        return dict(f.split("=", 1) for f in text.split() if "=" in f)

    def wait(self, job_id: int, *, timeout: float, pending_limit: float = 60) -> dict[str, str]:
        """Wait for the job to finish (any way); its fields. Fails at ``timeout``, or when it stays pending for
        ``pending_limit`` seconds (a request the cluster cannot meet), after cancelling it."""
        start = time.monotonic()
        while True:
            info = self.job(job_id)
            state = info.get("JobState", "?")
            if state in FINISHED:
                return info
            waited = time.monotonic() - start
            if waited > timeout or (state == "PENDING" and waited > pending_limit):
                subprocess.run(["scancel", str(job_id)], env=self.env(), capture_output=True, timeout=30)
                raise AssertionError(f"job {job_id} still {state} ({info.get('Reason')}) after {waited:.0f} s: "
                                     f"cancelled\n{self.logs()}")
            time.sleep(0.5)

    def job_processes(self) -> list[str]:
        """Marked processes that are not the cluster's daemons: what a finished job left behind."""
        return [p for p in self.procs.leftovers() if _program(p) not in DAEMONS]

    def stop(self) -> None:
        """Stop the daemons the way an administrator would (SIGTERM: they save state and exit), munged last."""
        for run in sorted(self.daemons, key=lambda r: r.name.startswith("munged")):
            if run.proc.poll() is None:
                try:
                    os.killpg(run.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    run.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(run.proc.pid, signal.SIGKILL)
                    run.proc.wait(timeout=10)


def start(folder: Path, procs: Processes, *, nodes: int = 2, gpus: int = 8, cpus: int = 32,
          timeout: float = 60) -> Cluster:
    """Write the configuration into ``folder``, start munged, slurmctld and one slurmd per node, and wait until
    every node is idle. Raises AssertionError (with the daemons' logs) when the cluster does not come up."""
    names = [f"n{i + 1}" for i in range(nodes)]
    for sub in ("munge", "state", "log", "dev", *(f"spool/{n}" for n in names)):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    key = folder / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    for i in range(gpus):
        (folder / "dev" / f"gpu{i}").symlink_to("/dev/null")
    ports = {"slurmctld": free_port(), "slurmd": free_port(), **{n: free_port() for n in names}}
    cluster = Cluster(folder, procs, names)
    cluster.conf.write_text(_config(folder, nodes=names, ports=ports, gpus=gpus, cpus=cpus))
    (folder / "gres.conf").write_text(f"NodeName={','.join(names)} Name=gpu File={folder}/dev/gpu[0-{gpus - 1}]\n")
    env = cluster.env()
    munge = folder / "munge"
    cluster.daemons.append(procs.start("munged", [
        "munged", "--foreground", "--force", f"--socket={munge}/socket", f"--key-file={key}",
        f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/seed", f"--log-file={munge}/munged.log"], env=env))
    deadline = time.monotonic() + timeout
    while not (munge / "socket").exists():
        if time.monotonic() > deadline or cluster.daemons[0].proc.poll() is not None:
            raise AssertionError(f"munged did not start\n{cluster.logs()}")
        time.sleep(0.1)
    cluster.daemons.append(procs.start("slurmctld", ["slurmctld", "-D", "-f", str(cluster.conf)], env=env))
    for n in names:
        cluster.daemons.append(procs.start(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", str(cluster.conf)], env=env))
    states: dict[str, str] = {}
    while states != dict.fromkeys(names, "idle"):
        if time.monotonic() > deadline or any(d.proc.poll() is not None for d in cluster.daemons):
            raise AssertionError(f"the cluster did not come up (nodes: {states or 'no answer'})\n{cluster.logs()}")
        time.sleep(0.5)
        sinfo = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%N %T"], env=env, capture_output=True,
                               text=True, timeout=30)  # fails until slurmctld listens
        words = sinfo.stdout.split() if sinfo.returncode == 0 else []
        states = dict(zip(words[::2], words[1::2]))
    return cluster


def _program(entry: str) -> str:
    """The program of a ``pid: command line`` entry (slurmctld's helper names itself ``: slurmscriptd``)."""
    words = entry.split(":", 1)[1].replace(":", " ").split()
    return os.path.basename(words[0]) if words else ""
