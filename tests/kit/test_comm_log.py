"""The collective recorder: every c10d collective, however it is called, its waits and marks, in order."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from kit.comm_log import CommLog, Event, events_from_data
from kit.spawn import run_on_ranks


def _record() -> list[dict]:
    sub = dist.new_group([1, 2])  # every rank calls new_group, members or not
    t = torch.ones(6)  # 24 bytes
    layer = nn.Linear(4, 2)  # weight: 8 floats = 32 bytes
    with CommLog() as log:
        dist.all_reduce(t)  # synchronous: async_op=False, waited at once inside torch
        work = dist.all_reduce(t, dist.ReduceOp.SUM, None, True)  # async_op positional
        log.mark("launched positional")
        work.wait()
        dist.all_reduce(t, async_op=True).wait()  # async_op by keyword

        def hook(p: torch.Tensor) -> None:
            log.mark("grad ready: weight")
            dist.all_reduce(p.grad, async_op=True)

        layer.weight.register_post_accumulate_grad_hook(hook)
        layer(torch.ones(3, 4)).sum().backward()  # the hook's all-reduce is issued from autograd
        log.mark("backward returned")
        if dist.get_rank() in (1, 2):
            dist.broadcast(torch.zeros(2, dtype=torch.float64), src=1, group=sub)  # 16 bytes, subgroup
        out = torch.empty(3 * 5)
        dist.all_gather_single(out, torch.ones(5))  # hands in 20 bytes, receives 60
    dist.all_reduce(t)  # after the log closed: not recorded
    return log.as_data()


def test_sees_every_collective_its_waits_and_marks() -> None:
    per_rank = [events_from_data(data) for data in run_on_ranks(_record, 3, timeout=120)]
    for rank, events in enumerate(per_rank):
        text = ", ".join(map(str, events))
        collectives = [e for e in events if e.kind == "collective"]
        subgroup = [("broadcast", 16, False)] if rank else []
        expected = [("all_reduce", 24, False), ("all_reduce", 24, True), ("all_reduce", 24, True),
                    ("all_reduce", 32, True), *subgroup, ("all_gather", 20, False)]
        assert [(e.op, e.nbytes, e.async_op) for e in collectives] == expected, f"rank {rank}: {text}"
        groups = [e.group for e in collectives]
        assert groups == [(0, 1, 2)] * 4 + ([(1, 2)] if rank else []) + [(0, 1, 2)], f"rank {rank}: {text}"
        # Order: the positional async all-reduce, then the mark, then its wait (pointing back at it).
        labels = [str(e) if e.kind != "collective" else f"#{i}" for i, e in enumerate(events)]
        assert labels[:7] == ["#0", "wait(all_reduce #0)", "#2", "launched positional", "wait(all_reduce #2)",
                              "#5", "wait(all_reduce #5)"], f"rank {rank}: {text}"
        # The hook's collective comes after its mark and before backward returned: seen from autograd.
        hook = next(i for i, e in enumerate(events) if e.kind == "mark" and e.label == "grad ready: weight")
        assert events[hook + 1].op == "all_reduce" and events[hook + 1].nbytes == 32, f"rank {rank}: {text}"
        assert events[hook + 2].label == "backward returned", f"rank {rank}: {text}"


def test_bytes_by_op_and_format() -> None:
    log = CommLog()
    log.events += [Event("collective", "all_reduce", 8, (0, 1), True), Event("collective", "all_reduce", 4, (0,), True),
                   Event("collective", "send", 16, (0, 1)), Event("mark", label="done"),
                   Event("wait", "all_reduce", target=0)]
    assert log.bytes_by_op() == {"all_reduce": 8, "send": 16}, "a one-rank group moves nothing"
    assert log.bytes_by_op(min_group_size=1) == {"all_reduce": 12, "send": 16}
    assert [e.op for e in log.collectives("all_reduce")] == ["all_reduce"] * 2
    assert log.format() == ("#0 all_reduce(8 B, async, group [0, 1]), #1 all_reduce(4 B, async, group [0]), "
                            "#2 send(16 B, group [0, 1]), done, wait(all_reduce #0)")


def _complete_every_way() -> dict[str, str]:
    """One async all-reduce (or two) completed by each idiom a correct DDP may use."""
    ways = {
        "Work.wait": lambda: dist.all_reduce(torch.ones(3), async_op=True).wait(),
        "future.wait": lambda: dist.all_reduce(torch.ones(3), async_op=True).get_future().wait(),
        "then().wait": lambda: dist.all_reduce(torch.ones(3), async_op=True).get_future().then(
            lambda f: f.value()[0] / 2).wait(),
        "wait_all": lambda: torch.futures.wait_all(
            [dist.all_reduce(torch.ones(3), async_op=True).get_future() for _ in range(2)]),
        "collect_all": lambda: torch.futures.collect_all(
            [dist.all_reduce(torch.ones(3), async_op=True).get_future() for _ in range(2)]).wait(),
        "functional wait_tensor": lambda: funcol.wait_tensor(funcol.all_reduce(torch.ones(3), "sum", dist.group.WORLD)),
        "never waited": lambda: dist.all_reduce(torch.ones(3), async_op=True),
    }
    seen = {}
    for name, complete in ways.items():
        with CommLog() as log:
            complete()
        seen[name] = log.format()
    dist.barrier()  # the unwaited one completes before the ranks leave
    return seen


def test_every_way_of_completing_a_collective_is_a_wait_on_it() -> None:
    seen = run_on_ranks(_complete_every_way, 2, timeout=120)[0]
    one, two = "#0 all_reduce(12 B, async, group [0, 1])", "#1 all_reduce(12 B, async, group [0, 1])"
    for name in ("Work.wait", "future.wait", "then().wait", "functional wait_tensor"):
        assert seen[name] == f"{one}, wait(all_reduce #0)", f"{name}: {seen[name]}"
    for name in ("wait_all", "collect_all"):
        assert seen[name] == f"{one}, {two}, wait(all_reduce #0), wait(all_reduce #1)", f"{name}: {seen[name]}"
    assert seen["never waited"] == one, "a collective nobody completed has no wait"
