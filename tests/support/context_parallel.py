"""Stage 6, part 2 — context parallelism: what the public and hidden ring-attention tests share (handout 06b).

Both sides use it. The ranks draw a case's inputs (:func:`case_inputs`), run the implementation's ring attention on
their shard (:func:`run_case`) inside a process group that times out (:func:`cp_group`, :func:`guarded`: a deadlock
becomes a failure that says so) and, for the overlap test, record the order of communication and block attention
(:func:`block_marks` with :class:`kit.comm_log.CommLog`). The judge draws the same inputs and computes what the ranks'
data must be in float64 (:func:`expected_case`, with its own token positions, :func:`positions`) and reads the
recorded order (:func:`overlap_problems`). Nothing here imports the implementation.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kit.comm_log import Event
from kit.model import naive_attention

SECTION = {"shard": "handout 06b §1", "merge": "handout 06b §2", "ring": "handout 06b §3",
           "backward": "handout 06b §4", "zigzag": "handout 06b §5"}

# A ring whose ranks block (dist.send before dist.recv everywhere) waits for ever. Its process group times out
# after DEADLOCK_S seconds, and the check says "deadlock" instead of the harness's idle limit (30 s) stopping the
# spawn without naming the ring. A correct ring waits at most one block's attention for its peer (milliseconds here);
# 20 s leaves room for a rank descheduled for seconds on a loaded 2-core machine.
DEADLOCK_S = 20.0

BATCH_DIMS = (1, 2)  # (batch, heads) in front of (N, D): leading dimensions must pass through


# ------------------------------------------------------------------------------------------------------------------
# Cases and their inputs (both sides)
# ------------------------------------------------------------------------------------------------------------------


def case(name: str, seq_len: int, *, causal: bool, layout: str, head_dim: int = 16, seed: int = 0,
         logit_offset: float = 0.0, dtype: str = "float32") -> dict:
    """One ring-attention case, as data (ranks and judge build the same inputs from it)."""
    return {"name": name, "seq_len": seq_len, "causal": causal, "layout": layout, "head_dim": head_dim,
            "seed": seed, "logit_offset": logit_offset, "dtype": dtype}


def case_inputs(spec: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The full-sequence q, k, v and upstream gradient of a case (fp32, or the case's dtype rounded to fp32).

    ``logit_offset`` c adds a common c to every score: q and k get a first component √(c·√D), so q·k/√D gains c
    while the softmax (shift-invariant per row) stays that of the random part. c = 150 puts every row's
    log-sum-exp above 88.7, where e^lse overflows fp32: a merge without the max subtraction returns inf or NaN.
    """
    g = torch.Generator().manual_seed(1000 + spec["seed"])
    shape = (*BATCH_DIMS, spec["seq_len"], spec["head_dim"])
    q, k, v, grad_out = (torch.randn(shape, generator=g) for _ in range(4))
    if spec["logit_offset"]:
        a = math.sqrt(spec["logit_offset"] * math.sqrt(spec["head_dim"]))
        q[..., 0], k[..., 0] = a, a
    dtype = getattr(torch, spec["dtype"])
    return tuple(t.to(dtype) for t in (q, k, v, grad_out))  # type: ignore[return-value]


def positions(seq_len: int, cp: int, rank: int, layout: str) -> torch.Tensor:
    """The judge's own token positions of a rank (handout 06b §1, §5): contiguous n = N/cp; zig-zag chunks r and
    2cp−1−r of 2cp."""
    if layout == "contiguous":
        n = seq_len // cp
        return torch.arange(rank * n, (rank + 1) * n)
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c,
                                                                            (2 * cp - rank) * c)])


# ------------------------------------------------------------------------------------------------------------------
# In the ranks
# ------------------------------------------------------------------------------------------------------------------

_STATE: dict[str, Any] = {}


def cp_group():
    """A fresh process group over every rank whose operations time out after :data:`DEADLOCK_S` s (a group that
    timed out is broken for good, so each check makes its own)."""
    import torch.distributed as dist

    return dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=DEADLOCK_S))


def _deadlocked(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in ("Timed out", "timed out", "Connection closed",
                                                                     "pair closure"))


