"""The instructor's answer key (instructor/answer_key.py, instructor/answers/): complete, and computed by the code.

Every problem the handout marks ``(written …)`` has a section in the rendered key; no placeholder is left
un-rendered; and a number in the key is the code's, not a typed copy: patch a formula or a preset and the
rendered key changes.
"""

from __future__ import annotations

import pytest

from instructor import answer_key as answers


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    return answers.render()


def test_every_chapter_with_written_problems_has_a_rendered_key(rendered):
    written = {key for key, numbers in answers.written_problems().items() if numbers}
    assert written <= set(rendered), f"chapters with written problems but no key: {sorted(written - set(rendered))}"
    for key, text in rendered.items():
        assert answers.key_sections(text), f"{key}: the key has no `## Problem N.k` section"


def test_every_written_problem_has_a_key_entry(rendered):
    missing = answers.missing_sections(rendered)
    assert not missing, "written problems without an answer-key section:\n" + "\n".join(missing)


def test_every_key_section_is_a_handout_problem(rendered):
    """A section for a problem the handout no longer has is stale (a renumbered or removed problem)."""
    from kit.handout_check import parse_handout

    known = {p.number for c in answers.chapters() for p in parse_handout(answers.ROOT / "handout" / c)}
    stale = [f"{key}: {n}" for key, text in rendered.items() for n in answers.key_sections(text) if n not in known]
    assert not stale, f"key sections for problems the handout does not have: {stale}"


def test_each_section_has_a_rubric_and_wrong_answers(rendered):
    bad = []
    for key, text in rendered.items():
        parts = answers.SECTION.split(text)
        for number, body in zip(parts[1::2], parts[2::2], strict=True):
            if "**Rubric" not in body:
                bad.append(f"{key} {number}: no **Rubric**")
            if "**Common wrong answers" not in body:
                bad.append(f"{key} {number}: no **Common wrong answers**")
    assert not bad, "\n".join(bad)


def test_no_placeholder_is_left(rendered):
    for key, text in rendered.items():
        assert "{{" not in text and "}}" not in text, f"{key}: an un-rendered placeholder"


def test_measured_figures_name_their_machine(rendered):
    """A section that quotes benchmarks/results says which machine measured it."""
    for key, text in rendered.items():
        if "benchmarks/results/" in text:
            assert "measured on" in text.lower(), f"{key}: quotes benchmark results without the machine"


def test_placeholder_errors_name_the_template_line():
    with pytest.raises(answers.AnswerKeyError, match=r"t\.md:2: .*no_such_name"):
        answers.render_text("line one\n{{ no_such_name }}\n", {}, where="t.md")
    assert answers.render_text("{{ 1/3 :.2f }} and {{ x }}", {"x": 7}) == "0.33 and 7"


@pytest.mark.parametrize("patch, chapter", [
    ("zero_memory", "ch05"),
    ("flops_peak", "ch05b"),
    ("preset_xl", "ch02"),
    ("compute_bound", "ch06"),
])
def test_a_changed_formula_changes_the_key(monkeypatch, rendered, patch, chapter):
    """The key's numbers come from the code: change a formula, a peak or a preset and the key changes."""
    import reference.parallel.accounting as accounting
    import reference.zero as zero
    from kit import flops, model

    if patch == "zero_memory":
        original = zero.zero_memory_accounting

        def doubled(*args, **kwargs):
            m = original(*args, **kwargs)
            return type(m)(**{k: (v * 2 if isinstance(v, int | float) else v) for k, v in vars(m).items()})

        monkeypatch.setattr(zero, "zero_memory_accounting", doubled)
    elif patch == "flops_peak":
        monkeypatch.setitem(flops.PEAK_FLOPS, "H100", {**flops.PEAK_FLOPS["H100"], "bf16": 500e12})
    elif patch == "preset_xl":
        monkeypatch.setitem(model.PRESETS, "xl", model.PRESETS["xl"].with_(d_model=1280, num_heads=20))
    elif patch == "compute_bound":
        original_cb = accounting.fsdp_tp_compute_bound
        monkeypatch.setattr(accounting, "fsdp_tp_compute_bound",
                            lambda **kw: {k: v * 3 for k, v in original_cb(**kw).items()})
    again = answers.render()
    assert again[chapter] != rendered[chapter], f"patching {patch} left {chapter} of the key unchanged: typed numbers?"


def test_command_line_writes_the_key(tmp_path):
    assert answers.main(["--stage", "4", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "ch04.md").exists() and not (tmp_path / "ch01.md").exists()
