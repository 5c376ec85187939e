"""Every distributed entry point under torchrun, across two nodes simulated on this machine — and launched wrongly.

Two ``torchrun`` processes are two nodes: each starts its own ranks (``--nnodes 2 --nproc-per-node N``) and they
meet through a c10d rendezvous on 127.0.0.1 (gloo), exactly as two machines would through the head node. With
c10d, torchrun orders the nodes by arrival (``--node-rank`` only serves the static rendezvous), so either
process may hold ranks 0…N-1; the mesh spans both either way. ``kit.launch`` is the code under test: it reads
the rank and world from torchrun's environment, checks them before any rank waits for a peer, and joins.

Each test's processes carry a marker (``launching.Processes``): a test checks that the launchers left nothing
running, and its teardown kills whatever remains. A run launched wrongly fails its test in seconds (a run that
exits non-zero stops the others), never at a timeout.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from launching import TORCHRUN, free_port

from kit import launch, leaderboard
from kit.impl import ENV_VAR
from kit.launch import LaunchError

PYTHON = sys.executable
# Rendezvous limits for the tests: a node or rank that never comes fails the run in seconds, not minutes.
JOIN = "join_timeout=60"


def torchrun_nodes(launches, module_args: list[str], *, nodes: int = 2, per_node: int = 2, name: str = "node",
                   env: dict[str, str] | None = None) -> list:
    """Start ``nodes`` torchrun agents for one job on this machine; return their runs (not yet waited for)."""
    port = free_port()
    cmd = [TORCHRUN, f"--nnodes={nodes}", f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={launches.marker}", f"--rdzv-conf={JOIN}",
           *module_args]
    run_env = launches.env(LLMSYS_BACKEND="gloo", LLMSYS_RENDEZVOUS_TIMEOUT="60", **(env or {}))
    return [launches.start(f"{name}{n}", cmd, env=run_env) for n in range(nodes)]


def json_line(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert len(lines) == 1, f"expected one JSON line from rank 0, found {len(lines)}:\n{output[-3000:]}"
    return json.loads(lines[0])


# --------------------------------------------------------------------------------------------------------------
# The Stage 6 trainer on two nodes equals the same configuration started by the kit's spawn helper.

TRAIN_ARGS = ["--dp", "1", "--tp", "2", "--pp", "2", "--ep", "1", "--steps", "3"]


def test_train_4d_on_two_torchrun_nodes_equals_the_spawn_helper(launches, impl) -> None:
    # tp2 × pp2 on 2 nodes × 2 ranks: tensor parallelism inside each node, the pipeline across the two (the
    # layout of train_4d.slurm); the activations and the loss broadcast cross between the nodes.
    t0 = time.monotonic()
    runs = launches.wait(torchrun_nodes(launches, ["-m", f"{impl.package}.parallel.train_4d", *TRAIN_ARGS]),
                         timeout=240)
    torchrun_s = time.monotonic() - t0
    launches.assert_none_left()
    printed = [r for r in runs if "{" in r.output]
    assert len(printed) == 1, "rank 0 alone prints the result:\n" + "\n".join(r.tail() for r in runs)
    got = json_line(printed[0].output)
    assert got["world_size"] == 4 and got["launcher"] == "torchrun", got

    module = impl.parallel.train_4d
    t0 = time.monotonic()
    spawned = module.train_on_ranks(module.config_from_args(TRAIN_ARGS), timeout=120)[0]
    spawn_s = time.monotonic() - t0
    # The same ranks (one torch thread each, gloo) run the same kernels and collectives in the same order,
    # whoever started them: the losses agree bit for bit.
    assert got["losses"] == spawned["losses"], (
        f"train_4d {' '.join(TRAIN_ARGS)}: losses under torchrun (2 nodes × 2 ranks) {got['losses']} differ from "
        f"the spawn helper's {spawned['losses']}")
    print(f"two torchrun nodes: {torchrun_s:.1f} s; the spawn helper: {spawn_s:.1f} s")


# --------------------------------------------------------------------------------------------------------------
# The DDP, ZeRO and FSDP benchmarks: rank and world from torchrun, one set of tables, written by rank 0.

# Every distributed benchmark built on kit.launch, with the table its --smoke run writes (CONTRIBUTING.md,
# "Distributed code"). The whole-step leaderboard writes an entry, not a table: its own test follows.
TORCHRUN_COMMANDS = {"bench_ddp": "ddp", "bench_zero": "zero", "bench_fsdp": "bench_fsdp", "bench_4d": "bench_4d",
                     "bench_pipeline": "bench_pipeline", "bench_context_parallel": "bench_context_parallel"}


@pytest.mark.parametrize("name", sorted(TORCHRUN_COMMANDS))
def test_benchmark_on_two_torchrun_nodes(name: str, launches, tmp_path) -> None:
    out, table = tmp_path / "out", TORCHRUN_COMMANDS[name]
    runs = launches.wait(torchrun_nodes(launches, ["-m", f"benchmarks.{name}", "--smoke", "--out", str(out)],
                                        per_node=1, name=name), timeout=240)
    launches.assert_none_left()
    written = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert written == [f"{table}.{suffix}" for suffix in ("csv", "json", "md", "png")], (
        f"{name} wrote {written}:\n" + "\n".join(r.tail() for r in runs))
    data = json.loads((out / f"{table}.json").read_text())
    # The world came from torchrun's environment, and the table says how the job was launched.
    assert data["environment"]["launcher"] == "torchrun: 2 ranks, 2 node(s) × 1", data["environment"]
    worlds = {row.get("world_size", row.get("p", 2)) for row in data["rows"]}  # bench_pipeline: p stages = ranks
    assert worlds == {2}, f"the rows' world {worlds} is not torchrun's WORLD_SIZE"
    printed = [r.name for r in runs if "|---|" in r.output]
    assert len(printed) == 1, f"rank 0 alone prints the table; printed by {printed}"
    if name in ("bench_zero", "bench_fsdp"):
        # The bytes each rank holds match the accounting for 2 ranks: the state really is sharded over both nodes.
        goals = {row.get("optimizer") or row.get("impl"): row["state_goal"] for row in data["rows"]}
        assert set(goals.values()) == {"met"}, goals


# --------------------------------------------------------------------------------------------------------------
# The whole-step leaderboard: the gate and the timing on torchrun's ranks, one entry, written by rank 0.

# The cpu task (2 ranks) with the fewest timed steps that still give a median and a spread: the gate is the task's.
LEADERBOARD = ["-m", "kit", "leaderboard", "--task", "cpu", "--warmup", "1", "--steps", "3"]


def test_leaderboard_on_two_torchrun_nodes(launches, impl, tmp_path) -> None:
    out = tmp_path / "entries"
    runs = launches.wait(torchrun_nodes(launches, [*LEADERBOARD, "--impl", impl.package, "--out", str(out)],
                                        per_node=1, name="leaderboard"), timeout=240)
    launches.assert_none_left()
    written = sorted(out.glob("*.json")) if out.exists() else []
    assert len(written) == 1, f"expected one entry, found {[p.name for p in written]}:\n" + "\n".join(
        r.tail() for r in runs)
    entry = json.loads(written[0].read_text())
    assert entry["gate"]["passed"], entry["gate"]["failures"]
    assert entry["environment"]["launcher"] == "torchrun: 2 ranks, 2 node(s) × 1", entry["environment"]
    assert entry["ranks"] == 2 and entry["timing"]["steps"] == 3 and len(entry["timing"]["times_s"]) == 3, entry
    assert entry["within_budget"] and entry["entry_sha256"] == leaderboard.entry_hash(entry)
    printed = [r.name for r in runs if "wrote " in r.output]
    assert len(printed) == 1, f"rank 0 alone prints and writes the entry; printed by {printed}"


def test_leaderboard_refuses_a_world_other_than_its_tasks(launches) -> None:
    # 2 nodes × 2 ranks = 4 for the cpu task's 2: every rank says so before the rendezvous, none gates or times.
    runs = launches.wait(torchrun_nodes(launches, [*LEADERBOARD, "--impl", "reference"], name="leaderboard"),
                         timeout=120, succeed=False)
    reported = []
    for run in runs:
        text = _failed_fast(run, "leaderboard (rank", "task 'cpu' runs on 2 ranks",
                            "WORLD_SIZE=4 (2 node(s) × 2 per node")
        if "exitcode: 2" in text:
            reported.append(run.name)
        else:
            # torchrun's own race, seen on a loaded machine: the agent that hosts the rendezvous store left first,
            # so this node's agent lost the store before printing its ranks' exit codes. Its ranks' refusal is
            # printed above all the same. On one host either agent may be the one that hosts the store (the first
            # to bind the port), so which node loses it is not fixed; the host's agent always reports (below).
            assert "RendezvousConnectionError" in text or "DistNetworkError" in text, (
                f"{run.name}: expected its ranks' 'exitcode: 2' in torchrun's summary:\n{run.tail()}")
        assert "gate:" not in text, "no rank gated:\n" + run.tail()
        assert '/kit/leaderboard/' not in text, "a launch error is a message, not a traceback:\n" + run.tail()
        assert run.seconds < 60, f"{run.name} took {run.seconds:.0f} s to refuse"
    assert reported, ("the agent hosting the rendezvous store reports its ranks' 'exitcode: 2'; no node did:\n"
                      + "\n".join(run.tail() for run in runs))
    launches.assert_none_left()


# --------------------------------------------------------------------------------------------------------------
# Launched wrongly: a clear message within seconds, exit status 2, nothing left running.

TRAIN_4D = ["-m", "reference.parallel.train_4d"]


def _failed_fast(run, *expected: str) -> str:
    text = run.output
    assert run.proc.returncode != 0, f"{run.name} should have failed:\n{run.tail()}"
    for part in expected:
        assert part in text, f"{run.name}: expected {part!r} in its output:\n{run.tail()}"
    return text


def test_train_4d_refuses_a_world_its_mesh_cannot_use(launches) -> None:
    # 2 nodes × 2 ranks = 4, but dp2 × tp2 × pp2 needs 8: every rank says so before waiting for anything.
    runs = launches.wait(torchrun_nodes(launches, ["-m", "reference.parallel.train_4d", "--dp", "2", "--tp", "2",
                                                   "--pp", "2"]), timeout=120, succeed=False)
    for run in runs:
        _failed_fast(run, "train_4d (rank", "--dp 2 --tp 2 --pp 2 --ep 1 --cp 1 (dp·tp·pp·ep·cp) needs 8 ranks",
                     "WORLD_SIZE=4 (2 node(s) × 2 per node")
        assert 'train_4d.py", line' not in run.output, "a launch error is a message, not a traceback:\n" + run.tail()
    launches.assert_none_left()


def test_a_rank_without_a_rendezvous_is_refused(launches) -> None:
    # RANK and WORLD_SIZE but no MASTER_ADDR/MASTER_PORT: started by hand, or by a launcher set up wrongly.
    env = launches.env(RANK="0", WORLD_SIZE="2")
    run = launches.run("train_4d", [PYTHON, *TRAIN_4D], env=env, timeout=120, succeed=False)
    _failed_fast(run, "train_4d (rank 0 of 2): RANK=0, WORLD_SIZE=2 is set but not $LOCAL_RANK, $MASTER_ADDR, "
                      "$MASTER_PORT", "torchrun")
    assert run.proc.returncode == 2
    launches.assert_none_left()


@pytest.mark.parametrize("name", ["bench_ddp", "bench_fsdp", "bench_zero"])
def test_a_benchmark_without_a_rendezvous_is_refused(name: str, monkeypatch, capsys) -> None:
    # The same check as above, in this process: it happens before anything starts.
    monkeypatch.setenv(ENV_VAR, os.environ.get(ENV_VAR, "reference"))  # main() sets it; restored after the test
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    module = __import__(f"benchmarks.{name}", fromlist=["main"])
    with pytest.raises(SystemExit) as info:
        module.main(["--smoke"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"{name} (rank 1 of 2): RANK=1, WORLD_SIZE=2 is set but not $LOCAL_RANK, $MASTER_ADDR, $MASTER_PORT" in err


@pytest.mark.parametrize("rank", [0, 1], ids=["rank0-hosts-nobody-comes", "rank1-nobody-hosts"])
def test_a_rank_whose_peers_never_come_gives_up(rank: int, launches) -> None:
    port = free_port()
    env = launches.env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), LLMSYS_RENDEZVOUS_TIMEOUT="2")
    run = launches.run("train_4d", [PYTHON, *TRAIN_4D, "--dp", "2", "--tp", "1", "--pp", "1"],
                       env=env, timeout=120, succeed=False)
    _failed_fast(run, f"did not meet the other ranks at MASTER_ADDR:MASTER_PORT = 127.0.0.1:{port} within 2 s")
    assert run.proc.returncode == 2
    launches.assert_none_left()


def test_a_node_that_never_joins_stops_torchrun(launches) -> None:
    # torchrun's own limit (here 3 s; 600 s by default): one node of two waits, gives up, and leaves nothing.
    port = free_port()
    cmd = [TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           "--rdzv-conf=join_timeout=3", "-m", "reference.parallel.train_4d", "--dp", "2", "--tp", "1", "--pp", "1"]
    run = launches.run("node0", cmd, timeout=120, succeed=False)
    _failed_fast(run, "RendezvousTimeoutError")
    launches.assert_none_left()


@pytest.mark.parametrize("name,argv", [("bench_fsdp", ["--world-size", "3"]),
                                       ("bench_zero", ["--world-sizes", "2", "3"]),
                                       ("bench_ddp", ["--world-size", "4"])])
def test_a_benchmark_asked_for_another_world_than_torchruns(name: str, argv: list[str], monkeypatch, capsys) -> None:
    # Checked before the rendezvous: the environment of rank 0 of 2 is enough (no peer, no torch process group).
    monkeypatch.setenv(ENV_VAR, os.environ.get(ENV_VAR, "reference"))  # main() sets it; restored after the test
    for var, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(var, value)
    module = __import__(f"benchmarks.{name}", fromlist=["main"])
    with pytest.raises(SystemExit) as info:
        module.main(["--smoke", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"{name} (rank 0 of 2): {argv[0]}" in err and "WORLD_SIZE=2" in err, err


def test_srun_without_torchrun_is_refused(monkeypatch, capsys) -> None:
    # `srun -N2 python -m …` (no torchrun): every task would spawn its own ranks and train alone.
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv(ENV_VAR, os.environ.get(ENV_VAR, "reference"))
    from benchmarks import bench_fsdp

    with pytest.raises(SystemExit) as info:
        bench_fsdp.main(["--smoke"])
    assert info.value.code == 2
    assert "srun started this as task 1 of 2 without torchrun" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------
# kit.launch reading the environment (no processes).

GOOD = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "head",
        "MASTER_PORT": "29500", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "job"}


def test_launched_reads_torchruns_environment() -> None:
    got = launch.launched(GOOD)
    assert got == launch.Launch(rank=3, world_size=4, local_rank=1, local_world_size=2, master_addr="head",
                                master_port=29500, nodes=2, torchrun=True)
    assert launch.launched({}) is None
    assert launch.launched({"SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"}) is None  # one srun task: alone
    assert launch.launched({**GOOD, "KIT_RANK_FOLDER": "/tmp/x"}) is None  # a kit.spawn rank is not torchrun's


@pytest.mark.parametrize("change,message", [
    ({"RANK": "4"}, r"\$RANK \(4\) must be < \$WORLD_SIZE \(4\)"),
    ({"WORLD_SIZE": "four"}, r"\$WORLD_SIZE must be an integer, got 'four'"),
    ({"MASTER_PORT": None}, r"is set but not \$MASTER_PORT"),
    ({"LOCAL_RANK": None, "MASTER_ADDR": None}, r"is set but not \$LOCAL_RANK, \$MASTER_ADDR"),
    ({"RANK": "-1"}, r"\$RANK must be ≥ 0, got -1"),
])
def test_launched_rejects_a_broken_environment(change: dict, message: str) -> None:
    env = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(LaunchError, match=message):
        launch.launched(env)


def test_world_size_and_backend_choice(monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv(launch.BACKEND_ENV, raising=False)
    assert launch.world_size(None, 2, option="--world-size") == 2
    assert launch.world_size(3, 2, option="--world-size") == 3
    assert launch.world_sizes(None, [2, 3], option="--world-sizes") == [2, 3]
    for var, value in GOOD.items():
        monkeypatch.setenv(var, value)
    assert launch.world_size(None, 2, option="--world-size") == 4
    assert launch.world_sizes(None, [2, 3], option="--world-sizes") == [4]
    with pytest.raises(LaunchError, match="--world-size 3 asks for 3 ranks, but the launcher started WORLD_SIZE=4"):
        launch.world_size(3, 2, option="--world-size")
    monkeypatch.setenv(launch.BACKEND_ENV, "nccl")
    assert launch.backend_for(launch.launched(), 4) == "nccl"
    monkeypatch.setenv(launch.BACKEND_ENV, "mpi")
    with pytest.raises(LaunchError, match="LLMSYS_BACKEND must be gloo or nccl, got 'mpi'"):
        launch.backend_for(launch.launched(), 4)
    monkeypatch.delenv(launch.BACKEND_ENV)
    if not os.path.exists("/dev/nvidiactl"):
        assert launch.backend_for(launch.launched(), 4) == "gloo"
