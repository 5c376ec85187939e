"""Stage 1 — benchmarking and profiling (handout/01-benchmarking.md).

Each test runs the implementation in the worker (``worker.call``): a module-level function below calls it
with stand-ins that record what it did — a fake clock, a fake ``nvtx`` module, autograd hooks — and
returns the record as data. The test then judges the record here, against the expected values it
computes itself.

The judge draws the scripted durations and the warm-up and iteration counts afresh in every session
(:data:`DRAW`; each message quotes them): a record that does not come from running ``time_fn`` or
``benchmark_model`` on these very inputs — a constant learnt from an earlier run — does not match.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import statistics
import tempfile
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kit.impl
from kit.checks import outcome_of
from kit.model import TransformerLM, get_config
from kit.testing import assert_close, assert_raised

pytestmark = pytest.mark.stage1

DRAW = random.SystemRandom()  # the judge's fresh inputs (module docstring): not reproducible by a submission


def _durations(n: int) -> list[float]:
    """``n`` distinct durations in seconds, each a multiple of 1/64 s below 1 s: exact in binary floating point, so
    the fake clock's sums and differences (100 + k/64) carry no rounding at all, and in no particular order."""
    return [k / 64 for k in DRAW.sample(range(1, 64), n)]


def _number(got, expected: float, *, rel: float, what: str, section: str) -> None:
    """``got`` is a plain float within ``rel`` of ``expected``; the type is checked before the value."""
    assert type(got) in (float, int) and math.isfinite(got), (
        f"{what} is {got!r} ({type(got).__name__}); expected a finite float close to {expected!r}. See {section}.")
    assert abs(got - expected) <= rel * abs(expected), (
        f"{what} = {got!r}, expected {expected!r} (relative tolerance {rel:g}). See {section}.")


class FakeClock:
    """A clock that advances by a scripted amount at each timed call, and logs every event in order."""

    def __init__(self, durations: list[float]):
        self.now = 100.0
        self.durations = list(durations)
        self.events: list[str] = []

    def __call__(self) -> float:
        self.events.append("clock")
        return self.now

    def work(self) -> None:
        self.events.append("fn")
        # Warm-up calls (before the first clock read) take a long, fixed time that must never be measured;
        # so does any call beyond the scripted ones (a warm-up call made after the clock started).
        timed = "clock" in self.events and self.durations
        self.now += self.durations.pop(0) if timed else 1000.0

    def sync(self) -> None:
        self.events.append("sync")


class RecordingNvtx:
    """Stands in for the ``nvtx`` module: records every range as (name, depth) in the order opened, and
    keeps the stack of open ranges so that :class:`OpsByRange` can say which range each op ran in."""

    def __init__(self):
        self.ranges: list[tuple[str, int]] = []
        self.stack: list[str] = []

    @property
    def depth(self) -> int:
        return len(self.stack)

    @contextlib.contextmanager
    def annotate(self, message=None, *args, **kwargs):
        self.push_range(message)
        try:
            yield
        finally:
            self.pop_range()

    def push_range(self, message=None, *args, **kwargs):
        self.ranges.append((message, self.depth))
        self.stack.append(message)

    def pop_range(self, *args, **kwargs):
        self.stack.pop()


class OpsByRange(TorchDispatchMode):
    """Logs every ATen op that runs as (op name, innermost open NVTX range of ``nvtx``), whatever Python API
    (``@``, ``torch.matmul``, ``F.softmax`` …) the code used to reach it."""

    def __init__(self, nvtx: RecordingNvtx):
        super().__init__()
        self.nvtx = nvtx
        self.ops: list[tuple[str, str | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func.overloadpacket.__name__, self.nvtx.stack[-1] if self.nvtx.stack else None))
        return func(*args, **(kwargs or {}))



# ----------------------------------------------------------------------------------------------------
# What runs in the worker: the implementation, called with recording stand-ins; data back
# ----------------------------------------------------------------------------------------------------


def _benchmarking():
    return kit.impl.load().benchmarking


@contextlib.contextmanager
def _nvtx_replaced(fake: RecordingNvtx):
    """The implementation's ``nvtx`` module replaced by ``fake`` for the duration (the worker lives on)."""
    module = _benchmarking()
    original = module.nvtx
    module.nvtx = fake
    try:
        yield
    finally:
        module.nvtx = original


def _stats(stats) -> dict:
    return {"samples": list(stats.samples), "mean": stats.mean, "std": stats.std, "median": stats.median,
            "min": stats.min}


