"""Stage 1 — benchmarking and profiling (handout/01-benchmarking.md)."""

from __future__ import annotations

import contextlib
import json
import statistics

import pytest
import torch

from kit.model import TransformerLM, get_config
from kit.testing import assert_close

pytestmark = pytest.mark.stage1


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
        # Warm-up calls (before the first clock read) take a long, fixed time that must never be measured.
        self.now += self.durations.pop(0) if "clock" in self.events else 1000.0

    def sync(self) -> None:
        self.events.append("sync")


class RecordingNvtx:
    """Stands in for the ``nvtx`` module: records every range as (name, depth) in the order opened."""

    def __init__(self):
        self.ranges: list[tuple[str, int]] = []
        self.depth = 0

    @contextlib.contextmanager
    def annotate(self, message=None, *args, **kwargs):
        self.ranges.append((message, self.depth))
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def push_range(self, message=None, *args, **kwargs):
        self.ranges.append((message, self.depth))
        self.depth += 1

    def pop_range(self, *args, **kwargs):
        self.depth -= 1


@pytest.mark.points(2)
def test_time_fn_warmup_calls_are_not_timed(impl):
    """Warm-up calls run before the first clock read and their time is not in any sample."""
    clock = FakeClock([0.5, 0.25, 0.75])
    stats = impl.benchmarking.time_fn(clock.work, warmup=2, iters=3, sync=clock.sync, clock=clock)
    assert clock.events.count("fn") == 5, (
        f"fn was called {clock.events.count('fn')} times for warmup=2, iters=3; expected 5. See handout 01 §1."
    )
    first_clock = clock.events.index("clock")
    assert clock.events[:first_clock].count("fn") == 2, (
        "the 2 warm-up calls must run before the clock starts (handout 01 §1)"
    )
    assert sorted(stats.samples) == [0.25, 0.5, 0.75], (
        f"samples {stats.samples} include warm-up time or miss timed calls; expected the 3 timed durations "
        "0.5, 0.25, 0.75 s. See handout 01 §1."
    )


@pytest.mark.points(2)
def test_time_fn_synchronizes_around_every_timed_call(impl):
    """sync() runs before the clock starts and after each timed call returns, before the clock stops."""
    clock = FakeClock([0.1] * 4)
    impl.benchmarking.time_fn(clock.work, warmup=1, iters=4, sync=clock.sync, clock=clock)
    events = clock.events
    timed = [i for i, e in enumerate(events) if e == "fn"][1:]
    assert len(timed) == 4, f"expected 4 timed calls, saw {len(timed)} (handout 01 §1)"
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
def test_time_fn_statistics(impl):
    """mean, std (sample, n−1), median and min in seconds, computed from the samples."""
    durations = [0.010, 0.030, 0.020, 0.050, 0.040]
    clock = FakeClock(durations)
    stats = impl.benchmarking.time_fn(clock.work, warmup=0, iters=5, sync=clock.sync, clock=clock)
    expected = {
        "mean": statistics.fmean(durations),
        "std": statistics.stdev(durations),
        "median": statistics.median(durations),
        "min": min(durations),
    }
    for name, value in expected.items():
        got = getattr(stats, name)
        assert got == pytest.approx(value, rel=1e-9), (
            f"TimingStats.{name} = {got!r}, expected {value!r} for samples {durations} (rel tol 1e-9). "
            "std is the sample standard deviation (n−1). See handout 01 §1."
        )


@pytest.mark.points(1)
def test_time_fn_rejects_bad_arguments(impl):
    time_fn = impl.benchmarking.time_fn
    # The smallest valid call works: one sample, and its sample standard deviation is defined as 0
    # (statistics.stdev raises on a single sample). The argument checks below are given code.
    one = time_fn(lambda: None, warmup=0, iters=1)
    assert len(one.samples) == 1 and one.std == 0.0, (
        f"time_fn(iters=1) gave {len(one.samples)} samples and std {one.std}; expected 1 and 0.0. See handout 01 §1.")
    with pytest.raises(ValueError, match="warmup"):
        time_fn(lambda: None, warmup=-1, iters=1)
    with pytest.raises(ValueError, match="iters"):
        time_fn(lambda: None, warmup=0, iters=0)
    with pytest.raises(TypeError, match="fn"):
        time_fn("not callable", warmup=0, iters=1)


