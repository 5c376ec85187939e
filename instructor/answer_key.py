"""The instructor's answer key, rendered from templates so that its numbers can never drift from the code.

``instructor/answers/chNN.md`` (one per handout chapter: ``ch01`` … ``ch05b``, ``ch06``) holds one section
per written problem and per derivation, headed like the handout's problem::

    ## Problem 5.7 — Memory at each stage

with the expected answer, the numbers, a rubric with partial credit and the common wrong answers. A number
is never typed: it is a placeholder evaluated against the reference's accounting, FLOP and memory functions,
the presets and the committed benchmark results::

    Stage 3 needs {{ accounting.devices_needed(405e9, 80e9, zero_stage=3) }} devices.
    Per GPU: {{ gb(zero_memory(7.5e9, 64)["stage3"]) :.1f }} GB

``{{ expression }}`` or ``{{ expression :format-spec }}``. The expression is Python, evaluated with the
names of :func:`namespace` (modules such as ``flops``, ``model``, ``zero``, ``accounting``, the helpers
``results``, ``table``, ``gb`` …) plus everything public in the chapter's helper module
``instructor/answers/chNN.py`` (small named functions, which call the reference through its modules so that
a patched formula changes the key). A placeholder that fails to evaluate is an error naming the template
and the line; nothing is rendered half.

This is instructor tooling: it imports ``reference`` directly (it is not a test of a student), and neither
it nor ``instructor/`` is in the student release (:mod:`instructor.release`).

Command line: ``python -m instructor answers [--stage N] [--out DIR]`` (``make answers``) writes
``answers-output/chNN.md``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from kit import stages as registry

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "instructor" / "answers"
DEFAULT_OUT = ROOT / "answers-output"
PLACEHOLDER = re.compile(r"\{\{(?P<expr>.+?)\}\}", re.S)
SECTION = re.compile(r"^##\s+Problem\s+(?P<number>\d+\.\d+)\b", re.M)


class AnswerKeyError(RuntimeError):
    """A template that cannot be rendered: a placeholder that fails, or a missing template."""


def chapter_key(chapter: str) -> str:
    """``"05b-fsdp.md"`` → ``"ch05b"``: the template's name for a handout chapter."""
    return "ch" + chapter.split("-", 1)[0]


def chapters(stage_numbers: Iterable[int] | None = None) -> list[str]:
    """The handout chapters (``"01-benchmarking.md"`` …) of these stages (default: all), in order."""
    wanted = set(stage_numbers) if stage_numbers is not None else None
    return [c for s in registry.STAGES if wanted is None or s.number in wanted for c in s.chapters]


# ------------------------------------------------------------------------------------------------ namespace

def results(name: str, root: Path | None = None) -> dict:
    """A committed benchmark table ``benchmarks/results/<name>.json``: ``{"environment": …, "rows": […]}``."""
    path = (root or ROOT) / "benchmarks" / "results" / f"{name}.json"
    if not path.exists():
        raise AnswerKeyError(f"the key reads {path.relative_to(root or ROOT)}, which does not exist")
    return json.loads(path.read_text())


def measured_on(name: str) -> str:
    """``"CPU (x86_64, 1 threads), 2026-11-23 11:55 UTC, `python -m …`"``: the label every measured figure
    carries in the key."""
    env = results(name)["environment"]
    return f"{env.get('device', 'unknown device')}, load {env.get('load', '?')}, {env.get('date', '?')}, " \
           f"`{env.get('command', '?')}`"


def measured(name: str, columns: list[str] | None = None, where: Callable[[dict], bool] | None = None) -> str:
    """A committed result table with its label: ``Measured on <machine> …`` then the rows."""
    return (f"Measured on {measured_on(name)} (`benchmarks/results/{name}.md`):\n\n"
            + table(results(name)["rows"], columns, where))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def table(rows: list[dict], columns: list[str] | None = None,
          where: Callable[[dict], bool] | None = None) -> str:
    """A Markdown table of ``rows`` (dicts), optionally filtered by ``where`` and restricted to ``columns``."""
    rows = [r for r in rows if where is None or where(r)]
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def gb(x: float) -> float:
    """Bytes → GB (10⁹)."""
    return x / 1e9


def gib(x: float) -> float:
    """Bytes → GiB (2³⁰)."""
    return x / 2**30


def mib(x: float) -> float:
    """Bytes → MiB (2²⁰)."""
    return x / 2**20


def num_params(preset: str, *, embedding: bool = True) -> int:
    """Parameters of ``TransformerLM(preset)``, counted on the meta device (``embedding=False``: without the
    token embedding, the convention of :mod:`kit.flops`)."""
    import torch

    from kit import model

    with torch.device("meta"):
        m = model.TransformerLM(model.get_config(preset))
    total = sum(p.numel() for p in m.parameters())
    return total if embedding else total - m.token_embeddings.weight.numel()


