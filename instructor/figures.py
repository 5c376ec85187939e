"""``make figures``: the measured figures the docs quote, generated from the stamped results that measured them.

    python -m instructor figures            # write benchmarks/results/figures.{json,md}, rewrite the docs' quotes
    python -m instructor figures --check    # change nothing; exit 1 when a quote or figures.json is stale

A measured figure — a time, a throughput — goes stale on the next machine, so the hand-written docs
(:data:`DOCS`: README.md, INSTRUCTOR.md, CONTRIBUTING.md, .ci/run) type none. A doc quotes one through a marker::

    the grade took <!-- fig:loop_grade_hidden_s -->67 s<!-- /fig --> of wall clock

and this module writes what stands between the markers from ``benchmarks/results/figures.json``, which it derives
from the results that measured each figure (:data:`SOURCES`: ``make bench-loop``'s table, the clean-machine
reports), each carrying its source's stamp: the machine, its load, the date and the command. Re-measure with the
source's command, then run ``make figures``. ``tests/kit/test_figures.py`` fails when figures.json differs from
what its sources give, when a quote differs from figures.json, or when a doc types a measured time outside a
marker or a code block; a number that is a setting (a time limit, a budget, a goal) is listed in
:data:`SETTINGS` with the reason, and those listed must still occur.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path("benchmarks") / "results"
FIGURES_JSON = RESULTS / "figures.json"
FIGURES_MD = RESULTS / "figures.md"
DOCS = ("README.md", "INSTRUCTOR.md", "CONTRIBUTING.md", ".ci/run")
MARKER = re.compile(r"<!-- fig:(?P<name>[a-z0-9_]+) -->(?P<text>.*?)<!-- /fig -->", re.S)
# A measured quantity as prose writes it: a number and a unit of time or throughput ("67 s", "2.5 min", "450 TFLOP/s").
MEASURED = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s*(?:ms|s|min|minutes?|seconds?|h|hours?|GB/s|GiB/s|TFLOP/s|"
                      r"tokens/s)(?![\w/])")

# Numbers with a time unit that are settings, not measurements: limits, budgets and goals that a re-run does not
# change. (doc, exact phrase, why it is a setting). Each phrase must still occur in its doc.
SETTINGS: tuple[tuple[str, str, str], ...] = (
    ("README.md", "within 10 minutes", "the leaderboard task's rule: a run's budget from empty compilation caches"),
    ("INSTRUCTOR.md", "`--import-timeout`, 30 s", "a grader option's default (kit grade --help)"),
    ("INSTRUCTOR.md", "at most 30 s without", "the grader's --idle-limit default"),
    ("INSTRUCTOR.md", "`--per-test-timeout`, 300 s", "a grader option's default"),
    ("INSTRUCTOR.md", "after 5 minutes", "CI's mutant budget, BUDGET=300 in .ci/run"),
    ("INSTRUCTOR.md", "< 8 min on one H100", "the budget instructor/gpu_check.py's step limits must fit"),
    ("INSTRUCTOR.md", "(7.5 min in all)", "the sum of instructor/gpu_check.py's step time limits"),
    ("INSTRUCTOR.md", "≤ 5.0 ms", "a GPU goal of Stage 3's leaderboard configuration (gpu_check prints it)"),
    ("INSTRUCTOR.md", "≥ 450 TFLOP/s", "a GPU goal of Stage 3's forward at D = 128"),
    ("INSTRUCTOR.md", "2 s limit", "the rendezvous timeout the launch test sets"),
    ("CONTRIBUTING.md", "< 30 s on a CPU", "the budget of a benchmark's --smoke run"),
    ("CONTRIBUTING.md", "< 8 min on one H100", "the budget instructor/gpu_check.py's step limits must fit"),
    ("CONTRIBUTING.md", "under 2 minutes", "the budget of one stage's tests on a 2-core CPU"),
    (".ci/run", "at most 5 minutes of mutants", "CI's mutant budget, BUDGET=300"),
    (".ci/run", "under 30 minutes", "the CI run's budget"),
    (".ci/run", "under\n# 30 minutes", "the CI run's budget"),
)


@dataclass(frozen=True)
class Figure:
    """One measured figure: its value in ``unit``, the text the docs quote, and where it was measured."""

    name: str
    value: float
    unit: str
    text: str
    what: str
    source: str  # the stamped result file, relative to the repository root
    stamp: dict[str, Any]  # the source's own stamp: machine or device, load, date, command


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.2g} s"


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def from_loop(root: Path) -> list[Figure]:
    """The feedback loop's table (``make bench-loop``: benchmarks/results/loop.json): wall seconds per command."""
    path = root / RESULTS / "loop.json"
    data = json.loads(path.read_text())
    rows = {row["row"]: row for row in data["rows"]}
    named = {"grade_hidden": "`python -m kit grade --impl reference --hidden`: the graded suite with the hidden tests",
             "grade": "`python -m kit grade --impl reference`: the graded suite",
             "grade_stubs": "`python -m kit grade --impl student` on the stubs",
             "spawn8": "`run_on_ranks(nothing, 8)`: starting 8 ranks from the warm zygote"}
    figures = []
    for row, what in named.items():
        key = row.replace("_", "-")
        if key in rows:
            seconds = float(rows[key]["seconds"])
            figures.append(Figure(f"loop_{row}_s", round(seconds, 3), "s", _seconds(seconds), what,
                                  path.relative_to(root).as_posix(), data["environment"]))
    return figures