def _attention_float64(q, k, v, is_causal):
    q, k, v = (t.double() for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if is_causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).tril().logical_not(), float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.points(2)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_annotated_attention_matches_reference(impl, is_causal):
    q, k, v = (torch.randn(2, 3, 17, 16) for _ in range(3))
    out = impl.benchmarking.annotated_scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    label = "causal" if is_causal else "full"
    assert_close(out, _attention_float64(q, k, v, is_causal), name=f"attention output ({label})",
                 section="handout 01 §3", rtol=1e-4, atol=1e-5)


@pytest.mark.points(2)
def test_annotated_attention_nvtx_ranges(impl, monkeypatch):
    fake = RecordingNvtx()
    monkeypatch.setattr(impl.benchmarking, "nvtx", fake)
    q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))
    impl.benchmarking.annotated_scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = [("scaled_dot_product_attention", 0), ("attention_scores", 1), ("softmax", 1), ("final_matmul", 1)]
    assert fake.ranges == expected, (
        f"NVTX ranges (name, depth) opened: {fake.ranges}; expected {expected} — one outer range with the three "
        "phases nested inside, in order. See handout 01 §3."
    )


@pytest.mark.points(2)
def test_benchmark_model_nvtx_ranges_split_the_train_step(impl, monkeypatch):
    fake = RecordingNvtx()
    monkeypatch.setattr(impl.benchmarking, "nvtx", fake)
    result = impl.benchmarking.benchmark_model("tiny", context_length=16, batch_size=2, mode="train_step",
                                               warmup=1, iters=2, device="cpu")
    names = [name for name, _ in fake.ranges]
    for phase in ("forward", "backward", "optimizer_step"):
        assert names.count(phase) == 3, (
            f"range {phase!r} opened {names.count(phase)} times over 1 warm-up + 2 timed train steps; expected 3. "
            f"Ranges seen: {sorted(set(names))}. See handout 01 §2."
        )
    order = [n for n in names if n in ("forward", "backward", "optimizer_step")][:3]
    assert order == ["forward", "backward", "optimizer_step"], f"phase order {order} (handout 01 §2)"
    assert len(result["timing"].samples) == 2


@pytest.mark.points(2)
@pytest.mark.parametrize("mode", ["forward", "forward_backward", "train_step"])
def test_benchmark_model_modes(impl, mode):
    """Each mode runs what it says: forward leaves no gradients; train_step changes the weights."""
    torch.manual_seed(0)
    model = TransformerLM(get_config("tiny"))
    before = [p.detach().clone() for p in model.parameters()]
    result = impl.benchmarking.benchmark_model("tiny", context_length=16, batch_size=2, mode=mode, warmup=1,
                                               iters=2, device="cpu", model=model)
    stats = result["timing"]
    assert len(stats.samples) == 2 and all(s > 0 for s in stats.samples), f"timing samples {stats.samples}"
    assert result["tokens_per_s"] == pytest.approx(2 * 16 / stats.mean), "tokens/s = batch × context / mean time"
    changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    if mode == "train_step":
        assert changed, "train_step must run optimizer.step(): the weights did not change (handout 01 §2)"
    else:
        assert not changed, f"mode {mode!r} must not update weights (handout 01 §2)"
    if mode == "forward":
        assert all(p.grad is None for p in model.parameters()), "forward mode must not compute gradients"


@pytest.mark.points(2)
def test_profile_step_finds_the_linear_layers_matmul(impl, tmp_path):
    layer = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    trace = tmp_path / "trace.json"
    rows = impl.benchmarking.profile_step(lambda: layer(x), row_limit=5, trace_path=trace)
    names = [r["name"] for r in rows]
    assert any(n in ("aten::addmm", "aten::mm", "aten::matmul") for n in names), (
        f"top ops by self time were {names}: a Linear layer's time is spent in its matmul (aten::addmm). "
        "See handout 01 §5."
    )
    times = [r["self_time_us"] for r in rows]
    assert times == sorted(times, reverse=True), f"rows must be sorted by self time, got {times}"
    assert len(rows) <= 5
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("addmm" in str(e.get("name", "")) or "mm" == str(e.get("name", ""))[-2:] for e in events), (
        "the Chrome trace has no matmul event (handout 01 §5)"
    )
