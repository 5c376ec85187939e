"""A run: the gate, then the timing (CS336's protocol), from empty compilation caches, within the task's budget;
alone (the ranks spawned here) or under a launcher (this process one of the ranks). Returns the entry."""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .entries import entry_hash, files_hash
from .gate import GateResult, _verdict, gate, naive_reference
from .steps import impl_builder, record_steps
from .tasks import FORMAT, Task, batches, rows, step_config


def _launched_rank(task: Task, options: dict[str, Any], builder: Callable[[dict, Any], Any],
                   log: Callable[[str], None]) -> tuple[GateResult, dict | None]:
    """Under a launcher, in every rank (the process group joined once, by :func:`kit.launch.on_ranks`): the gate,
    then — if rank 0's verdict lets it through — the timing. Returns ``(verdict, this rank's timing or None)``.

    The gate's records go to rank 0, which computes the naive step and compares (:func:`gate`'s work, done in a
    rank: there is no other process), then broadcasts its verdict so that every rank times or none does. A step
    that raises on every rank (a stub, a bad option) fails the gate with its message; one that raises on some
    ranks only, mid-collective, leaves its peers waiting until torchrun stops them."""
    import traceback

    import torch.distributed as dist

    start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    config = step_config(task, options, gate=True)
    data = batches(config["model"], task.gate_batch, task.gate_steps)
    try:
        record: dict[str, Any] = record_steps(builder, config, data)
    except Exception as exc:  # noqa: BLE001 — the student's step failing is a verdict, not a crash
        record = {"error": f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"}
    records: list[Any] = [None] * world
    dist.all_gather_object(records, record)
    verdict: list[Any] = [None]
    if rank == 0:
        reference = naive_reference(config, data, shards=world)
        errors = [r["error"] for r in records if "error" in r]
        verdict[0] = (_verdict(task, config, reference, None, f"the step did not run: {errors[0][:3000]}", start)
                      if errors else _verdict(task, config, reference, records, None, start))
    dist.broadcast_object_list(verdict, src=0)
    result: GateResult = verdict[0]
    if not result.passed:
        return result, None
    log(f"gate passed in {result.seconds:.1f} s; timing {task.warmup} warm-up + {task.steps} steps")
    try:
        timing = _time_rank(builder, step_config(task, options, gate=False), task)
    except Exception as exc:  # noqa: BLE001 — idem: an entry that says why it has no time
        timing = {"error": f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"}
    return result, timing


def _time_rank(builder: Callable[[dict, Any], Any], config: dict[str, Any], task: Task) -> dict:
    """In a rank: build the task's step, warm up, time ``task.steps`` steps (the slowest rank's time each)."""
    import resource

    import torch
    import torch.distributed as dist

    from kit.bench import step_time

    rank, world = dist.get_rank(), dist.get_world_size()
    step = builder(config, dist.group.WORLD)
    cuda = config.get("device") == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    data = batches(config["model"], task.batch, 1, seed=7)[0]
    x, y = rows(data[0], rank, world), rows(data[1], rank, world)
    losses = [step(x, y) for _ in range(task.warmup)]
    times = [step_time(lambda: losses.append(step(x, y))) for _ in range(task.steps)]
    if cuda:
        peak, kind = torch.cuda.max_memory_allocated() / 2**20, "torch.cuda.max_memory_allocated"
    else:
        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "max RSS of the rank (torch included)"
    return {"times": times, "peak_mib": peak, "memory_kind": kind, "losses": losses,
            "device_name": torch.cuda.get_device_name() if cuda else "CPU"}


def _spread(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return {"median_s": statistics.median(times), "iqr_s": q[2] - q[0], "min_s": min(times), "max_s": max(times)}


def run_entry(task: Task, *, kind: str = "student", options: dict[str, Any] | None = None,
              builder: Callable[[dict, Any], Any] = impl_builder, name: str | None = None,
              code: Path | None = None, warmup: int | None = None, steps: int | None = None,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Gate, then time, ``task`` with ``options``; return the entry (not yet written). ``kind`` is ``student``,
    ``reference`` or ``naive``; ``code`` the folder whose ``.py`` files are hashed.

    Alone, the gate's and the timing's ranks are spawned here. Under a launcher this process is one of the ranks
    (:func:`_launched_rank`, one process group for both); every rank returns the entry, with rank 0's verdict,
    and only rank 0 logs (and, in :func:`main`, writes it)."""
    from kit.flops import peak_flops, transformer_flops
    from kit.launch import describe, is_main, launched, on_ranks
    from kit.results import environment
    from kit.spawn import RankFailedError, RankTimeoutError, run_on_ranks

    launch = launched()
    if launch is not None and not is_main():
        log = _silent

    options = dict(options or {})
    if warmup is not None or steps is not None:
        task = Task(**{**task.__dict__, "warmup": task.warmup if warmup is None else warmup,
                       "steps": task.steps if steps is None else steps})
    start = time.perf_counter()
    entry: dict[str, Any] = {"format": FORMAT, "task": task.name, "kind": kind, "name": name or kind,
                             "options": options, "config": step_config(task, options, gate=False),
                             "ranks": task.world, "global_batch": task.batch,
                             "threads_per_rank": 1 if task.device == "cpu" else None}
    with _empty_compile_caches():
        log(f"gate: {task.gate_steps} steps of the small instance on {task.world} rank(s), against the naive step")
        if launch is None:
            result = gate(task, options, builder, timeout=task.budget_s)
        else:
            ranks = on_ranks(_launched_rank, task.world, args=(task, options, builder, log),
                             backend="nccl" if task.device == "cuda" else "gloo", what=f"leaderboard task {task.name}")
            result = ranks[0][0]
        entry["gate"] = result.as_dict()
        if not result.passed:
            log("gate FAILED — no timing:\n  " + "\n  ".join(result.failures))
        elif launch is not None:  # timed already, in the same process group
            timings = [timing for _, timing in ranks]
            timing = next((t for t in timings if "error" in t), timings[0])
        else:
            log(f"gate passed in {result.seconds:.1f} s; timing {task.warmup} warm-up + {task.steps} steps")
            left = task.budget_s - (time.perf_counter() - start)
            try:
                timing = run_on_ranks(_time_rank, task.world, args=(builder, entry["config"], task),
                                      timeout=max(left, 1.0), backend="nccl" if task.device == "cuda" else "gloo")[0]
            except RankTimeoutError as exc:
                timing = {"error": f"over the {task.budget_s:.0f} s budget: {str(exc)[:1500]}"}
            except RankFailedError as exc:
                timing = {"error": str(exc)[:3000]}
        if result.passed:
            if "error" in timing:
                entry["timing"] = timing
                log(f"timing failed: {timing['error'][:500]}")
            else:
                spread = _spread(timing["times"])
                flops = transformer_flops(task.model, task.batch, task.model.context_length, "train_step")
                dtype = "bf16" if options.get("dtype", "fp32") != "fp32" else "fp32"
                peak = peak_flops(timing["device_name"], dtype) if task.device == "cuda" else None
                entry["timing"] = {"warmup": task.warmup, "steps": task.steps, "times_s": timing["times"], **spread,
                                   "tokens_per_s": task.tokens / spread["median_s"],
                                   "model_tflop_per_step": flops / 1e12,
                                   "mfu": (flops / spread["median_s"] / (peak * task.world)) if peak else None,
                                   "peak_memory_mib": timing["peak_mib"], "memory_kind": timing["memory_kind"]}
    wall = time.perf_counter() - start
    entry["wall_s"] = round(wall, 1)
    entry["budget_s"] = task.budget_s
    entry["within_budget"] = wall <= task.budget_s and "error" not in entry.get("timing", {})
    # Under torchrun the command line alone does not say how many processes, on how many machines, ran it.
    entry["environment"] = environment(impl=kind, **({} if launch is None else {"launcher": describe(launch)}))
    if code is not None:
        entry["files"] = {"root": code.name, **files_hash(code)}
    entry["entry_sha256"] = entry_hash(entry)
    return entry


def _silent(_: str) -> None:
    """The log of a rank other than 0 under a launcher: rank 0 speaks for the job."""


@contextlib.contextmanager
def _empty_compile_caches():
    """Fresh, empty Triton and Inductor caches for the run (inherited by the ranks): compilation counts against
    the budget, as it would on a fresh machine."""
    keys = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
    saved = {k: os.environ.get(k) for k in keys}
    with tempfile.TemporaryDirectory(prefix="leaderboard-caches-") as tmp:
        for k in keys:
            os.environ[k] = str(Path(tmp) / k.lower())
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