def clean_machine_report(path: Path) -> tuple[dict[str, float], dict[str, Any]]:
    """``({step: wall seconds}, stamp)`` from a clean-machine report (``make test-clean-machine``)."""
    text = path.read_text()
    steps: dict[str, float] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"-?\d+", cells[1]) and re.fullmatch(r"\d+(?:\.\d+)?", cells[2]):
            steps[cells[0]] = float(cells[2])
    run = re.search(r"^Made by `(?P<command>[^`]+)`.*?Run (?P<date>.+?) on (?P<machine>.+?); inside: (?P<inside>.+?)\. "
                    r"Source: (?P<source>.+?)\.?$", text, re.M)
    stamp = {k: v.strip() for k, v in run.groupdict().items()} if run else {}
    return steps, stamp


def from_clean_machine(root: Path) -> list[Figure]:
    """The clean-machine reports: the quick bookworm run (root file system, make setup, in all) and bullseye's."""
    figures = []
    quick = root / RESULTS / "clean-machine-bookworm-quick.md"
    if quick.exists():
        steps, stamp = clean_machine_report(quick)
        source = quick.relative_to(root).as_posix()
        rootfs = next((s for k, s in steps.items() if k.startswith("root file system")), None)
        setup = next((s for k, s in steps.items() if k.startswith("set-up")), None)
        total = sum(steps.values())
        for name, seconds, what in (("clean_machine_quick_min", total, "the quick clean-machine test, every step"),
                                    ("clean_machine_quick_rootfs_min", rootfs, "its root file system (mmdebstrap)"),
                                    ("clean_machine_quick_setup_min", setup, "its `make setup`")):
            if seconds is not None:
                figures.append(Figure(name, round(seconds / 60, 3), "min", _minutes(seconds), what, source, stamp))
    bullseye = root / RESULTS / "clean-machine-bullseye.md"
    if bullseye.exists():
        steps, stamp = clean_machine_report(bullseye)
        figures.append(Figure("clean_machine_bullseye_min", round(sum(steps.values()) / 60, 3), "min",
                              _minutes(sum(steps.values())), "the bullseye clean-machine test (set-up must stop)",
                              bullseye.relative_to(root).as_posix(), stamp))
    return figures


SOURCES = (from_loop, from_clean_machine)


def derive(root: Path = ROOT) -> dict[str, Figure]:
    """Every figure, derived now from its source."""
    return {f.name: f for source in SOURCES for f in source(root)}


def figures_json(figures: dict[str, Figure]) -> str:
    about = ("Measured figures the docs quote (<!-- fig:name --> markers), each derived from the stamped result "
             "file named in 'source' and carrying that file's stamp. Regenerate with `make figures` after "
             "re-measuring; never edit by hand (instructor/figures.py).")
    return json.dumps({"about": about, "figures": {n: asdict(f) for n, f in sorted(figures.items())}},
                      indent=2, ensure_ascii=False) + "\n"