def _time_fn_with_fake_clock(durations: list[float], warmup: int, iters: int) -> dict:
    clock = FakeClock(durations)
    stats = _benchmarking().time_fn(clock.work, warmup=warmup, iters=iters, sync=clock.sync, clock=clock)
    return {"events": clock.events, "stats": _stats(stats)}


def _time_fn_bad_calls() -> dict:
    time_fn = _benchmarking().time_fn
    one = time_fn(lambda: None, warmup=0, iters=1)
    return {"one": _stats(one), "warmup": outcome_of(time_fn, lambda: None, warmup=-1, iters=1),
            "iters": outcome_of(time_fn, lambda: None, warmup=0, iters=0),
            "fn": outcome_of(time_fn, "not callable", warmup=0, iters=1)}


def _attention(q, k, v, is_causal: bool) -> torch.Tensor:
    return _benchmarking().annotated_scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def _attention_ranges_and_ops(q, k, v) -> dict:
    fake = RecordingNvtx()
    with _nvtx_replaced(fake):
        _benchmarking().annotated_scaled_dot_product_attention(q, k, v, is_causal=True)
    ranges = fake.ranges
    fake = RecordingNvtx()
    with _nvtx_replaced(fake), OpsByRange(fake) as log:
        _benchmarking().annotated_scaled_dot_product_attention(q, k, v, is_causal=True)
    return {"ranges": ranges, "ops": log.ops}


def _train_step_ranges(warmup: int, iters: int) -> dict:
    fake = RecordingNvtx()
    with _nvtx_replaced(fake):
        result = _benchmarking().benchmark_model("tiny", context_length=16, batch_size=2, mode="train_step",
                                                 warmup=warmup, iters=iters, device="cpu")
    return {"ranges": fake.ranges, "samples": len(result["timing"].samples)}


def _benchmark_model_mode(mode: str, warmup: int, iters: int) -> dict:
    """What benchmark_model did to a tiny model of ours: gradients computed, tensors saved, weights changed."""
    torch.manual_seed(0)
    model = TransformerLM(get_config("tiny"))
    before = [p.detach().clone() for p in model.parameters()]
    grads_computed = {name: 0 for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: grads_computed.__setitem__(name, grads_computed[name] + 1))
    saved = []  # every tensor autograd saves for backward: none when the forward runs under no_grad
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        result = _benchmarking().benchmark_model("tiny", context_length=16, batch_size=2, mode=mode, warmup=warmup,
                                                 iters=iters, device="cpu", model=model)
    return {"stats": _stats(result["timing"]), "tokens_per_s": result["tokens_per_s"],
            "grads_computed": grads_computed, "saved": saved[:3], "n_saved": len(saved),
            "changed": any(not torch.equal(b, p) for b, p in zip(before, model.parameters())),
            "grads_none": all(p.grad is None for p in model.parameters())}


def _benchmark_model_dtypes(dtype: str) -> dict:
    torch.manual_seed(0)
    model = TransformerLM(get_config("tiny", num_layers=1))
    seen: dict[str, set] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Linear":
            module.register_forward_hook(lambda m, i, out, name=name: seen.setdefault(name, set()).add(out.dtype))
    _benchmarking().benchmark_model("tiny", context_length=16, batch_size=2, mode="forward_backward",
                                    dtype=dtype, warmup=0, iters=1, device="cpu", model=model)
    return {"seen": seen, "weights": {name: p.dtype for name, p in model.named_parameters()}}


def _profile_linear() -> dict:
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    trace = Path(tempfile.mkdtemp()) / "trace.json"
    calls = []
    rows = _benchmarking().profile_step(lambda: calls.append(1) or layer(x), warmup=2, row_limit=5,
                                        trace_path=trace)
    everything = _benchmarking().profile_step(lambda: layer(x), row_limit=100)
    events = json.loads(trace.read_text())["traceEvents"]
    return {"calls": len(calls), "rows": rows, "everything": everything,
            "trace_names": sorted({str(e.get("name", "")) for e in events})}


# ----------------------------------------------------------------------------------------------------
# The tests: the judge's side
# ----------------------------------------------------------------------------------------------------


