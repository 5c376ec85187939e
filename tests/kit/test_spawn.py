"""The multi-rank helper: results by rank, errors with the rank's traceback, timeouts, no orphans."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from kit.setup.portable import portable
from kit.spawn import RankFailedError, RankTimeoutError, parent, run_on_ranks


def _all_reduce_rank(scale: float) -> tuple[int, int, float, int]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), scale * t.item(), torch.get_num_threads()


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken on purpose")
    dist.barrier()  # rank 0 waits here for a rank that never comes


def _hang_on_rank_zero() -> None:
    if dist.get_rank() == 0:
        time.sleep(1000)


def _big_tensor() -> torch.Tensor:
    return torch.full((1000, 1000), float(dist.get_rank()))


def _report_pid() -> int:
    return os.getpid()


def _sizes_disagree() -> None:
    dist.all_reduce(torch.ones(3 if dist.get_rank() == 0 else 5))  # gloo aborts the process


def _say_on_stderr() -> None:
    print(f"rank {dist.get_rank()} says hello on stderr", file=sys.stderr, flush=True)


def _exit_hard() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def test_results_come_back_by_rank() -> None:
    out = run_on_ranks(_all_reduce_rank, 3, args=(2.0,), timeout=60)
    assert [r[0] for r in out] == [0, 1, 2]
    assert all(r[1] == 3 for r in out)
    assert all(r[2] == 2.0 * (1 + 2 + 3) for r in out)
    assert all(r[3] == 1 for r in out), "each rank must run one thread"


def _warm_modules() -> list[bool]:
    return ["torch._dynamo" in sys.modules, "torch.optim" in sys.modules]


@pytest.mark.skipif(portable(), reason="the portable path starts fresh interpreters: no zygote preloads for them")
def test_ranks_start_with_the_optimizers_imported() -> None:
    # A process's first optimizer imports torch._dynamo (2.4 s of CPU per rank on 2 cores): the zygote pays it once.
    assert run_on_ranks(_warm_modules, 2, timeout=60) == [[True, True]] * 2


def test_tensors_come_back_after_the_ranks_exit() -> None:
    out = run_on_ranks(_big_tensor, 2, timeout=60)
    assert [t.shape for t in out] == [(1000, 1000)] * 2
    assert out[0].sum().item() == 0 and out[1].sum().item() == 1_000_000


def test_failing_rank_surfaces_its_traceback_quickly() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_fail_on_rank_one, 2, timeout=60)
    lines = str(info.value).splitlines()
    # The rank's own message first: pytest's one-line summary keeps only the first line.
    assert lines[0] == "rank 1 of 2 failed: ValueError: rank one is broken on purpose"
    assert (info.value.rank, info.value.error_type) == (1, "ValueError")
    assert "in _fail_on_rank_one" in str(info.value), "the rank's traceback follows"
    assert "kit/spawn" not in str(info.value), "without the kit's own frames"
    assert time.monotonic() - start < 30, "a failing rank must not make the others wait for the timeout"


@pytest.fixture
def allowance():
    """Limits for this test's workers, as the grading plugin sets them (restored afterwards)."""
    previous = parent.allowance()
    yield lambda **limits: parent.set_allowance(parent.Allowance(**limits))
    parent.set_allowance(previous)


def test_blocked_rank_is_stopped_when_it_makes_no_progress(allowance) -> None:
    allowance(idle=3.0)
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        run_on_ranks(_hang_on_rank_zero, 2, timeout=300)
    first = str(info.value).splitlines()[0]
    assert first.startswith("ranks [0] of 2 made no progress for 3 s"), first
    assert "Stopped at: rank 0 at " in first and "test_spawn.py, line" in first and "in _hang_on_rank_zero" in first, (
        "where it was stuck, in one line")
    assert "<frozen importlib" not in str(info.value)
    assert time.monotonic() - start < 60, "the idle limit, not the wall clock, stopped it"


def _spin_on_rank_one() -> None:
    if dist.get_rank() == 1:
        while True:
            pass
    dist.barrier()


def test_spinning_rank_is_stopped_by_its_cpu_budget(allowance) -> None:
    allowance(cpu=2.0)
    with pytest.raises(RankTimeoutError) as info:
        run_on_ranks(_spin_on_rank_one, 2, timeout=300)
    first = str(info.value).splitlines()[0]
    assert "CPU-seconds, more than its budget of 2.0" in first and "in _spin_on_rank_one" in first, first


def test_wall_clock_is_the_last_resort(allowance) -> None:
    allowance()  # no CPU budget, no idle limit in force beyond the default: only the wall clock stops a spin
    parent.allowance().idle = float("inf")
    with pytest.raises(RankTimeoutError, match=r"did not finish within 3 s of wall-clock time"):
        run_on_ranks(_spin_on_rank_one, 2, timeout=3)