def guarded(check: Callable[[], Any]) -> Callable[[], Any]:
    """``check`` run so that a ring that hangs fails with a message that says deadlock, and the checks after it (whose
    ring would hang as well) are skipped on every rank at once."""
    import torch.distributed as dist

    def run() -> Any:
        # Every rank learns whether any rank saw a deadlock (the default group still works after a subgroup timed out).
        flag = torch.tensor([1.0 if _STATE.get("deadlock") else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            raise AssertionError("not run: an earlier check of this spawn deadlocked (see its failure: a ring of "
                                 f"blocking sends hangs) ({SECTION['ring']})")
        try:
            return check()
        except RuntimeError as exc:
            if not _deadlocked(exc):
                raise
            _STATE["deadlock"] = True
            raise AssertionError(
                f"deadlock: the ring's send/receive did not complete within {DEADLOCK_S:g} s (the process group "
                f"timed out: {str(exc).splitlines()[0][:160]}). In a ring every rank sends to the next while the "
                "previous sends to it; a blocking dist.send waits for a receive that its peer posts only after its "
                "own send returns, so it hangs at any cp. Post both with dist.isend/dist.irecv (or "
                "batch_isend_irecv) and wait afterwards, once: on gloo a second wait() on a send or receive that "
                f"already completed blocks too ({SECTION['ring']}). If another rank failed first, its error is the "
                "cause.") from None

    return run


def run_case(cp_module: Any, spec: dict, group: Any) -> dict:
    """This rank's shard of a case through ``cp_module.ring_attention``: its output and ∂L/∂q, ∂L/∂k, ∂L/∂v (with
    L = Σ o ∘ grad_out), all on its own positions."""
    import torch.distributed as dist

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    pos = positions(spec["seq_len"], cp, rank, spec["layout"])
    q, k, v, grad_out = (t.index_select(-2, pos) for t in case_inputs(spec))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o = cp_module.ring_attention(q, k, v, group, is_causal=spec["causal"], layout=spec["layout"])
    o.backward(grad_out)
    return {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@contextlib.contextmanager
def block_marks(package: str, log: Any) -> Iterator[None]:
    """While active, every call of the implementation's ``attention_forward_with_lse`` (wherever its modules bound
    it) adds the marks ``block start`` and ``block end`` to ``log``. Restored on exit."""
    api = sys.modules[f"{package}.flash_attention.api"]
    original = api.attention_forward_with_lse

    def recorded(*args: Any, **kwargs: Any) -> Any:
        log.mark("block start")
        try:
            return original(*args, **kwargs)
        finally:
            log.mark("block end")

    patched = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == package or name.startswith(package + ".")):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                patched.append((module, attr))
                setattr(module, attr, recorded)
    try:
        yield
    finally:
        for module, attr in patched:
            setattr(module, attr, original)


# ------------------------------------------------------------------------------------------------------------------
# In the judge
# ------------------------------------------------------------------------------------------------------------------


def expected_case(spec: dict, cp: int) -> list[dict]:
    """Per rank, the float64 single-process attention's output and gradients on that rank's positions."""
    q, k, v, grad_out = (t.double() for t in case_inputs(spec))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = naive_attention(q, k, v, is_causal=spec["causal"])  # the kit's softmax(q kᵀ/√D) v, here in float64
    o.backward(grad_out)
    out = []
    for rank in range(cp):
        pos = positions(spec["seq_len"], cp, rank, spec["layout"])
        out.append({name: t.index_select(-2, pos) for name, t in
                    (("o", o.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))})
    return out


RECEIVING = ("recv", "all_gather", "all_to_all", "broadcast", "scatter", "gather")


def overlap_problems(events: list[Event]) -> list[str]:
    """What is wrong with the order of one rank's forward, or ``[]``: every communication that *brings* K/V here (a
    receive, an all-gather, …) must be in flight — posted before, completed after — during at least one block's
    attention. A ring receiving block s+1 while attending block s does; so does an all-gather posted asynchronously
    before the local block and waited for after it. A receive posted and waited before any attention starts does
    not, nor does a blocking one."""
    starts = [i for i, e in enumerate(events) if e.kind == "mark" and e.label == "block start"]
    ends = [i for i, e in enumerate(events) if e.kind == "mark" and e.label == "block end"]
    blocks = list(zip(starts, ends))
    if not blocks:
        return ["no block's attention went through attention_forward_with_lse (the block interface, flash_attention/"
                "api.py): ring attention must run each block with the Stage 3 FlashAttention through it"]
    incoming = [i for i, e in enumerate(events) if e.kind == "collective" and e.op in RECEIVING]
    if not incoming:
        return ["no receive or all-gather brought K/V from another rank during the forward"]
    problems = []
    for i in incoming:
        if events[i].async_op is False:
            done = i
        else:
            done = next((j for j, e in enumerate(events) if e.kind == "wait" and e.target == i), len(events))
        if not any(i < start and end < done for start, end in blocks):
            problems.append(f"#{i} {events[i]} was posted at event {i} and completed at event {done}, with no "
                            "block's attention (block start … block end) in between")
    return problems
