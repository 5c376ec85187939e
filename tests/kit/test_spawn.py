"""The multi-rank helper: results by rank, errors with the rank's traceback, timeouts, no orphans."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from kit.spawn import RankFailedError, RankTimeoutError, run_on_ranks


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


def test_tensors_come_back_after_the_ranks_exit() -> None:
    out = run_on_ranks(_big_tensor, 2, timeout=60)
    assert [t.shape for t in out] == [(1000, 1000)] * 2
    assert out[0].sum().item() == 0 and out[1].sum().item() == 1_000_000


def test_failing_rank_surfaces_its_traceback_quickly() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank one is broken on purpose") as info:
        run_on_ranks(_fail_on_rank_one, 2, timeout=60)
    assert "rank 1 of 2 failed" in str(info.value)
    assert time.monotonic() - start < 30, "a failing rank must not make the others wait for the timeout"


def test_hung_rank_times_out_with_its_stack() -> None:
    with pytest.raises(RankTimeoutError) as info:
        run_on_ranks(_hang_on_rank_zero, 2, timeout=15)
    assert "rank 0" in str(info.value) and "_hang_on_rank_zero" in str(info.value)


def test_rank_that_exits_without_reporting_fails_the_run() -> None:
    with pytest.raises(RankFailedError, match="exited with code 3"):
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
    with pytest.raises(ValueError, match="backend"):
        run_on_ranks(_report_pid, 1, backend="mpi")
    with pytest.raises(TypeError, match="fn must be callable"):
        run_on_ranks(42, 1)  # type: ignore[arg-type]