def reference_modules() -> dict[str, ModuleType]:
    """Every module the registry's stages add to ``reference/`` (a package's modules too), by its own name
    (``precision``, ``zero``, ``accounting``, ``pipeline_parallel`` …)."""
    import pkgutil

    found: dict[str, ModuleType] = {}
    for stage in registry.STAGES:
        for name in stage.modules:
            module = importlib.import_module(f"reference.{name}")
            found[name] = module
            for sub in pkgutil.iter_modules(getattr(module, "__path__", [])):
                found[sub.name] = importlib.import_module(f"reference.{name}.{sub.name}")
    return found


def namespace() -> dict[str, Any]:
    """The names every placeholder sees: the reference's modules, the kit's FLOP and model modules, helpers."""
    from kit import flops, model

    return dict(
        **reference_modules(), math=math, flops=flops, model=model, PRESETS=model.PRESETS, results=results,
        measured_on=measured_on, measured=measured, table=table, gb=gb, gib=gib, mib=mib, num_params=num_params,
    )


def _helpers(key: str, templates: Path) -> dict[str, Any]:
    path = templates / f"{key}.py"
    if not path.exists():
        return {}
    spec = importlib.util.spec_from_file_location(f"_answer_key_{key}", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {n: getattr(module, n) for n in dir(module) if not n.startswith("_")}


# ------------------------------------------------------------------------------------------------ rendering

def render_text(text: str, names: dict[str, Any], where: str = "<template>") -> str:
    """``text`` with every ``{{ expression[:spec] }}`` replaced by its value formatted with ``spec``."""

    def substitute(m: re.Match) -> str:
        body = m.group("expr").strip()
        expr, spec = body, ""
        # `:spec` at the end, outside brackets and strings: the last top-level colon followed by a format spec.
        split = re.match(r"^(?P<expr>.*?)\s+:(?P<spec>[^:{}\[\]()'\"]*)$", body, re.S)
        if split:
            expr, spec = split.group("expr"), split.group("spec").strip()
        line = text.count("\n", 0, m.start()) + 1
        try:
            value = eval(expr, dict(names))  # noqa: S307 — instructor templates in this repository
            return format(value, spec) if spec else str(value)
        except Exception as exc:
            raise AnswerKeyError(f"{where}:{line}: `{{{{ {body} }}}}` failed: {type(exc).__name__}: {exc}") from exc

    rendered = PLACEHOLDER.sub(substitute, text)
    if "{{" in rendered or "}}" in rendered:
        raise AnswerKeyError(f"{where}: an un-rendered placeholder is left (unbalanced braces?)")
    return rendered


def render(stage_numbers: Iterable[int] | None = None, templates: Path = TEMPLATES) -> dict[str, str]:
    """The rendered key, ``{"ch01": markdown, …}``, for the chapters of these stages (default: all)."""
    if not templates.is_dir():
        raise AnswerKeyError(f"{templates} does not exist: the answer key is in the instructor's copy of the kit only")
    base = namespace()
    written = written_problems(templates.parent.parent)
    out: dict[str, str] = {}
    for chapter in chapters(stage_numbers):
        key = chapter_key(chapter)
        path = templates / f"{key}.md"
        if not path.exists():
            if not written.get(key):  # a chapter of graded problems only needs no key
                continue
            raise AnswerKeyError(f"no answer-key template {path.relative_to(templates.parent.parent)} for "
                                 f"handout/{chapter}, which has written problems {written[key]}")
        names = {**base, **_helpers(key, templates)}
        out[key] = render_text(path.read_text(), names, where=str(path.relative_to(templates.parent.parent)))
    return out


def key_sections(text: str) -> list[str]:
    """The problem numbers (``"5.7"``) that have a section in a key."""
    return [m.group("number") for m in SECTION.finditer(text)]


def written_problems(root: Path = ROOT) -> dict[str, list[str]]:
    """``{"ch01": ["1.3", …]}``: every problem marked ``(written …)`` in the handout, by chapter."""
    from kit.grading.handout_check import parse_handout

    out: dict[str, list[str]] = {}
    for chapter in chapters():
        problems = parse_handout(root / "handout" / chapter)
        out[chapter_key(chapter)] = [p.number for p in problems if p.points is None]
    return out


def missing_sections(rendered: dict[str, str], root: Path = ROOT) -> list[str]:
    """Written problems of the rendered chapters that have no section in the key, as readable lines."""
    missing = []
    for key, numbers in written_problems(root).items():
        if key not in rendered:
            continue
        have = set(key_sections(rendered[key]))
        missing += [f"{key}: problem {n} is written in the handout but has no `## Problem {n}` section"
                    for n in numbers if n not in have]
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m instructor answers",
                                     description="render the instructor's answer key (instructor/answers)")
    parser.add_argument("--stage", help="only these stages, e.g. 4 or 5,6")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default answers-output/)")
    args = parser.parse_args(argv)
    try:
        stage_numbers = registry.parse_stage_list(args.stage) if args.stage else None
    except ValueError as exc:
        raise SystemExit(f"--stage: {exc}") from None
    try:
        rendered = render(stage_numbers)
    except AnswerKeyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    problems = 0
    for key, text in rendered.items():
        (out / f"{key}.md").write_text(text)
        problems += len(key_sections(text))
    missing = missing_sections(rendered)
    print(f"wrote {len(rendered)} chapter(s), {problems} problem(s) to {out}/")
    for line in missing:
        print(f"missing: {line}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