@pytest.mark.points(2)
def test_time_fn_warmup_calls_are_not_timed(worker):
    """Warm-up calls run before the first clock read and their time is not in any sample."""
    warmup, iters = DRAW.randint(2, 4), DRAW.randint(3, 5)
    durations = _durations(iters)
    got = worker.call(_time_fn_with_fake_clock, durations, warmup, iters)
    events, samples = got["events"], got["stats"]["samples"]
    assert isinstance(events, list) and isinstance(samples, list), f"events {events!r}, samples {samples!r}"
    assert events.count("fn") == warmup + iters, (
        f"fn was called {events.count('fn')} times for warmup={warmup}, iters={iters}; expected {warmup + iters}. "
        "See handout 01 §1."
    )
    first_clock = events.index("clock") if "clock" in events else len(events)
    assert events[:first_clock].count("fn") == warmup, (
        f"the {warmup} warm-up calls must run before the clock starts (handout 01 §1)"
    )
    # Exact: every duration is a multiple of 1/64 s and the clock reads 100 + a sum of them (_durations).
    assert sorted(samples) == sorted(durations), (
        f"samples {samples} include warm-up time or miss timed calls; expected the {iters} timed durations "
        f"{durations} s. See handout 01 §1."
    )


@pytest.mark.points(2)
def test_time_fn_synchronizes_around_every_timed_call(worker):
    """sync() runs before the clock starts and after each timed call returns, before the clock stops."""
    warmup, iters = DRAW.randint(1, 3), DRAW.randint(3, 5)
    events = worker.call(_time_fn_with_fake_clock, _durations(iters), warmup, iters)["events"]
    assert isinstance(events, list), f"events {events!r}"
    timed = [i for i, e in enumerate(events) if e == "fn"][warmup:]
    assert len(timed) == iters, (f"expected {iters} timed calls after {warmup} warm-up calls, saw {len(timed)} "
                                 "(handout 01 §1)")
    for n, i in enumerate(timed):
        before = [e for e in events[:i] if e != "fn"]
        after = events[i + 1:]
        assert before[-2:] == ["sync", "clock"], (
            f"timed call {n}: expected sync() then the clock read just before it, saw {before[-2:]}. Without the "
            "first sync, work queued earlier is billed to this call (handout 01 §1)."
        )
        assert after[:2] == ["sync", "clock"], (
            f"timed call {n}: expected sync() then the clock read right after it, saw {after[:2]}. Without it you "
            "time the kernel launch, not the kernel (handout 01 §1)."
        )


@pytest.mark.points(2)
def test_time_fn_statistics(worker):
    """mean, std (sample, n−1), median and min in seconds, computed from the samples."""
    # Drawn afresh, unsorted, and redrawn until no two statistics coincide and the minimum is neither the first nor
    # the last sample: a formula that computes the wrong statistic cannot land on the right one by chance.
    while True:
        durations = _durations(5)
        values = (statistics.fmean(durations), statistics.stdev(durations), statistics.median(durations),
                  min(durations))
        if len(set(values)) == 4 and min(durations) not in (durations[0], durations[-1]):
            break
    stats = worker.call(_time_fn_with_fake_clock, durations, 0, 5)["stats"]
    assert isinstance(stats, dict), f"time_fn's statistics arrived as {stats!r}"
    expected = {
        "mean": statistics.fmean(durations),
        "std": statistics.stdev(durations),
        "median": statistics.median(durations),
        "min": min(durations),
    }
    hints = {"mean": "the average time per call", "std": "the sample standard deviation (n−1)",
             "median": "the middle sample", "min": "the fastest call"}
    for name, value in expected.items():
        # The samples are exact (multiples of 1/64 s); the statistics' own arithmetic (a sum, a division, a square
        # root) carries a few roundings of 2⁻⁵³ ≈ 1e-16 relative: rel 1e-9 allows any order of summation and
        # nothing a wrong formula could produce (the four values differ by far more).
        _number(stats.get(name), value, rel=1e-9, what=f"TimingStats.{name} for samples {durations} ({hints[name]})",
                section="handout 01 §1")


@pytest.mark.points(1)
def test_time_fn_rejects_bad_arguments(worker):
    got = worker.call(_time_fn_bad_calls)
    # The smallest valid call works: one sample, and its sample standard deviation is defined as 0
    # (statistics.stdev raises on a single sample). The argument checks below are given code.
    one = got["one"]
    assert len(one["samples"]) == 1 and one["std"] == 0.0, (
        f"time_fn(iters=1) gave {len(one['samples'])} samples and std {one['std']}; expected 1 and 0.0. "
        "See handout 01 §1.")
    section = "handout 01 §1"
    assert_raised(got["warmup"], ValueError, "warmup", what="time_fn(warmup=-1)", section=section)
    assert_raised(got["iters"], ValueError, "iters", what="time_fn(iters=0)", section=section)
    assert_raised(got["fn"], TypeError, "fn", what="time_fn('not callable')", section=section)