def figures_md(figures: dict[str, Figure]) -> str:
    lines = ["# Measured figures the docs quote", "",
             "Generated by `make figures` (instructor/figures.py) from the stamped results named below; the docs "
             "quote them between `<!-- fig:name -->` markers. Re-measure with the source's command, then run "
             "`make figures`.", "",
             "| figure | value | what | source | measured on |", "|---|---|---|---|---|"]
    for name, f in sorted(figures.items()):
        stamp = f.stamp
        where = "; ".join(str(stamp[k]) for k in ("device", "machine", "load", "date") if stamp.get(k))
        lines.append(f"| `{name}` | {f.text} | {f.what} | [{Path(f.source).name}]({Path(f.source).name}) | {where} |")
    return "\n".join(lines) + "\n"


def load(root: Path = ROOT) -> dict[str, dict[str, Any]]:
    """The committed figures.json's figures."""
    return json.loads((root / FIGURES_JSON).read_text())["figures"]


def quote(text: str, figures: dict[str, dict[str, Any]]) -> str:
    """``text`` with every marker's content replaced by its figure's text; ``KeyError`` naming an unknown figure."""

    def figure(m: re.Match) -> str:
        if m["name"] not in figures:
            raise KeyError(f"<!-- fig:{m['name']} --> names no figure (known: {', '.join(sorted(figures))})")
        return f"<!-- fig:{m['name']} -->{figures[m['name']]['text']}<!-- /fig -->"

    return MARKER.sub(figure, text)


def stale_quotes(root: Path = ROOT) -> list[str]:
    """``doc: name quotes X, figures.json says Y`` for every quote that disagrees, or names no figure."""
    figures = load(root)
    problems = []
    for doc in DOCS:
        for m in MARKER.finditer((root / doc).read_text()):
            if m["name"] not in figures:
                problems.append(f"{doc}: <!-- fig:{m['name']} --> names no figure in {FIGURES_JSON}")
            elif m["text"] != (figure := figures[m["name"]])["text"]:
                problems.append(f"{doc}: {m['name']} quotes {m['text']!r}, {FIGURES_JSON} says {figure['text']!r} "
                                f"(from {figure['source']}): run `make figures`")
    return problems


def typed_figures(doc: str, text: str) -> list[str]:
    """Measured times typed in ``text`` outside markers, fenced code and `code spans`, settings aside."""
    for listed_doc, phrase, _ in SETTINGS:
        if listed_doc == doc:
            text = text.replace(phrase, " " * len(phrase))
    text = MARKER.sub(lambda m: " " * len(m.group(0)), text)
    text = re.sub(r"```.*?```", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group(0)), text)
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        found += [f"{doc}:{lineno}: {m.group(0)!r}" for m in MEASURED.finditer(line)]
    return found


def missing_settings(root: Path = ROOT) -> list[str]:
    """Entries of :data:`SETTINGS` whose phrase no longer occurs in its doc (the list must stay honest)."""
    return [f"{doc}: {phrase!r}" for doc, phrase, _ in SETTINGS if phrase not in (root / doc).read_text()]


def write(root: Path = ROOT) -> list[str]:
    """Write figures.{json,md} and rewrite the docs' quotes; return the files changed."""
    figures = derive(root)
    changed = []
    for rel, text in ((FIGURES_JSON, figures_json(figures)), (FIGURES_MD, figures_md(figures))):
        if not (root / rel).exists() or (root / rel).read_text() != text:
            (root / rel).write_text(text)
            changed.append(str(rel))
    as_data = {n: asdict(f) for n, f in figures.items()}
    for doc in DOCS:
        old = (root / doc).read_text()
        new = quote(old, as_data)
        if new != old:
            (root / doc).write_text(new)
            changed.append(doc)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m instructor figures", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when something is stale")
    args = parser.parse_args(argv)
    if args.check:
        problems = []
        if not (ROOT / FIGURES_JSON).exists() or (ROOT / FIGURES_JSON).read_text() != figures_json(derive()):
            problems.append(f"{FIGURES_JSON} differs from what its sources give: run `make figures`")
        if (ROOT / FIGURES_JSON).exists():
            problems += stale_quotes()
        problems += [f"a measured figure typed by hand: {t}" for doc in DOCS
                     for t in typed_figures(doc, (ROOT / doc).read_text())]
        problems += [f"a setting listed in instructor/figures.py no longer occurs: {s}" for s in missing_settings()]
        print("\n".join(problems) if problems else "every quoted figure matches its stamped source")
        return 1 if problems else 0
    try:
        changed = write()
    except KeyError as e:
        print(f"python -m instructor figures: {e.args[0]}", file=sys.stderr)
        return 1
    print("updated: " + ", ".join(changed) if changed else "figures and quotes are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
