"""``make new-stage N=7 NAME=whole_step TITLE="The whole training step"``: the skeletons of a new stage.

Writes the stage's six places and the two lists a stage needs, each already passing ``make test``:

* ``reference/<name>.py`` — one function with a ``# BEGIN SOLUTION`` block (replace it with yours);
* ``tests/test_stage<N>_<name>.py`` — its graded test: a worker-side check, a judge-side comparison;
* ``handout/0<N>-<name>.md`` — the chapter with the problem that names the test and its points;
* ``notebooks/0<N>_<name>.py`` and its ``.ipynb`` — a notebook that calls the function;
* ``benchmarks/bench_<name>.py`` — a benchmark on the skeleton (``--smoke`` in seconds);
* ``tests/kit/mutants/stage<N>.py`` — the mistake catalogue (one mistake; every module with student code needs
  at least one, so that its tests are shown to reject a wrong answer);
* the stage's entry in ``kit/stages.py``;

A chapter with written problems also needs ``instructor/answers/ch0<N>.md``
(the answer key); this skeleton has none. Nothing existing is overwritten: a file that is there already stops
the scaffold before it writes anything.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from kit import stages as registry

ROOT = Path(__file__).resolve().parent.parent

REFERENCE = '''"""Stage {n} — {title} (handout/0{n}-{name}.md).

Replace this module's example with the stage's code: public functions and classes, their argument checks
(kit.validate) before each solution marker, and the solution between the markers (instructor/stubs.py).
"""

from __future__ import annotations

import torch

from kit.validate import instance

__all__ = ["scaled_sum"]


def scaled_sum(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale · Σ x`` over the last dimension. ``x``: ``(..., n)``, any float dtype; returns ``(...,)`` in x's dtype.

    Raises:
        TypeError: ``x`` is not a tensor.
    """
    instance("x", x, torch.Tensor, "a tensor")
    # BEGIN SOLUTION sum the last dimension, then scale (handout 0{n} §1)
    return x.sum(dim=-1) * scale
    # END SOLUTION
'''

TESTS = '''"""Stage {n} — {title} (handout/0{n}-{name}.md)."""

from __future__ import annotations

import pytest
import torch

import kit.impl
from kit.testing import assert_close

pytestmark = pytest.mark.stage{n}


def _scaled_sum(x: torch.Tensor, scale: float) -> torch.Tensor:
    """In the worker: the implementation, called; its output back as data."""
    return kit.impl.load().{name}.scaled_sum(x, scale)


@pytest.mark.points(2)
def test_scaled_sum_matches_float64(worker):
    x = torch.randn(3, 17)  # rectangular, and a length no tile or vector width divides
    got = worker.call(_scaled_sum, x, 0.5)
    # fp32 against float64: a sum of 17 terms carries at most ~17·2⁻²⁴ ≈ 1e-6 relative error; a wrong scale or
    # axis is off by O(1).
    assert_close(got, 0.5 * x.double().sum(-1), name="scaled_sum(x, 0.5)", section="handout 0{n} §1",
                 rtol=1e-5, atol=1e-5)
'''

CHAPTER = '''# Stage {n} — {title}

What this stage teaches, and what it relies on from earlier stages.

## §1 The example

### Problem {n}.1 — Scaled sum (2 points)
Tests: `test_scaled_sum_matches_float64`

Implement `scaled_sum` in `student/{name}.py`.

```bash
.venv/bin/pytest -m stage{n}            # or: make grade STAGE={n}
```
'''

NOTEBOOK = '''# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage {n} — {title}
#
# This notebook uses your `student/{name}.py` (or the reference when `LLMSYS_IMPL=reference`).

# %%
import torch

import kit  # noqa: F401 — sets TRITON_INTERPRET on machines without CUDA
from kit.impl import load

impl = load()
x = torch.randn(4, 8)
print(impl.{name}.scaled_sum(x, 0.5))
'''

BENCHMARK = '''"""Stage {n} benchmark: scaled_sum's time by size.

    python -m benchmarks.bench_{name}            # into bench-output/
    python -m benchmarks.bench_{name} --smoke    # seconds, any machine
"""

from __future__ import annotations

import time

import torch

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit import bench
from kit.impl import load