def _attention_float64(q, k, v, is_causal):
    q, k, v = (t.double() for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if is_causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).tril().logical_not(), float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.points(2)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_annotated_attention_matches_reference(worker, is_causal):
    q, k, v = (torch.randn(2, 3, 17, 16) for _ in range(3))
    out = worker.call(_attention, q, k, v, is_causal)
    label = "causal" if is_causal else "full"
    # Error model: fp32 (u = 2⁻²⁴ ≈ 6e-8) against float64. q·kᵀ sums D = 16 products, softmax normalises
    # over Nk = 17 keys, P·v sums 17 products: a forward error of at most ~(D + 2·Nk)·u ≈ 3e-6 relative to
    # the magnitudes (|out| ≲ 3), so atol 1e-5 + rtol 1e-4 leaves a ≥ 3× margin, while a wrong scale or mask
    # changes outputs by O(0.1–1).
    assert_close(out, _attention_float64(q, k, v, is_causal), name=f"attention output ({label})",
                 section="handout 01 §3", rtol=1e-4, atol=1e-5)


@pytest.mark.points(2)
def test_annotated_attention_nvtx_ranges(worker):
    q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))
    got = worker.call(_attention_ranges_and_ops, q, k, v)
    ranges = [tuple(r) for r in got["ranges"]]
    expected = [("scaled_dot_product_attention", 0), ("attention_scores", 1), ("softmax", 1), ("final_matmul", 1)]
    assert ranges == expected, (
        f"NVTX ranges (name, depth) opened: {ranges}; expected {expected} — one outer range with the three "
        "phases nested inside, in order. See handout 01 §3."
    )
    # Each range must hold its own work, or nsys bills it to the wrong phase: the two matmuls in
    # attention_scores and final_matmul, the softmax (or its exp) in softmax.
    ops = [tuple(o) for o in got["ops"]]
    matmuls = [where for op, where in ops if op in ("bmm", "mm", "matmul", "baddbmm", "addmm")]
    assert matmuls[:1] == ["attention_scores"] and matmuls[-1:] == ["final_matmul"] and len(matmuls) >= 2, (
        f"the matmuls ran in NVTX ranges {matmuls}; expected q·kᵀ inside 'attention_scores' and weights·v inside "
        "'final_matmul'. See handout 01 §3."
    )
    softmax = [(op, where) for op, where in ops if "softmax" in op or op in ("exp", "exp_")]
    misplaced = [(op, where) for op, where in softmax if where != "softmax"]
    assert softmax and not misplaced, (
        f"softmax ops and the NVTX range each ran in: {softmax or 'none seen'}; every softmax op must run inside "
        "the 'softmax' range, or nsys bills its time to another phase. See handout 01 §3."
    )


@pytest.mark.points(2)
def test_benchmark_model_nvtx_ranges_split_the_train_step(worker):
    warmup, iters = DRAW.randint(1, 2), DRAW.randint(2, 3)
    got = worker.call(_train_step_ranges, warmup, iters)
    names = [name for name, _ in got["ranges"]]
    for phase in ("forward", "backward", "optimizer_step"):
        assert names.count(phase) == warmup + iters, (
            f"range {phase!r} opened {names.count(phase)} times over {warmup} warm-up + {iters} timed train steps; "
            f"expected {warmup + iters}. Ranges seen: {sorted(set(names))}. See handout 01 §2."
        )
    order = [n for n in names if n in ("forward", "backward", "optimizer_step")][:3]
    assert order == ["forward", "backward", "optimizer_step"], f"phase order {order} (handout 01 §2)"
    assert got["samples"] == iters, (f"benchmark_model(iters={iters}) gave {got['samples']} timing samples "
                                     "(handout 01 §2)")


