"""A memory timeline of one call, by category, from torch.profiler: the CPU's view of handout 01 §6.

On CUDA, ``torch.cuda.memory._record_memory_history`` and https://pytorch.org/memory_viz show every
allocation (handout 01 §6, Problem 1.9). On a CPU there is no caching allocator to ask, but the profiler
records every allocation and free when ``profile_memory=True``, and
``prof.export_memory_timeline(path, device="cpu")`` classifies the bytes alive over time: parameters,
optimizer state, inputs, temporaries, activations (saved for the backward), gradients, autograd details.
:func:`record` runs a call under the profiler and returns that timeline, with the times of the call's own
``torch.profiler.record_function`` ranges (``forward``, ``backward``, ``optimizer_step``) so that a plot can
shade the phases; :func:`plot` draws it::

    timeline = record(train_step)             # train_step wraps its phases in record_function(...)
    fig, ax = plt.subplots()
    plot(timeline, ax)
    timeline.peak()                           # {"time_ms": …, "phase": "backward", "total": …, "activation": …}

Where ``export_memory_timeline`` is missing (it is deprecated in favour of the CUDA snapshot and may leave
torch), :func:`record` falls back to the profiler's raw ``[memory]`` events: the same total over time, in
one category, ``"unknown"``.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The columns of export_memory_timeline after its first (always empty) one, in torch's order
# (torch/profiler/_memory_profiler.py: _CATEGORY_TO_INDEX); "unknown" is memory it could not classify.
CATEGORIES = ("parameter", "optimizer_state", "input", "temporary", "activation", "gradient", "autograd_detail",
              "unknown")
PHASES = ("forward", "backward", "optimizer_step")


@dataclass
class MemoryTimeline:
    """Bytes alive over time by category. ``times_ms`` from the first sample; ``bytes[category][i]`` at
    ``times_ms[i]``; ``phases`` holds ``(name, start_ms, end_ms)`` of each recorded range, in order."""

    times_ms: list[float]
    bytes: dict[str, list[int]]
    phases: list[tuple[str, float, float]] = field(default_factory=list)
    source: str = "export_memory_timeline"

    def total(self) -> list[int]:
        """Bytes alive at each sample, all categories."""
        return [sum(column) for column in zip(*self.bytes.values(), strict=True)]

    def phase_at(self, t_ms: float) -> str:
        """The last recorded range that contains ``t_ms`` (ranges may repeat: two steps), or ``""``."""
        inside = [name for name, start, end in self.phases if start <= t_ms <= end]
        return inside[-1] if inside else ""

    def _sample(self, i: int) -> dict:
        return {"time_ms": self.times_ms[i], "phase": self.phase_at(self.times_ms[i]), "total": self.total()[i],
                **{c: v[i] for c, v in self.bytes.items()}}

    def peak(self, start_ms: float = float("-inf"), end_ms: float = float("inf")) -> dict:
        """The sample with the most bytes alive between ``start_ms`` and ``end_ms``: its time, phase, total
        and bytes per category."""
        total = self.total()
        window = [i for i, t in enumerate(self.times_ms) if start_ms <= t <= end_ms]
        if not window:
            raise ValueError(f"no sample between {start_ms} and {end_ms} ms")
        return self._sample(max(window, key=lambda i: total[i]))

    def phase_peaks(self) -> list[dict]:
        """For each recorded range, in order, its peak sample with ``"range"`` (the range's index) added."""
        return [{"range": k, **self.peak(start, end), "phase": name}
                for k, (name, start, end) in enumerate(self.phases)]


def _name(event) -> str:
    try:
        return event.name()
    except UnicodeDecodeError:  # some runtimes record names that are not UTF-8; none of ours
        return ""


def _ranges(prof, names: Sequence[str], t0_us: float) -> list[tuple[str, float, float]]:
    found = []
    for event in prof.profiler.kineto_results.events():
        if _name(event) in names:
            start = event.start_ns() / 1e3
            found.append((event.name(), (start - t0_us) / 1e3, (start + event.duration_ns() / 1e3 - t0_us) / 1e3))
    return sorted(found, key=lambda r: r[1])


def _from_export(prof, device: str) -> tuple[list[float], dict[str, list[int]]]:
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for CUDA in favour of the snapshot; fine on CPU
        path = Path(tmp) / "timeline.json"
        prof.export_memory_timeline(str(path), device=device)
        times, sizes = json.loads(path.read_text())
    columns = list(zip(*sizes, strict=True))[1:]  # the first column is never filled
    if len(columns) != len(CATEGORIES):
        raise RuntimeError(f"export_memory_timeline wrote {len(columns)} categories, expected {len(CATEGORIES)}")
    return [float(t) for t in times], {c: list(col) for c, col in zip(CATEGORIES, columns, strict=True)}


def _from_memory_events(prof) -> tuple[list[float], dict[str, list[int]]]:
    events = sorted((e.start_ns() / 1e3, e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if _name(e) == "[memory]")
    times, alive, running = [], [], 0
    for t, nbytes in events:
        running += nbytes
        times.append(t)
        alive.append(running)
    zeros = [0] * len(times)
    return times, {c: (alive if c == "unknown" else list(zeros)) for c in CATEGORIES}


def record(fn: Callable[[], object], *, phases: Sequence[str] = PHASES, device: str = "cpu") -> MemoryTimeline:
    """Run ``fn()`` once under ``torch.profiler`` with memory profiling and return its memory timeline.

    ``fn`` should wrap its phases in ``torch.profiler.record_function(name)`` with names from ``phases``;
    their times come back in :attr:`MemoryTimeline.phases`. Memory that existed before the call (the
    parameters, an optimizer's state) is included from the first sample on. Times are in ms from the
    first sample; byte counts are exact (the profiler's, per allocation).
    """
    from torch.profiler import ProfilerActivity, profile

    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    try:
        times_us, by_category = _from_export(prof, device)
        source = "export_memory_timeline"
    except (AttributeError, NotImplementedError, RuntimeError) as exc:  # gone from torch, or a format change
        warnings.warn(f"export_memory_timeline unavailable ({exc}); using the raw [memory] events", stacklevel=2)
        times_us, by_category = _from_memory_events(prof)
        source = "memory events"
    t0 = times_us[0] if times_us else 0.0
    return MemoryTimeline(times_ms=[(t - t0) / 1e3 for t in times_us], bytes=by_category,
                          phases=_ranges(prof, phases, t0), source=source)


COLOURS = {"parameter": "darkgreen", "optimizer_state": "goldenrod", "input": "black", "temporary": "mediumpurple",
           "activation": "red", "gradient": "mediumblue", "autograd_detail": "royalblue", "unknown": "grey"}


def plot(timeline: MemoryTimeline, ax, *, unit: float = 2**20, unit_name: str = "MiB", title: str | None = None):
    """A stacked area plot of ``timeline`` on ``ax`` (matplotlib), one band per non-empty category, the
    recorded phases shaded and labelled. Returns ``ax``."""
    import numpy as np

    t = np.array(timeline.times_ms)
    used = [c for c in CATEGORIES if any(timeline.bytes[c])]
    ax.stackplot(t, *[np.array(timeline.bytes[c]) / unit for c in used], labels=[c.replace("_", " ") for c in used],
                 colors=[COLOURS[c] for c in used], alpha=0.8, step="post")
    top = max(timeline.total(), default=0) / unit
    for k, (name, start, end) in enumerate(timeline.phases):
        ax.axvspan(start, end, color="0.5" if k % 2 else "0.8", alpha=0.15, lw=0)
        ax.text((start + end) / 2, top * 1.02, name.replace("_", " "), ha="center", va="bottom", fontsize=7)
    ax.set(xlabel="time (ms)", ylabel=f"allocated ({unit_name})", ylim=(0, top * 1.12 if top else 1),
           title=title or "memory timeline by category")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    return ax


def train_step_fn(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], None]:
    """A train step whose phases are the ranges :func:`record` looks for: ``forward`` (model and loss),
    ``backward`` and ``optimizer_step`` (step, then ``zero_grad(set_to_none=True)``)."""
    from torch.profiler import record_function

    inputs, targets = batch

    def step() -> None:
        with record_function("forward"):
            loss = loss_fn(model(inputs), targets)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer_step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step