def main(argv: list[str] | None = None) -> list[dict]:
    p = bench.parser(__doc__)
    args = bench.parse(p, argv)
    impl = load(args.impl).{name}
    sizes = [1024] if args.smoke else [1 << 12, 1 << 16, 1 << 20]
    rows = []
    for n in bench.progress(sizes, "sizes"):
        x = torch.randn(n)
        impl.scaled_sum(x, 0.5)  # warm-up
        start = time.perf_counter()
        impl.scaled_sum(x, 0.5)
        rows.append({{"n": n, "ms": 1e3 * (time.perf_counter() - start)}})
    bench.save("{name}", rows, args, title="scaled_sum: time by size")
    fig, ax = bench.subplots()
    ax.plot([r["n"] for r in rows], [r["ms"] for r in rows], marker="o")
    ax.set(xlabel="n", ylabel="ms", xscale="log")
    bench.save_figure(fig, "{name}", args)
    return rows


if __name__ == "__main__":
    main()
'''

CATALOGUE = '''"""Stage {n} mistakes (handout/0{n}-{name}.md).

Each must fail a public test with a message that points at it.
"""

from instructor.mutants import Mutant

MUTANTS = [
    Mutant("sum-wrong-axis", "{name}.py",
           find="return x.sum(dim=-1) * scale",
           replace="return x.sum(dim=0) * scale",
           mistake="sums over the first dimension instead of the last (§1)",
           expect="scaled_sum"),
]
'''

ENTRY = ('    Stage({n}, {title!r}, ("{name}",), ("0{n}-{name}.md",),\n'
         '          ("test_stage{n}_*.py", "hidden/test_stage{n}_*.py")),')


def plan(n: int, name: str, title: str, root: Path = ROOT) -> dict[Path, str]:
    """The files of a new stage, by path."""
    values = {"n": n, "name": name, "title": title}
    return {
        root / "reference" / f"{name}.py": REFERENCE.format(**values),
        root / "tests" / f"test_stage{n}_{name}.py": TESTS.format(**values),
        root / "handout" / f"0{n}-{name}.md": CHAPTER.format(**values),
        root / "notebooks" / f"0{n}_{name}.py": NOTEBOOK.format(**values),
        root / "benchmarks" / f"bench_{name}.py": BENCHMARK.format(**values),
        root / "tests" / "kit" / "mutants" / f"stage{n}.py": CATALOGUE.format(**values),
    }


def add_entry(n: int, name: str, title: str, root: Path = ROOT) -> None:
    """Append the stage to ``STAGES`` in ``kit/stages.py``."""
    path = root / "kit" / "stages.py"
    text = path.read_text()
    end = text.index("\n)\n", text.index("STAGES: tuple[Stage, ...] = ("))
    path.write_text(text[:end] + "\n" + ENTRY.format(n=n, name=name, title=title) + text[end:])


def create(n: int, name: str, title: str, root: Path = ROOT) -> list[Path]:
    """Write the stage's skeletons and registry entry; regenerate student/ and the notebook twin."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"NAME must be a module name (lowercase, digits, underscores), got {name!r}")
    if n in registry.numbers() or any(name in s.modules for s in registry.STAGES):
        raise ValueError(f"stage {n} or module {name!r} exists already: {registry.numbers()}")
    files = plan(n, name, title, root)
    there = [str(p.relative_to(root)) for p in files if p.exists()]
    if there:
        raise FileExistsError(f"these exist already, nothing was written: {there}")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    add_entry(n, name, title, root)
    return sorted(files)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m instructor new-stage", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("number", type=int, help="the stage's number, the next free one")
    p.add_argument("name", help="its module under reference/ and student/ (e.g. whole_step)")
    p.add_argument("title", help="its title in score tables (e.g. 'The whole training step')")
    args = p.parse_args(argv)
    try:
        written = create(args.number, args.name, args.title)
    except (ValueError, FileExistsError) as exc:
        print(f"new-stage: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path.relative_to(ROOT)}")
    print(f"added stage {args.number} to kit/stages.py. Next: `make student notebooks`, then fill in the skeletons "
          f"(CONTRIBUTING.md, 'Adding a stage'), `make timings STAGE={args.number}` and `make test`.")
    return 0
