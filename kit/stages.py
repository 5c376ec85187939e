"""The one list of stages. Everything that needs to know which stages exist reads it from here.

The grader (titles, marker expressions), the CLI (``--stage`` validation), ``check-handout`` (which
chapter belongs to which stage), the release builder, the test-suite marker checks (``stageN`` markers
are registered from this list) and the Makefile (``python -m kit stages``) all use :data:`STAGES`.

Adding a stage is: a reference module, its tests, its handout chapter, its notebook, its benchmark, its
mistake catalogue and one :class:`Stage` entry below — no edits elsewhere (CONTRIBUTING.md, "Adding a
stage"; ``make new-stage`` writes the skeletons). A number, module or chapter that two stages claim is an
error at import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Stage:
    """One stage of the kit.

    Attributes:
        number: 1, 2, …; the marker is ``stage<number>``.
        title: short title for score tables and the pytest marker's description.
        modules: the implementation modules (or packages) this stage adds under ``student/`` and
            ``reference/``, e.g. ``("ddp", "collectives")``.
        chapters: handout chapters, relative to ``handout/``; problems ``N.k`` live in them.
        tests: test files of the stage, relative to ``tests/`` (globs allowed).
        designs_required: how many alternative designs (``tests/kit/designs/stage<N>/``) must pass its tests. A
            stage whose tests observe how the code works — collectives, hooks, the order of events — needs them,
            as proof that those tests judge behaviour any correct design has, not the reference's internals.
        gpu_kernels: its code includes GPU kernels, compiled on a GPU (``make gpu-check`` runs its tests compiled).
    """

    number: int
    title: str
    modules: tuple[str, ...]
    chapters: tuple[str, ...]
    tests: tuple[str, ...]
    designs_required: int = 0
    gpu_kernels: bool = False

    @property
    def marker(self) -> str:
        return f"stage{self.number}"

    def chapter_paths(self, root: Path = ROOT) -> list[Path]:
        return [root / "handout" / c for c in self.chapters]

    def test_paths(self, root: Path = ROOT) -> list[Path]:
        return sorted({p for pattern in self.tests for p in (root / "tests").glob(pattern)})


STAGES: tuple[Stage, ...] = (
    Stage(1, "Benchmarking & profiling", ("benchmarking",), ("01-benchmarking.md",),
          ("test_stage1_*.py", "hidden/test_stage1_*.py")),
    Stage(2, "Mixed precision", ("precision",), ("02-mixed-precision.md",),
          ("test_stage2_*.py", "hidden/test_stage2_*.py")),
    Stage(3, "FlashAttention-2 in Triton", ("flash_attention",), ("03-flash-attention.md",),
          ("test_stage3_*.py", "hidden/test_stage3_*.py"), gpu_kernels=True),
    Stage(4, "Distributed data parallel", ("ddp", "collectives"), ("04-ddp.md",),
          ("test_stage4_*.py", "hidden/test_stage4_*.py"), designs_required=2),
    Stage(5, "Sharded data parallel: ZeRO-1 and FSDP", ("zero", "fsdp"), ("05-zero.md", "05b-fsdp.md"),
          ("test_stage5_*.py", "hidden/test_stage5_*.py"), designs_required=2),
    Stage(6, "4D parallelism", ("parallel",), ("06-4d-parallelism.md", "06b-context-parallel.md"),
          ("test_stage6_*.py", "hidden/test_stage6_*.py"), designs_required=2),
    Stage(7, "The whole training step", ("whole_step",), ("07-fused-loss.md", "07b-whole-step.md"),
          ("test_stage7_*.py", "hidden/test_stage7_*.py"), designs_required=1, gpu_kernels=True),
)


def check(stages: tuple[Stage, ...]) -> tuple[Stage, ...]:
    """``stages`` if each number, module and chapter belongs to one stage only; ``ValueError`` naming the clash."""
    for what, key in (("number", lambda s: [s.number]), ("module", lambda s: list(s.modules)),
                      ("chapter", lambda s: list(s.chapters))):
        seen: dict = {}
        for stage in stages:
            for value in key(stage):
                if value in seen:
                    raise ValueError(f"kit/stages.py: {what} {value!r} belongs to stage {seen[value]} and to stage "
                                     f"{stage.number} ({stage.title!r}); each stage needs its own")
                seen[value] = stage.number
    return stages


check(STAGES)


def stage_of(item) -> int | None:
    """The stage of a collected pytest test, from its ``stageN`` marker; None for a test without one."""
    return next((int(m.name[5:]) for m in item.iter_markers() if m.name[:5] == "stage" and m.name[5:].isdigit()),
                None)


def numbers(stages: tuple[Stage, ...] = STAGES) -> list[int]:
    return [s.number for s in stages]


def get(number: int, stages: tuple[Stage, ...] = STAGES) -> Stage:
    """The stage with this number; ``KeyError`` naming the known ones otherwise."""
    for s in stages:
        if s.number == number:
            return s
    raise KeyError(f"no stage {number}; the stages are {numbers(stages)}")


def parse_stage_list(text: str | None, stages: tuple[Stage, ...] = STAGES) -> list[int] | None:
    """``"1,3"`` → ``[1, 3]``; ``None`` or ``""`` → ``None`` (all stages). ``ValueError`` on anything else."""
    if not text:
        return None
    known = numbers(stages)
    try:
        chosen = [int(s) for s in str(text).split(",")]
    except ValueError:
        chosen = []
    if not chosen or any(s not in known for s in chosen):
        raise ValueError(f"stages are numbers from {known} separated by commas, e.g. '1' or '1,3'; got {text!r}")
    return chosen


def marker_expression(chosen: list[int] | None = None, stages: tuple[Stage, ...] = STAGES) -> str:
    """The pytest ``-m`` expression selecting these stages' tests (all stages when ``chosen`` is None)."""
    return " or ".join(get(n, stages).marker for n in (chosen or numbers(stages)))


_STAGE_LIST = r"stage\d+(?:\s+or\s+stage\d+)*"
_SELECTION = re.compile(rf"(?:\((?P<grouped>{_STAGE_LIST})\)|(?P<bare>{_STAGE_LIST}))(?:\s+and\s+(?P<rest>[^()]*))?")


def selected_by(expression: str | None) -> list[int] | None:
    """The stage numbers whose tests a pytest ``-m`` expression can select, where it names them: ``"stage4"``,
    ``"stage1 or stage3"``, ``"(stage1 or stage3) and not hidden"`` (the grader's), ``"stage4 and …"``. None
    when it may select a test of any stage or none (empty, ``not stageN``, an ``or`` after ``and``, other
    parentheses). Only the stages' own test files can hold their tests (the suite's check), so a run may
    collect just those files."""
    found = _SELECTION.fullmatch((expression or "").strip())
    if found is None or re.search(r"\bor\b", found.group("rest") or ""):
        return None
    return sorted({int(n) for n in re.findall(r"\d+", found.group("grouped") or found.group("bare"))})