@pytest.mark.points(2)
@pytest.mark.parametrize("mode", ["forward", "forward_backward", "train_step"])
def test_benchmark_model_modes(worker, mode):
    """Each mode runs what it says: forward builds no autograd graph; forward_backward computes every
    gradient once per step; train_step changes the weights."""
    warmup, iters = DRAW.randint(1, 2), DRAW.randint(2, 3)
    got = worker.call(_benchmark_model_mode, mode, warmup, iters)
    stats = got["stats"]
    samples = stats["samples"]
    assert len(samples) == iters and all(type(s) is float and s > 0 for s in samples), (
        f"benchmark_model(iters={iters}) gave timing samples {samples}; expected {iters} positive floats (seconds). "
        "See handout 01 §2.")
    # Exact up to float rounding of one division (rel 1e-12 ≫ 2⁻⁵² ≈ 2e-16).
    _number(got["tokens_per_s"], 2 * 16 / stats["mean"], rel=1e-12,
            what=f"tokens_per_s (batch × context / mean time = 2 × 16 / {stats['mean']!r})", section="handout 01 §2")
    expected_grads = 0 if mode == "forward" else warmup + iters
    grads_computed = got["grads_computed"]
    wrong = {name: n for name, n in grads_computed.items() if n != expected_grads}
    hint = "forward must not run backward" if mode == "forward" else "Each step runs loss.backward()"
    assert not wrong, (
        f"mode {mode!r}: each parameter's gradient should be computed {expected_grads} times over {warmup} warm-up "
        f"+ {iters} timed steps, but {len(wrong)} of {len(grads_computed)} were not, e.g. "
        f"{dict(list(wrong.items())[:3])} (times computed). {hint}. See handout 01 §2.")
    if mode == "forward":
        assert not got["n_saved"], (
            f"forward mode saved {got['n_saved']} tensors for a backward that never runs (first shapes "
            f"{got['saved']}): run it under torch.no_grad(). See handout 01 §2.")
    if mode == "train_step":
        assert got["changed"], "train_step must run optimizer.step(): the weights did not change (handout 01 §2)"
    else:
        assert not got["changed"], f"mode {mode!r} must not update weights (handout 01 §2)"
    if mode == "forward":
        assert got["grads_none"], "forward mode must not compute gradients"


@pytest.mark.points(1)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_benchmark_model_runs_the_forward_in_dtype(worker, dtype):
    """The forward runs under autocast in the requested dtype (the linears' outputs have that dtype) while
    the weights stay fp32."""
    expected = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    got = worker.call(_benchmark_model_dtypes, dtype)
    seen = got["seen"]
    wrong = {name: sorted(map(str, dtypes)) for name, dtypes in seen.items() if dtypes != {expected}}
    assert seen and not wrong, (
        f"benchmark_model(dtype={dtype!r}): linear layers produced {wrong or 'nothing (no forward seen)'}; expected "
        f"{expected} everywhere — the forward runs under torch.autocast(dtype) (fp32: autocast off). "
        "See handout 01 §2.")
    low = {name: d for name, d in got["weights"].items() if d != torch.float32}
    assert not low, (f"benchmark_model(dtype={dtype!r}) changed the weights' dtype: {low}; the weights stay fp32 "
                     "(autocast makes the low-precision copies). See handout 01 §2.")


@pytest.mark.points(2)
def test_profile_step_finds_the_linear_layers_matmul(worker):
    got = worker.call(_profile_linear)
    rows = got["rows"]
    assert got["calls"] == 3, (f"profile_step(warmup=2) called fn {got['calls']} times; expected 2 warm-up calls "
                               "and 1 profiled call. See handout 01 §5.")
    names = [r["name"] for r in rows]
    assert any(n in ("aten::addmm", "aten::mm", "aten::matmul") for n in names), (
        f"top ops by self time were {names}: a Linear layer's time is spent in its matmul (aten::addmm). "
        "See handout 01 §5."
    )
    times = [r["self_time_us"] for r in rows]
    assert times == sorted(times, reverse=True), f"rows must be sorted by self time, got {times}"
    # A Linear forward runs at least 5 distinct ops (linear, t, transpose, as_strided, addmm), so exactly 5 rows.
    assert len(rows) == 5, f"profile_step(row_limit=5) returned {len(rows)} rows; expected the top 5 (handout 01 §5)"
    everything = got["everything"]
    by_name = {r["name"]: r for r in everything}
    over = [r for r in everything if r["self_time_us"] > r["total_time_us"] * (1 + 1e-9)]
    assert not over, f"self time above total time in {over[:2]}: self ⊂ total (handout 01 §5)"
    linear = by_name.get("aten::linear")
    assert linear is not None and linear["self_time_us"] < linear["total_time_us"], (
        f"aten::linear row {linear}: its self time must exclude the aten::addmm it calls, so self < total. "
        "self_time_us is the op's exclusive time (self_cpu_time_total on a CPU). See handout 01 §5.")
    assert any("addmm" in n or n[-2:] == "mm" for n in got["trace_names"]), (
        "the Chrome trace has no matmul event (handout 01 §5)"
    )