def _sleep_then_work(seconds: float) -> float:
    time.sleep(seconds)  # blocked, but for less than the idle limit
    return float(torch.ones(100, 100).sum())


def test_waiting_is_not_spinning(allowance) -> None:
    # A CPU budget far below the wall time: a rank that mostly waits (a busy machine, a short sleep) never
    # meets it, since waiting uses no CPU.
    allowance(cpu=2.0, idle=10.0)
    assert run_on_ranks(_sleep_then_work, 2, args=(4.0,), timeout=60) == [10_000.0, 10_000.0]


class _NotData:
    pass


def _return_an_object() -> _NotData:
    return _NotData()


def test_a_rank_returns_data_only() -> None:
    with pytest.raises(RankFailedError, match=r"is a test_spawn\._NotData: a check returns data only"):
        run_on_ranks(_return_an_object, 1, timeout=60)


def test_collective_mismatch_quotes_gloo() -> None:
    # gloo kills the process (SIGABRT) and explains on stderr only; the error must carry the explanation.
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_sizes_disagree, 2, timeout=60)
    first = str(info.value).splitlines()[0]
    assert "was killed by SIGABRT without reporting" in first and "collective mismatch" in first, first


def test_rank_stderr_reaches_the_parent(capfd) -> None:
    run_on_ranks(_say_on_stderr, 2, timeout=60)
    err = capfd.readouterr().err
    assert "rank 0 says hello on stderr" in err and "rank 1 says hello on stderr" in err


def test_rank_that_exits_without_reporting_fails_the_run() -> None:
    with pytest.raises(RankFailedError, match="^rank 1 of 2 exited with code 3 without reporting"):
        run_on_ranks(_exit_hard, 2, timeout=60)


def test_no_orphans_left_behind() -> None:
    pids = run_on_ranks(_report_pid, 2, timeout=60)
    time.sleep(0.5)
    for pid in pids:
        alive = True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            alive = False
        if alive:  # a zombie still answers kill(0); check its state
            with open(f"/proc/{pid}/stat") as f:
                alive = f.read().split()[2] != "Z"
        assert not alive, f"rank process {pid} is still running after run_on_ranks returned"


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_on_ranks(_report_pid, 0)
    with pytest.raises(TypeError, match="world_size"):
        run_on_ranks(_report_pid, True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        run_on_ranks(_report_pid, 1, timeout=0)
    with pytest.raises(ValueError, match="backend"):
        run_on_ranks(_report_pid, 1, backend="mpi")
    with pytest.raises(TypeError, match="fn must be callable"):
        run_on_ranks(42, 1)  # type: ignore[arg-type]


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat") or not hasattr(os, "sched_setaffinity"),
                    reason="needs Linux's /proc/PID/schedstat and CPU affinity")
def test_a_starved_process_is_progressing_and_a_sleeping_one_is_not() -> None:
    """Tell a hang from a machine that starves the worker: a spinner at nice 19 sharing one core with two nice-0
    hogs gets about 1 % of the core (under the 2 % that counts as working) but is runnable all the time; a sleeper
    uses nothing and waits for no core."""
    import subprocess

    from kit.spawn.watch import MIN_RATE, WINDOW_S, TreeWatch

    core = sorted(os.sched_getaffinity(0))[0]
    spin = [sys.executable, "-c", "while True: pass"]
    hogs = [subprocess.Popen(spin, preexec_fn=lambda: os.sched_setaffinity(0, {core})) for _ in range(2)]
    starved = subprocess.Popen(spin, preexec_fn=lambda: (os.sched_setaffinity(0, {core}), os.nice(19)))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watches = {"starved": TreeWatch([starved.pid]), "sleeper": TreeWatch([sleeper.pid])}
        end = time.monotonic() + 2.5 * WINDOW_S
        while time.monotonic() < end:
            cpu = {name: w.sample() for name, w in watches.items()}
            time.sleep(0.25)
        wall = watches["starved"].wall()
        assert watches["starved"].idle_for() < 1.0, (
            f"a starved spinner ({cpu['starved']:.2f} CPU-s in {wall:.1f} s) was judged idle")
        assert watches["sleeper"].idle_for() > WINDOW_S, "a sleeping process was judged to make progress"
        # The first test alone would have called the spinner blocked when its share is below MIN_RATE: say so.
        print(f"starved spinner: {cpu['starved'] / wall:.3f} of a core (MIN_RATE {MIN_RATE})")
    finally:
        for p in (*hogs, starved, sleeper):
            p.kill()
            p.wait()
