"""Figures generated, not typed: the docs quote measured figures from benchmarks/results/figures.json, which
`make figures` derives from the stamped results that measured them (instructor/figures.py)."""

from __future__ import annotations

import json
from pathlib import Path

from instructor import figures

ROOT = Path(__file__).resolve().parents[2]


def test_figures_json_is_what_its_stamped_sources_give():
    committed = (ROOT / figures.FIGURES_JSON).read_text()
    assert committed == figures.figures_json(figures.derive()), (
        f"{figures.FIGURES_JSON} differs from its sources (a result was re-measured): run `make figures`")
    for name, figure in json.loads(committed)["figures"].items():
        assert (ROOT / figure["source"]).is_file() and figure["stamp"], f"{name}: no stamped source"


def test_every_quoted_figure_matches_its_source():
    assert not figures.stale_quotes(), "\n".join(figures.stale_quotes())
    quoted = {m["name"] for doc in figures.DOCS for m in figures.MARKER.finditer((ROOT / doc).read_text())}
    assert quoted, "no doc quotes a figure: the markers were lost"


def test_no_measured_time_is_typed_in_the_docs():
    typed = [t for doc in figures.DOCS for t in figures.typed_figures(doc, (ROOT / doc).read_text())]
    assert not typed, ("measured times typed by hand (quote them with a <!-- fig:name --> marker from a stamped "
                       "result, point at the result file, or list a setting in instructor/figures.SETTINGS with "
                       "why):\n" + "\n".join(typed))
    missing = figures.missing_settings()
    assert not missing, "settings listed in instructor/figures.py that no longer occur:\n" + "\n".join(missing)


def test_the_scan_finds_typed_times_and_skips_markers_code_and_settings():
    text = ("took 14.5 min, then 67 s; 3 steps and 8 ranks; `--timeout 30 s`; within 10 minutes\n"
            "```\nsleep 5 s\n```\n<!-- fig:x -->9 s<!-- /fig --> at 450 TFLOP/s\n")
    found = figures.typed_figures("README.md", text)
    assert [f.split(": ", 1)[1] for f in found] == ["'14.5 min'", "'67 s'", "'450 TFLOP/s'"], found


def test_make_figures_rewrites_a_stale_quote(tmp_path: Path):
    known = {"loop_grade_s": {"text": "76 s"}}
    assert figures.quote("took <!-- fig:loop_grade_s -->90 s<!-- /fig -->.", known) == \
        "took <!-- fig:loop_grade_s -->76 s<!-- /fig -->."


def test_clean_machine_reports_are_read_with_their_stamp():
    steps, stamp = figures.clean_machine_report(ROOT / figures.RESULTS / "clean-machine-bookworm-quick.md")
    assert steps and all(s >= 0 for s in steps.values())
    assert stamp["command"] == "make test-clean-machine" and stamp["date"] and stamp["machine"], stamp
