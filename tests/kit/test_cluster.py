"""The kit's SLURM script, submitted with ``sbatch`` to a real SLURM: two nodes on this machine (``make test-cluster``).

:mod:`slurm_cluster` starts munged, slurmctld and two slurmd (nodes ``n1``, ``n2``, 32 CPUs and 8 "GPUs" each) in
a temporary folder. The test submits ``student/parallel/train_4d.slurm`` — the file a course submits, unchanged:
2 nodes, one task per node, 8 GPUs and 32 CPUs per node — with only the overrides its header lists (the
implementation, 2 ranks per node, a 4-rank mesh, 3 steps, gloo, a free rendezvous port, the output file). srun
starts a torchrun on each node, they meet at the first node's c10d rendezvous, and rank 0 writes the losses, which
must equal those of the same configuration started by the kit's spawn helper. What a real cluster adds — GPUs,
NCCL, a network between machines — is not tested here (README, "Running distributed on several machines").

Not part of ``make test``: it needs root and ``apt-get install -y slurm-wlm munge``. ``make test-cluster`` runs it
(``LLMSYS_TEST_CLUSTER=1``); CI installs the packages and runs it too.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import slurm_cluster
from launching import ROOT, Processes, free_port

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(os.environ.get("LLMSYS_TEST_CLUSTER") != "1",
                       reason="a local SLURM cluster: `make test-cluster` runs it (root, slurm-wlm, munge)"),
]

SCRIPT = ROOT / "student" / "parallel" / "train_4d.slurm"  # what a course submits (make student copies it)
MESH, TRAIN = "--dp 2 --tp 2 --pp 1 --ep 1", "--steps 3"  # dp across the two nodes, tp inside each


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    lacking = slurm_cluster.missing()
    if lacking:
        pytest.fail(f"make test-cluster needs {', '.join(lacking)}: as root, `{slurm_cluster.INSTALL}`")
    folder = tmp_path_factory.mktemp("slurm")
    procs = Processes(folder)
    try:
        t0 = time.monotonic()
        running = slurm_cluster.start(folder, procs)
        print(f"cluster up in {time.monotonic() - t0:.1f} s")
        yield running
        running.stop()
        procs.assert_none_left(after=15)  # the daemons and every job's processes are gone
    finally:
        procs.close()


def overrides(impl_package: str, **changes: str) -> dict[str, str]:
    return {"IMPL": impl_package, "NPROC_PER_NODE": "2", "MESH": MESH, "TRAIN": TRAIN, "LLMSYS_BACKEND": "gloo",
            "MASTER_PORT": str(free_port()), **changes}


def submit_and_wait(cluster, tmp_path, env: dict[str, str], timeout: float = 300) -> tuple[dict, str, float]:
    t0 = time.monotonic()
    job = cluster.submit(SCRIPT, output=tmp_path / "job-%j.out", env=env)
    info = cluster.wait(job, timeout=timeout)
    seconds = time.monotonic() - t0
    output = (tmp_path / f"job-{job}.out").read_text(errors="replace")
    # The job's processes (srun, torchrun, the ranks, slurmstepd) end with it.
    deadline = time.monotonic() + 15
    while (left := cluster.job_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"job {job} left processes behind:\n" + "\n".join(left)
    return info, output, seconds


def test_sbatch_runs_the_kits_script_on_two_nodes(cluster, impl, tmp_path) -> None:
    assert SCRIPT.read_bytes() == (ROOT / "reference" / "parallel" / "train_4d.slurm").read_bytes()
    info, output, seconds = submit_and_wait(cluster, tmp_path, overrides(impl.package))
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (
        f"job {info['JobId']}: {info['JobState']} (exit {info['ExitCode']})\n{output[-6000:]}\n{cluster.logs()}")
    assert info["NodeList"] == "n[1-2]" and info["NumNodes"] == "2", info
    assert "train_4d: 2 node(s) × 2 ranks, rendezvous at 127.0.0.1:" in output, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert len(lines) == 1, f"rank 0 alone prints one JSON line:\n{output[-3000:]}"
    got = json.loads(lines[0])
    assert got["world_size"] == 4 and got["launcher"] == "torchrun", got

    module = impl.parallel.train_4d
    expected = module.train_on_ranks(module.config_from_args([*MESH.split(), *TRAIN.split()]), timeout=120)[0]
    assert got["losses"] == expected["losses"], (
        f"train_4d {MESH} {TRAIN} under SLURM (2 nodes × 2 ranks): losses {got['losses']}, the spawn helper's "
        f"{expected['losses']}")
    print(f"sbatch → COMPLETED in {seconds:.1f} s")


def test_a_job_launched_wrongly_says_why_and_stops(cluster, impl, tmp_path) -> None:
    # 2 nodes × 2 ranks = 4, but dp2 × tp2 × pp2 needs 8: every rank says so, srun stops both nodes.
    env = overrides(impl.package, MESH="--dp 2 --tp 2 --pp 2 --ep 1")
    info, output, seconds = submit_and_wait(cluster, tmp_path, env, timeout=120)
    assert info["JobState"] == "FAILED", f"{info['JobState']}\n{output[-3000:]}"
    assert "--dp 2 --tp 2 --pp 2 --ep 1 --cp 1 (dp·tp·pp·ep·cp) needs 8 ranks, but the launcher started WORLD_SIZE=4 " \
           "(2 node(s) × 2 per node" in output, output[-3000:]
    print(f"sbatch → FAILED in {seconds:.1f} s, as it should")
