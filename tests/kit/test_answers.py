"""The instructor's answer key (instructor/answer_key.py, instructor/answers/): complete, and computed by the code.

Every problem the handout marks ``(written …)`` has a section in the rendered key; no placeholder is left
un-rendered; and a number in the key is the code's, not a typed copy: patch a formula or a preset and the
rendered key changes.
"""

from __future__ import annotations

import re

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
    from kit.grading.handout_check import parse_handout

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
    ("flops_peak", "ch06b"),
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


# ------------------------------------------------------------------------------------------------------------------
# Numbers the second derivation (issue 28) found wrong: each is recomputed here, independently of the key's helpers,
# and compared with what the rendered key prints.
# ------------------------------------------------------------------------------------------------------------------

def _section(rendered: dict[str, str], key: str, number: str) -> str:
    parts = answers.SECTION.split(rendered[key])
    sections = dict(zip(parts[1::2], parts[2::2], strict=True))
    assert number in sections, f"{key} has no section {number}"
    return sections[number]


def _results(name: str) -> list[dict]:
    import json

    return json.loads((answers.ROOT / "benchmarks" / "results" / f"{name}.json").read_text())["rows"]


def _params(preset: str) -> int:
    import torch

    from kit.model import TransformerLM, get_config

    with torch.device("meta"):
        return sum(p.numel() for p in TransformerLM(get_config(preset)).parameters())


def test_adamw_bytes_per_parameter_are_traced(rendered):
    """1.5(a), 1.7: AdamW moves 28 B per parameter fused and 80 B with torch's foreach implementation, not ~16. The
    foreach count is traced here: every aten op of one foreach AdamW step, bytes of its tensor inputs and outputs."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Traffic(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))

            def tensors(x):
                if isinstance(x, torch.Tensor):
                    yield x
                elif isinstance(x, list | tuple):
                    for y in x:
                        yield from tensors(y)

            big = lambda t: t.numel() > 1  # the step counters and scalar factors are not per-parameter traffic
            reads = {id(t): t for a in args for t in tensors(a) if big(t)}
            writes = list(tensors(out)) if not func._schema.name.endswith("_") else list(tensors(args[0]))
            self.bytes += sum(t.nbytes for t in reads.values()) + sum(t.nbytes for t in writes if big(t))
            return out

    params = [torch.nn.Parameter(torch.randn(1000)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, foreach=True)
    opt.step()  # the first step allocates the state; trace the second
    with Traffic() as traffic:
        opt.step()
    per_param = traffic.bytes / 3000
    # addcmul_(v, g, g) hands g in twice but reads it once: inputs are counted once per tensor.
    assert per_param == 80, per_param
    section = _section(rendered, "ch01", "1.5")
    assert "**28 bytes\nper fp32 parameter**" in section or "**28 bytes per fp32 parameter**" in section
    assert "| **total** | | | **80** |" in section
    assert f"{80 * _params('small') / 1e9:.1f} GB per step with `foreach`" in section
    assert "~16 bytes" not in rendered["ch01"] and "costs a few percent" not in section


def test_gemm_invocations_follow_the_layers(rendered):
    """1.5(c): one forward of `small` issues one GEMM per nn.Linear, counted here on the model."""
    import torch

    from kit.model import TransformerLM, get_config

    with torch.device("meta"):
        linears = sum(isinstance(m, torch.nn.Linear) for m in TransformerLM(get_config("small")).modules())
    section = _section(rendered, "ch01", "1.5")
    flat = " ".join(section.split())
    assert f"issues {linears} linear GEMMs" in flat and f"({2 * linears} in all" in flat


def test_memory_timeline_key_reads_its_table(rendered):
    """1.10: 4Ψ of the profiled model, and the peak phase of each step, from the committed rows."""
    rows = _results("bench_memory")
    section = _section(rendered, "ch01", "1.10")
    psi = _params(rows[0]["preset"])
    assert f"Ψ = {psi:,.0f} parameters: 4Ψ = {4 * psi / 2**20:.2f} MiB" in section
    for step in (1, 2):
        peak = max((r for r in rows if r["step"] == step), key=lambda r: r["total_MiB"])
        assert f"**{peak['phase'].replace('_', ' ')}**" in section and f"({peak['total_MiB']:.2f} MiB)" in section
    state = next(r for r in rows if r["step"] == 2 and r["phase"] == "forward")["optimizer_state_MiB"]
    assert 8 * psi / 2**20 <= state <= 8 * psi / 2**20 + 0.01, "AdamW's fp32 state is 8Ψ plus the step counters"


def test_compile_speedups_are_the_tables(rendered):
    """1.11: the key's speed-ups are eager's median over compiled's, from the committed rows."""
    rows = _results("bench_model_compile")
    section = _section(rendered, "ch01", "1.11")
    for mode, words in (("forward", "compiled forward was"), ("forward_backward", "compiled forward+backward")):
        eager = next(r for r in rows if r["mode"] == mode and r["compile"] == "eager")
        comp = next(r for r in rows if r["mode"] == mode and r["compile"] != "eager")
        assert f"{words} {eager['median_ms'] / comp['median_ms']:.2f}×" in " ".join(section.split())
    assert "unmeasured" in section


def test_fp16_limits_in_the_norm_and_range_answers(rendered):
    """2.3: x² overflows fp16 above √65504; 1/√(var + ε) is bounded by 1/√1e-5. 2.4: 1e-6 and 1e-7 are subnormal."""
    import math

    import torch

    norms = " ".join(_section(rendered, "ch02", "2.3").split())
    assert f"|x| > {math.sqrt(65504):.1f}" in norms and f"≈ {1 / math.sqrt(1e-5):.0f}" in norms
    assert "or overflows when var → 0" not in norms
    ranges = " ".join(_section(rendered, "ch02", "2.4").split())
    tiny = torch.finfo(torch.float16).tiny
    for x in (1e-6, 1e-7):
        stored = torch.tensor(x, dtype=torch.float16).item()
        assert 0 < stored < tiny and f"{stored:.4e}" in ranges
    assert "both as subnormals" in ranges


def test_residual_stream_crossing_names_its_dtype(rendered):
    """2.8.2: the softmax passes the MLP at T = 4·d_ff·c/(H·(4 + c)) in bf16 autocast on CUDA and 4·d_ff/H in fp32."""
    from kit.model import get_config

    xl = get_config("xl")
    section = " ".join(_section(rendered, "ch02", "2.8").split())
    assert f"= {4 * xl.d_ff * 2 / (xl.num_heads * 6):.0f} (the estimate" in section
    assert f"T = 4·d_ff/H = {4 * xl.d_ff / xl.num_heads:.0f}" in section


def _reversible(c: int, t: int, memo: dict = {}) -> int:  # noqa: B006 — a cache
    """Longest chain reversed with c slots (its input counted) and t runs per block, by the split recurrence."""
    if c < 1 or t < 1:
        return 0
    if c == 1 or t == 1:
        return c if t == 1 else 1
    if (c, t) not in memo:
        memo[c, t] = _reversible(c, t - 1) + _reversible(c - 1, t)
    return memo[c, t]


def _brute_force_slots(n: int, t: int) -> int:
    """The fewest slots that reverse a chain of n blocks, each run forward at most t times, by exhaustive search of
    the pebble game: slots hold block inputs (x_0 at the start); a block runs from a stored input into a new slot or
    over it; the last block's run gives the loss; block b is reversed, last first, when x_(b−1) is stored."""
    import functools

    def solvable(c: int) -> bool:
        @functools.cache
        def go(stored: frozenset, runs: tuple, b: int, loss: bool) -> bool:
            if b == 0:
                return True
            if loss and (b - 1) in stored and go(stored, runs, b - 1, loss):
                return True
            for i in stored:
                if i + 1 < n and i + 1 not in stored and runs[i] < t:  # runs[i]: block i+1's runs
                    bumped = runs[:i] + (runs[i] + 1,) + runs[i + 1:]
                    if len(stored) < c and go(stored | {i + 1}, bumped, b, loss):
                        return True
                    if go((stored - {i}) | {i + 1}, bumped, b, loss):
                        return True
                if i == n - 1 and not loss and runs[i] < t:
                    if go(stored, runs[:i] + (runs[i] + 1,), b, True):
                        return True
                if len(stored) > 1 and go(stored - {i}, runs, b, loss):
                    return True
            return False

        return go(frozenset({0}), (0,) * n, n, False)

    return next(c for c in range(1, n + 1) if solvable(c))


def test_binomial_checkpointing_slots_under_one_convention(rendered):
    """2.11.3: the recurrence L(c, t) = L(c, t − 1) + L(c − 1, t) is checked against an exhaustive search of the slot
    game on short chains, then gives L = 48: 10 slots at t = 2, 6 at t = 3 (9 and 5 with block 1's input free);
    single-level checkpointing with equal segments needs ⌈L/k⌉ + k − 1 = 13 (12)."""
    import math

    for n in range(1, 6):
        for t in (1, 2, 3):
            by_recurrence = next(c for c in range(1, n + 1) if _reversible(c, t) >= n)
            assert _brute_force_slots(n, t) == by_recurrence, (n, t)
    fewest = {t: next(c for c in range(1, 49) if _reversible(c, t) >= 48) for t in (2, 3)}
    single = min(math.ceil(48 / k) + k - 1 for k in range(1, 49))
    section = " ".join(_section(rendered, "ch02", "2.11").split())
    assert fewest == {2: 10, 3: 6} and single == 13
    assert f"the fewest slots is **{fewest[2]}**" in section and f"with **t = 3**, **{fewest[3]}**" in section
    assert f"= **{single}** slots" in section
    assert f"{fewest[2] - 1}, {fewest[3] - 1} and {single - 1}" in section


def test_spare_blocks_depend_on_their_position(rendered):
    """2.12.3: with twice the k = 1 peak, un-checkpointed blocks in the middle must fit beside a recomputed block;
    the last blocks need not. From the committed checkpoint rows."""
    import math

    from kit.model import get_config

    rows = _results("checkpoint")
    one = next(r for r in rows if r["k"] == 1)
    s = one["batch"] * one["context"] * get_config(one["preset"]).d_model * 4 / 2**20
    a1, big_a, p1 = one["after_forward_MiB"], one["recompute_MiB"], one["peak_saved_MiB"]
    middle = (2 * p1 - a1 - big_a) / (big_a - s)
    last = (2 * p1 - a1) / (big_a - s)
    section = " ".join(_section(rendered, "ch02", "2.12").split())
    assert f"n ≤ {middle:.2f} → **{math.floor(middle)}**" in section
    assert f"n ≤ {last:.2f} → **{math.floor(last)}**" in section
    assert math.floor(last) > math.floor(middle)


def test_bf16_saved_bytes_question_matches_the_table(rendered):
    """2.13.3: every committed row has bf16 keeping fewer bytes than fp32, but more than half."""
    rows = _results("precision")
    ratios = []
    for r in rows:
        if r["dtype"] == "bf16":
            fp32 = next(x for x in rows
                        if (x["preset"], x["context"], x["dtype"]) == (r["preset"], r["context"], "fp32"))
            ratios.append(r["saved_MiB"] / fp32["saved_MiB"])
    assert all(0.5 < x < 1 for x in ratios), ratios
    section = " ".join(_section(rendered, "ch02", "2.13").split())
    assert f"The ratio is {min(ratios):.2f}–{max(ratios):.2f}" in section
    assert "saves more" not in section


def test_naive_attention_runs_out_of_memory_where_the_key_says(rendered):
    """3.6(a), counted by hand from kit.model.naive_attention: the forward peaks inside ``masked_fill`` with the
    scaled and the masked scores (2N²·c per batch·head) and the boolean mask and its negation (2N², built once for
    all batch·heads); the forward+backward inside softmax's backward with P, dP and dS (3N²·c per batch·head) and
    the saved ``~mask`` (N²). At the grid's batch·heads 16 that first exceeds 79.1 GiB at N = 32768 in fp32, in
    bf16 forward+backward, and at 65536 for the bf16 forward (66 GiB at 32768). The key's measured table must give
    these coefficients: a measurement at one small N that folds q, k, v and O (N·D each: at N = 256, D = 64, a
    quarter of a score tensor) into "per N²" overstates the bf16 forward at 32768 by 8 GiB."""
    section = " ".join(_section(rendered, "ch03", "3.6").split())
    hand = {("fp32", "forward"): (8, 2), ("fp32", "forward_backward"): (12, 1),
            ("bf16", "forward"): (4, 2), ("bf16", "forward_backward"): (6, 1)}
    gib = {key: (lambda n, key=key: (16 * hand[key][0] + hand[key][1]) * n * n / 2**30) for key in hand}
    first_oom = {key: next(n for n in (8192, 16384, 32768, 65536) if gib[key](n) > 79.1) for key in hand}
    assert first_oom == {("fp32", "forward"): 32768, ("fp32", "forward_backward"): 32768,
                         ("bf16", "forward"): 65536, ("bf16", "forward_backward"): 32768}
    assert "the first OOM is at **N = 32768** for fp32" in section and "runs out at 65536" in section
    assert f"still fits at 32768 ({gib[('bf16', 'forward')](32768):.0f} GiB)" in section
    rows = {(m[1], m[2]): (float(m[3]), float(m[4])) for m in re.finditer(
        r"\| (fp32|bf16) \| (forward|forward_backward) \| ([\d.]+) \| ([\d.]+) \|", rendered["ch03"])}
    for key, (per_bh, shared) in hand.items():
        # The measurement is exact byte counts with the N·D terms cancelled: the table prints two decimals, so
        # anything beyond 0.01 per N² is a tensor the hand count does not have (or lacks one it has).
        assert abs(rows[key][0] - per_bh) <= 0.01 and abs(rows[key][1] - shared) <= 0.01, (
            f"3.6(a) {key}: the key measures {rows[key]} bytes per N² (per batch·head, shared), the hand count of "
            f"kit.model.naive_attention's N × N tensors gives {(per_bh, shared)}")


def test_flash_intensity_follows_the_handouts_traffic_model(rendered):
    """3.6(b): with K and V re-read once per query tile, a fused forward does 4N²D FLOPs per 2·N·D·c·N/B_M bytes:
    2·B_M/c = 128 FLOP/byte at B_M = 128 in bf16, below the H100's ridge of 989e12 / 3.35e12 ≈ 295."""
    section = " ".join(_section(rendered, "ch03", "3.6").split())
    n, d, c, block_m = 16384, 64, 2, 128
    intensity = 4 * n * n * d / (2 * n * d * c * n / block_m)
    assert f"**{intensity:.0f} FLOP/byte**" in section and f"below its ridge ({989e12 / 3.35e12:.0f})" in section
    assert "**N/c** FLOP/byte" in section and "assumption stated" in section


def test_bucket_size_key_uses_the_crossing_and_keeps_alpha(rendered):
    """4.8: E(b) = (S/b)·α + α + b/β at its optimum √(S·α·β) (46.4 ms for `small` on 1 ms / 1 GB/s, not 45.4); the max
    form's minimum, found here by a scan over b, sits at the crossing of its two terms, left of the smallest b that
    fits the backward."""
    import math

    section = " ".join(_section(rendered, "ch04", "4.8").split())
    S = _params("small") * 4
    for alpha, beta, fmt in ((20e-6, 100e9, ".2f"), (1e-3, 1e9, ".1f")):
        b = math.sqrt(S * alpha * beta)
        assert f"{(S / b * alpha + alpha + b / beta) * 1e3:{fmt}} ms" in section, (alpha, beta)
    alpha, beta, T = 20e-6, 100e9, 2 * S / 100e9
    exposed = lambda b: max(alpha + b / beta, S / b * alpha + S / beta - T)  # noqa: E731
    grid = [S * 1e-5 * 1.001**i for i in range(20000) if S * 1e-5 * 1.001**i <= S]
    best = min(grid, key=exposed)
    fit = S * alpha / (T - S / beta)
    lo, hi = S * 1e-5, S  # bisection on (rising − falling), which changes sign once
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if alpha + mid / beta > S / mid * alpha + S / beta - T else (mid, hi)
    assert abs(best / lo - 1) < 0.002 and best < fit, "the scan's minimum is where the terms cross"
    assert f"b_cross = {lo / 2**20:.2f} MiB" in section and f"b_fit = {fit / 2**20:.2f} MiB" in section
    assert "**the minimum of the max is at the crossing**" in section


def test_zero_imbalance_hint_and_key_use_the_same_body(rendered):
    """5.9.1: greedy whole-parameter ownership on N = 8, recomputed here: the 1B-shaped body with a tied 128 k
    embedding is badly unbalanced, the 8B-shaped one is not."""
    def greedy(sizes: list[int], n: int = 8) -> float:
        loads = [0] * n
        for size in sorted(sizes, reverse=True):
            loads[loads.index(min(loads))] += size
        return max(loads) / (sum(sizes) / n)

    def body(d: int, d_ff: int, layers: int, tied: bool) -> list[int]:
        return [128_256 * d] * (1 if tied else 2) + ([d * d] * 4 + [d * d_ff] * 3 + [d, d]) * layers + [d]

    small = greedy(body(2048, 8192, 16, True))
    large = greedy(body(4096, 14336, 32, False))
    section = " ".join(_section(rendered, "ch05", "5.9").split())
    assert small > 1.2 and large < 1.01
    assert f"{small:.2f}× Ψ/N on N = 8" in section and f"{large:.4f}× Ψ/N untied" in section
    hint = (answers.ROOT / "handout" / "05-zero.md").read_text()
    assert "Llama-3.2-1B-shaped body (d_model 2048, 16 layers, d_ff 8192, tied" in " ".join(hint.split())


def test_reshard_memory_is_compared_with_flash_attention_activations(rendered):
    """5.16.1: a 7B model's activations with FlashAttention are s·b·h·34 bytes per layer (Korthikanti without the
    5·a·s/h scores term): 32 layers ≈ 18 GB, so the 14 GB of gathered bf16 weights are ≈ 77 % of them."""
    s, b, h, layers = 4096, 1, 4096, 32
    flash = s * b * h * 34 * layers / 1e9
    section = " ".join(_section(rendered, "ch05b", "5.16").split())
    assert f"≈ {flash:.1f} GB in all" in section and f"**{14 / flash * 100:.0f} %**" in section


def test_tp_fsdp_split_gives_the_max_form_too(rendered):
    """5.20: with the two links concurrent, max(T_fsdp, T_tp) is smallest where they are equal: t(t − 1) = 81."""
    import math

    t_eq = (1 + math.sqrt(1 + 4 * 81)) / 2
    fsdp8 = 36 * 8192**2 * 2 / (8 * 50e9)
    section = " ".join(_section(rendered, "ch05b", "5.20").split())
    assert f"**t = {t_eq:.2f}**" in section and f"at t = 8 the max is {fsdp8 * 1e3:.1f} ms" in section


def test_smallest_model_parallel_for_10b_is_not_a_power_of_two(rendered):
    """6.7: 16Ψ/m ≤ 80 GB for the smallest integer m, with Ψ counted on the meta device; tp = m divides the heads."""
    from kit.model import get_config

    psi = _params("10B")
    m = next(m for m in range(1, 64) if 16 * psi / m <= 80e9)
    cfg = get_config("10B")
    assert m == 3 and cfg.num_heads % m == 0 and cfg.d_ff % m == 0
    section = " ".join(_section(rendered, "ch06", "6.7").split())
    assert f"| 0 | impossible | {m} | 4 |" in section and f"{16 * psi / m / 1e9:.1f} GB per device" in section
    assert "power-of-two tp·pp that makes" not in section


def test_communication_bounds_come_before_their_use():
    """6.8 derives the bounds, 6.9 uses them; 2.11–2.13 and every chapter's problems are numbered in order."""
    from kit.grading.handout_check import parse_handout

    for chapter in answers.chapters():
        numbers = [p.number for p in parse_handout(answers.ROOT / "handout" / chapter)]
        minors = [int(n.split(".")[1]) for n in numbers]
        assert minors == sorted(minors), f"{chapter}: problems out of order: {numbers}"
    text = (answers.ROOT / "handout" / "06-4d-parallelism.md").read_text()
    assert text.index("Problem 6.8 — When each axis is communication-bound") < text.index(
        "Problem 6.9 — Compute-bound FSDP × TP")


def test_tp_backward_key_counts_bytes_and_flops(rendered):
    """6.13: n·d·c bytes per all-reduce (64 MiB at n = 4096, d = 8192, bf16), 2(t−1)/t of it sent per rank at 450 GB/s,
    against 3 × 4·n·d·f/t FLOPs at half the H100's peak."""
    n, d, f, t, c = 4096, 8192, 4 * 8192, 8, 2
    allreduce = 2 * (t - 1) / t * n * d * c / 450e9
    compute = 3 * 4 * n * d * f / t / (0.5 * 989e12)
    section = " ".join(_section(rendered, "ch06", "6.13").split())
    assert f"{n * d * c / 2**20:.0f} MiB (bf16)" in section and f"{allreduce * 1e3:.2f} ms on NVLink" in section
    assert f"**{2 * allreduce / compute * 100:.0f} %**" in section
    assert "dX = Σ_r dH_r · A_rᵀ — one all-reduce" in section
    # One all-reduce against the forward is 23 %, against the backward 12 %, both against the layer 16 %: the
    # question says which.
    assert "(forward and backward)" in _problem_text("06-4d-parallelism.md", "6.13")


# ------------------------------------------------------------------------------------------------------------------
# Issue 42: the second derivation of chapters 07/07b and the changed problems. Each figure is recomputed here from
# first principles (the task's shape, the data sheets' peaks, the kit's tiles read from the reference) and compared
# with the rendered key; the handout must state the assumption that decides it.
# ------------------------------------------------------------------------------------------------------------------

def _problem_text(chapter: str, number: str) -> str:
    """The handout's text of one problem, from its heading to the next heading, whitespace collapsed."""
    import re

    text = (answers.ROOT / "handout" / chapter).read_text()
    start = re.search(rf"^### Problem {re.escape(number)} .*$", text, re.M)
    assert start, f"{chapter} has no Problem {number}"
    end = re.search(r"^#{2,3} ", text[start.end():], re.M)
    return " ".join(text[start.start():start.end() + (end.start() if end else len(text))].split())


# The 8B task of chapters 07 and 07b (CS336's): d, d_ff, layers, heads, vocabulary, context, sequences.
_D, _DFF, _L, _H, _V, _T, _B = 4096, 11_008, 34, 32, 151_936, 32_768, 2
_TOKENS = _B * _T
_H100_BF16, _H100_HBM = 989e12, 3.35e12  # H100 SXM data sheet: dense bf16, HBM3


def _task_8b_flops() -> dict[str, float]:
    """The 8B step's model FLOPs by hand: 6·P per token for the weights (P without the embedding, the LM head in),
    6·L·d·T per token for causal attention; one sweep of the LM head is 2·N·V·d."""
    p_body = _L * (4 * _D * _D + 3 * _D * _DFF + 2 * _D) + _D
    p_ne, p_all = p_body + _V * _D, p_body + 2 * _V * _D
    weights, attention = 6 * p_ne * _TOKENS, 6 * _L * _D * _T * _TOKENS
    return {"p_ne": p_ne, "p_all": p_all, "weights": weights, "attention": attention, "step": weights + attention,
            "sweep": 2 * _TOKENS * _V * _D}


def test_the_8b_task_is_the_leaderboards():
    """The shape the tests below use is the kit's gpu2-8b task, and its parameter count the meta-device model's."""
    import torch

    from kit.leaderboard import TASKS
    from kit.model import TransformerLM

    task = TASKS["gpu2-8b"]
    cfg = task.model
    assert (cfg.d_model, cfg.d_ff, cfg.num_layers, cfg.num_heads, cfg.vocab_size) == (_D, _DFF, _L, _H, _V)
    assert (task.batch, cfg.context_length) == (_B, _T)
    with torch.device("meta"):
        m = TransformerLM(cfg)
    assert sum(p.numel() for p in m.parameters()) == _task_8b_flops()["p_all"]


def test_lm_head_share_counts_attention_and_not_the_embedding(rendered):
    """7.5(2): in the kit's convention the step is 4.74 PFLOP at T = 32,768 (attention 38 %), not 6·P·N = 3.20 with
    the embedding in P; the LM head is 5.2 % of it naive (3 sweeps) and 8.6 % fused (5)."""
    f = _task_8b_flops()
    section = " ".join(_section(rendered, "ch07", "7.5").split())
    assert f"**{f['step'] / 1e15:.2f} PFLOP**" in section
    assert f"**{100 * f['attention'] / f['step']:.0f} % of the step**" in section
    assert f"**{100 * 3 * f['sweep'] / f['step']:.1f} %** of it naive" in section
    assert f"**{100 * 5 * f['sweep'] / f['step']:.1f} %** fused" in section
    assert f"P = {f['p_ne']:,} non-embedding parameters" in section
    assert (round(f["step"] / 1e15, 2), round(100 * 3 * f["sweep"] / f["step"], 1)) == (4.74, 5.2)
    question = _problem_text("07-fused-loss.md", "7.5")
    assert "*non-embedding* parameters" in question and "6·L·d·T per token for the causal attention" in question
    assert "≈ 6·P·N (P the parameter count)" not in question
    # The fused share is 8.6 % of the step's model FLOPs, 8.3 % of what the step executes with the recomputation:
    # the question must say which.
    assert "Divide every design by the same step figure" in question and "count no recomputation" in question


def _kit_tiles() -> dict[str, int]:
    """The fused loss's bf16 GPU tiles, read from the reference (and the student copy the handout points to)."""
    import importlib

    import torch

    ref = importlib.import_module("reference.whole_step.fused_cross_entropy").GPU_BLOCKS[torch.bfloat16]
    student = importlib.import_module("student.whole_step.fused_cross_entropy").GPU_BLOCKS[torch.bfloat16]
    assert student == ref, "the student's launch_config tiles differ from the reference's"
    return ref


def test_problem_7_6_states_the_kits_tiles():
    """7.6 names its tiles; they must be the ones launch_config gives on a GPU (bf16)."""
    import re

    tiles = _kit_tiles()
    question = _problem_text("07-fused-loss.md", "7.6")
    stated = re.search(r"BLOCK_T = (\d+), BLOCK_V = (\d+), BLOCK_D = (\d+)", question)
    assert stated, "7.6 must state the tile sizes it asks about"
    assert tuple(map(int, stated.groups())) == (tiles["BLOCK_T"], tiles["BLOCK_V"], tiles["BLOCK_D"])
    block_d = re.search(r"the kit's BLOCK_D = (\d+)", question)
    assert block_d and int(block_d.group(1)) == tiles["BLOCK_D"], "part 3 must use the kit's BLOCK_D"


def test_fused_loss_forward_is_l2_bound_at_the_kits_tiles(rendered):
    """7.6(1): W is read 1.27 TB and h re-read 0.64 TB by the forward grid; the tile intensity BT·BV/(BT + BV) =
    42.7 FLOP/B needs 23.2 TB/s to run at 989 TFLOP/s; at the 5.5–12 TB/s the question gives for L2 the forward is
    1.9–4.2× slower than its compute."""
    import re

    tiles = _kit_tiles()
    bt, bv = tiles["BLOCK_T"], tiles["BLOCK_V"]
    programs, vocab_tiles = -(-_TOKENS // bt), -(-_V // bv)
    w_bytes = programs * _V * _D * 2
    h_bytes = programs * vocab_tiles * bt * _D * 2
    compute = 2 * _TOKENS * _V * _D / _H100_BF16
    intensity = 2 * _TOKENS * _V * _D / (w_bytes + h_bytes)
    assert abs(intensity - bt * bv / (bt + bv)) < 1e-9
    question = _problem_text("07-fused-loss.md", "7.6")
    lo, hi = map(float, re.search(r"take ([\d.]+)–([\d.]+) TB/s", question).groups())
    section = " ".join(_section(rendered, "ch07", "7.6").split())
    assert f"**{w_bytes / 1e12:.2f} TB of W reads**" in section and f"**{h_bytes / 1e12:.2f} TB more**" in section
    assert f"**{intensity:.1f} FLOP/B**" in section and f"**{_H100_BF16 / intensity / 1e12:.1f} TB/s**" in section
    slow = (w_bytes + h_bytes) / (hi * 1e12) / compute, (w_bytes + h_bytes) / (lo * 1e12) / compute
    assert f"**L2-bound by {slow[0]:.1f}–{slow[1]:.1f}×**" in section and slow[0] > 1
    assert "What saves it is the L2 cache" not in section


def test_split_d_sweeps_use_the_kits_block_d(rendered):
    """7.6(3): 2·⌈d/BLOCK_D⌉ + 2 backward sweeps with the kit's BLOCK_D = 32: 6 at d = 64, 258 at d = 4096."""
    block_d = _kit_tiles()["BLOCK_D"]
    sweeps = {d: 2 * -(-d // block_d) + 2 for d in (64, 4096)}
    section = " ".join(_section(rendered, "ch07", "7.6").split())
    assert f"the kit's BLOCK_D = {block_d}" in section
    assert f"at d = 64, **{sweeps[64]} sweeps**" in section and f"d = 4096, **{sweeps[4096]} sweeps**" in section


def test_dh_accumulators_leave_l2_above_a_d_of_1480(rendered):
    """7.6(2): per vocabulary tile the dH program does 4·BT·BV·d FLOPs and moves 8·BT·d bytes of fp32 accumulator:
    BV/2 = 64 FLOP/B at the kit's tiles, below the H100's ridge (295). One resident program per SM (the question's
    assumption): 132 × BT × d × 4 B must fit the 50 MB of L2, so d ≲ 1,480; at d = 4096 they take 138 MB. Even
    from L2, 64 FLOP/B needs 15.5 TB/s at peak, above the 5.5–12 TB/s the question gives."""
    import re

    tiles = _kit_tiles()
    bt, bv = tiles["BLOCK_T"], tiles["BLOCK_V"]
    intensity = 4 * bt * bv * _D / (8 * bt * _D)
    assert intensity == bv / 2 and intensity < _H100_BF16 / _H100_HBM
    sms, l2 = 132, 50e6
    d_max = l2 / (sms * bt * 4)
    assert sms * bt * _D * 4 > l2 and 64 < d_max < _D
    question = _problem_text("07-fused-loss.md", "7.6")
    assert "one resident program per SM" in question and "the recomputed logits' as well as dZ·W's" in question
    _, hi = map(float, re.search(r"take ([\d.]+)–([\d.]+) TB/s", question).groups())
    assert _H100_BF16 / intensity > hi * 1e12
    section = " ".join(_section(rendered, "ch07", "7.6").split())
    assert f"**BLOCK_V/2 = {intensity:.0f} FLOP/B**" in section and f"take {sms * bt * _D * 4 / 1e6:.0f} MB" in section
    assert f"**d ≲ {d_max:,.0f}**" in section and f"{_H100_BF16 / intensity / 1e12:.1f} TB/s" in section


def test_adamw_bytes_and_times_for_the_8b_model(rendered):
    """7.10(1)–(2): 80 B per fp32 parameter through the eight foreach operations (traced for chapter 01 above), 28 B
    for one fused kernel, fp32 or with master weights (2 + 12 read, 12 + 2 written); on an H100's 3.35 TB/s the 8 B
    model's optimizer step takes at least 194 ms and 68 ms — all 8.13 B parameters, the embedding's too. The
    question states both choices that decide the numbers (g read once; every parameter)."""
    p_all = _task_8b_flops()["p_all"]
    assert 2 + 4 + 4 + 4 + 4 + 4 + 4 + 2 == 28 == 4 * 4 + 3 * 4
    section = " ".join(_section(rendered, "ch07b", "7.10").split())
    assert "80 bytes through memory per parameter, against 28 for one fused kernel" in section
    assert f"({p_all / 1e9:.2f} B parameters)" in section
    assert f"at least {80 * p_all / _H100_HBM * 1e3:.0f} ms per optimizer step with the foreach path, " \
           f"{28 * p_all / _H100_HBM * 1e3:.0f} ms fused" in section
    assert "28 bytes per parameter, the same as fp32" in section
    question = _problem_text("07b-whole-step.md", "7.10")
    assert "is read once" in question and "the embedding's too" in question


def test_foreach_is_not_one_launch_per_operation(rendered):
    """7.10 and 07b §4: PyTorch's multi_tensor_apply (MultiTensorApply.cuh) launches at most 320 blocks of 65,536
    elements and 30–110 tensors (2,240 blocks and 210–770 tensors with CUDA ≥ 12.1's 32 KB arguments). If the tensor
    cap never binds, launch k covers chunks [k·B, (k + 1)·B): for the 8 B model none of those windows holds as many
    tensors as the smallest cap, so by induction ⌈chunks/B⌉ launches per operation."""
    import math

    import torch

    from kit.leaderboard import TASKS
    from kit.model import TransformerLM

    with torch.device("meta"):
        sizes = [p.numel() for p in TransformerLM(TASKS["gpu2-8b"].model).parameters()]
    owner = [i for i, n in enumerate(sizes) for _ in range(math.ceil(n / 65_536))]  # the tensor of each chunk
    for blocks, fewest_tensors in ((320, 30), (2_240, 210)):
        most = max(len(set(owner[k:k + blocks])) for k in range(0, len(owner), blocks))
        assert most < fewest_tensors, f"the tensor cap would bind at {blocks} blocks"
    launches = {blocks: math.ceil(len(owner) / blocks) for blocks in (320, 2_240)}
    section = " ".join(_section(rendered, "ch07b", "7.10").split())
    assert f"{launches[320]} launches here, {8 * launches[320]:,} per step" in section
    assert f"{launches[2_240]} per operation ({8 * launches[2_240]} per step)" in section
    assert f"= {8 * len(sizes):,} launches per step" in section and "8 per chunk of tensors" not in section
    handout = " ".join((answers.ROOT / "handout" / "07b-whole-step.md").read_text().split())
    assert f"about {launches[320]} ({launches[2_240]} with the larger arguments)" in handout
    assert "one multi-tensor-apply kernel launch per operation" not in handout


def test_bf16_cpu_speed_is_read_from_the_table(rendered):
    """7.13(2): the key quotes the committed bench_step's bf16 rows, and calls bf16 faster only on a CPU with bf16
    units (the table's machine line), where those rows are below 1."""
    import json

    data = json.loads((answers.ROOT / "benchmarks" / "results" / "bench_step.json").read_text())
    rows = {r["config"]: r for r in data["rows"]}
    auto, weights = rows["bf16 autocast"], rows["bf16 weights + master"]
    for r in (auto, weights):
        assert abs(r["step_ms"] / rows["naive"]["step_ms"] - r["vs_naive"]) < 1e-3
    section = " ".join(_section(rendered, "ch07b", "7.13").split())
    assert f"autocast {auto['vs_naive']:.2f}× and bf16 weights {weights['vs_naive']:.2f}×" in section
    assert "native_bf16: yes" in (answers.ROOT / "benchmarks" / "results" / "bench_step.md").read_text()
    assert auto["vs_naive"] < 1 and weights["vs_naive"] < 1, "the key says bf16 is faster on the committed machine"
    assert "`bf16 units`" in _problem_text("07b-whole-step.md", "7.13")


def test_8b_step_time_leaves_the_embedding_out(rendered):
    """7.14(3) and 07b §6: at 40 % MFU on two B200s (2.25 PFLOP/s each) the step is 2.64 s with the kit's N
    (no embedding); 2.77 s with the embedding counted is the wrong answer the key names."""
    f = _task_8b_flops()
    rate = 2 * 2.25e15 * 0.4
    section = " ".join(_section(rendered, "ch07b", "7.14").split())
    assert f"**{f['step'] / rate:.2f} s**" in section and round(f["step"] / rate, 2) == 2.64
    assert f"counting the embedding in N ({(6 * f['p_all'] * _TOKENS + f['attention']) / rate:.2f} s" in section
    handout = " ".join((answers.ROOT / "handout" / "07b-whole-step.md").read_text().split())
    assert "N the non-embedding parameters with the LM head included" in handout


def test_causal_grid_crosses_the_ridge_at_twice_the_length(rendered):
    """3.6(b): with K and V read from HBM once, a causal forward does 2N²D FLOPs per 4·N·D·c bytes, N/(2c) FLOP/byte:
    an H100 (989 TFLOP/s, 3.35 TB/s) turns compute-bound above N ≈ 1,181 in bf16 (590 non-causal). The problem is a
    GPU problem and says so in its heading."""
    ridge = _H100_BF16 / _H100_HBM
    n_causal = next(n for n in range(1, 10_000) if (2 * n * n * 64) / (4 * n * 64 * 2) >= ridge)
    assert abs(n_causal - 4 * ridge) < 1
    section = " ".join(_section(rendered, "ch03", "3.6").split())
    assert f"**N ≈ 2c × ridge = {4 * ridge:.0f}**" in section and f"non-causal {2 * ridge:.0f}" in section
    assert "**N/(2c)** causal" in section
    handout = (answers.ROOT / "handout" / "03-flash-attention.md").read_text()
    assert "### Problem 3.6 — Benchmark and roofline (written, GPU)" in handout
    assert "The grid is causal" in _problem_text("03-flash-attention.md", "3.6")


def test_optimizer_phase_extra_is_adamw_temporaries(rendered):
    """1.10(a): the optimizer phase's peak holds 4Ψ + 8Ψ + 4Ψ, the inputs and 1 MiB more in both steps: torch's
    per-tensor AdamW (the default on a CPU) keeps √v and √v/√(1 − β₂ᵗ) of the largest tensor (1024 × 128 fp32,
    0.5 MiB) alive at once. Recomputed from the table, and measured here on one such tensor."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from kit import memory_timeline
    from kit.model import get_config

    rows = _results("bench_memory")
    cfg = get_config(rows[0]["preset"])
    psi_mib, big = 4 * _params(rows[0]["preset"]) / 2**20, cfg.vocab_size * cfg.d_model * 4 / 2**20
    extra = {}
    for step in (1, 2):
        r = next(x for x in rows if x["step"] == step and x["phase"] == "optimizer_step")
        extra[step] = r["total_MiB"] - psi_mib - r["optimizer_state_MiB"] - r["gradient_MiB"] - r["input_MiB"]
        assert abs(extra[step] - 2 * big) < 0.01, (step, extra[step])
    one = next(x for x in rows if x["step"] == 1 and x["phase"] == "optimizer_step")
    two = next(x for x in rows if x["step"] == 2 and x["phase"] == "optimizer_step")
    assert abs(one["parameter_MiB"] - psi_mib - big) < 0.01 and abs(one["activation_MiB"] - big) < 0.01
    assert abs(two["unknown_MiB"] - 2 * big) < 0.01

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func._schema.name)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(cfg.vocab_size, cfg.d_model))
    param.grad = torch.randn_like(param)
    opt = torch.optim.AdamW([param], lr=1e-3)
    opt.step()  # the state exists from here on
    with Ops() as ops:
        opt.step()
    assert not any("_foreach" in n for n in ops.names), "AdamW's default on a CPU is the per-tensor loop"
    total = memory_timeline.record(opt.step).total()
    assert abs((max(total) - total[0]) / 2**20 - 2 * big) < 0.01
    section = " ".join(_section(rendered, "ch01", "1.10").split())
    assert f"**{extra[2]:.2f} MiB more**" in section and "per-tensor loop" in section
    assert "Account for every MiB of the optimizer phase's peak" in _problem_text("01-benchmarking.md", "1.10")


def test_compile_problem_says_where_the_loss_runs_and_what_inductor_needs(rendered):
    """1.11: bench_model computes the loss outside the compiled module (the key does not call it fused), and on a
    CPU inductor needs the C++ compiler its config names (g++ on Linux unless CXX says otherwise)."""
    import inspect
    import os
    import sys

    import torch._inductor.config as inductor_config

    import reference.benchmarking as benchmarking

    source = inspect.getsource(benchmarking.benchmark_model)
    assert "logits = model(inputs)" in source and "loss = cross_entropy(logits, targets)" in source
    default = "clang++" if sys.platform == "darwin" else "g++"
    assert inductor_config.cpp.cxx[-1] == os.environ.get("CXX", default)
    handout = " ".join((answers.ROOT / "handout" / "01-benchmarking.md").read_text().split())
    assert "runs eager outside the compiled module" in handout and "`InvalidCxxCompiler`" in handout
    section = " ".join(_section(rendered, "ch01", "1.11").split())
    assert "the loss's log-softmax — each" not in section and "Not the loss" in section


def test_sequence_parallel_bytes_depend_on_regathering_x(rendered):
    """6.13(4): a reduce-scatter or all-gather of S = n·d·c sends (t − 1)/t·S per rank (0.13 ms at n = 4096,
    d = 8192, bf16, t = 8, 450 GB/s); keeping the gathered X, four per layer move what two all-reduces move; gathering
    X again in the backward (Megatron-LM) adds a fifth: 5/4 of the bytes, for S·(1 − 1/t) less stored."""
    n, d, t, c, beta = 4096, 8192, 8, 2, 450e9
    size = n * d * c
    half = (t - 1) / t * size / beta
    section = " ".join(_section(rendered, "ch06", "6.13").split())
    assert f"rank ({half * 1e3:.2f} ms here)" in section and f"four collectives, {4 * half * 1e3:.2f} ms" in section
    assert f"**{5 / 4:.2f}× the bytes** (+{half * 1e3:.2f} ms per layer)" in section
    assert f"{(1 - 1 / t) * size / 2**20:.0f} MiB less stored" in section
    assert "gathering it again in the backward" in _problem_text("06-4d-parallelism.md", "6.13")


def test_rmsnorm_saves_an_fp32_input_so_logits_are_not_the_only_upcast():
    """07 §1: the kit's RMSNorm saves its bf16 input in fp32 for the backward; the handout no longer calls the
    logits the only activation upcast to fp32."""
    import torch

    from kit.model import RMSNorm

    saved = []
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        RMSNorm(64)(x)
    assert any(t.dtype == torch.float32 and t.shape == x.shape for t in saved)
    text = " ".join((answers.ROOT / "handout" / "07-fused-loss.md").read_text().split())
    assert "only activation upcast to fp32" not in text and "RMSNorm computes in fp32" in text


# ------------------------------------------------------------------------------------------------------------------
# Issue 44: chapter 06b (context parallelism). Each keyed figure is recomputed here from the handout's model (§7) and
# the data sheets' figures, without the key's helpers, and looked for in the rendered key.
# ------------------------------------------------------------------------------------------------------------------

# Handout 06b §7: an 8B-like model with GQA at 128k tokens, cp = 8, bf16; H100 SXM, NVLink and InfiniBand per GPU.
_CP_S, _CP, _CP_H, _CP_HKV, _CP_D, _CP_C, _CP_DMODEL, _CP_LAYERS = 131_072, 8, 32, 8, 128, 2, 4096, 32
_NVLINK, _IB = 450e9, 50e9


def test_cp_model_and_links_are_the_handouts():
    """The key's model and links are the ones handout 06b §7 states (and chapter 06's Problem 6.9 uses)."""
    text = " ".join((answers.ROOT / "handout" / "06b-context-parallel.md").read_text().split())
    assert "h = 4096, 32 layers, H = 32 query heads of d_head = 128" in text and "H_kv = 8" in text
    assert "s = 131,072" in text and "cp = 8" in text
    assert "NVLink at about 450 GB/s per direction" in text and "400 Gb/s InfiniBand (50 GB/s)" in text
    assert "989 TFLOP/s" in text


def test_ring_allgather_and_ulysses_bytes(rendered):
    """6.19: a K/V block is 2·n·H_kv·d·c; the ring sends cp − 1 of them forward, and in the backward cp − 1 again plus
    cp fp32 dK/dV blocks; Ulysses sends (cp − 1)/cp of n·d·c·(2H + 2H_kv) each way."""
    n = _CP_S // _CP
    block = 2 * n * _CP_HKV * _CP_D * _CP_C
    ring_fwd = (_CP - 1) * block
    ring_bwd = ring_fwd + _CP * 2 * n * _CP_HKV * _CP_D * 4
    ulysses = (_CP - 1) / _CP * n * _CP_D * _CP_C * (2 * _CP_H + 2 * _CP_HKV)
    section = " ".join(_section(rendered, "ch06b", "6.19").split())
    assert f"{block / 1e6:.1f} MB here" in section
    assert f"ring **{ring_fwd / 1e6:.0f} MB** forward and **{ring_bwd / 1e6:.0f} MB** backward" in section
    assert f"Ulysses **{ulysses / 1e6:.0f} MB** each way" in section
    assert ulysses < ring_fwd  # at cp = 8 with GQA the all-to-all moves less than the ring


def test_ring_overlap_thresholds(rendered):
    """6.20: 4·n²·d·H / F ≥ 2·n·d·H_kv·c / W ⇔ n ≥ (H_kv/H)·c·F/(2W), found here by search, not by the formula;
    causal (half a block per step) doubles it."""
    from fractions import Fraction

    def smallest(link: float, flop_share: Fraction) -> int:  # exact arithmetic: InfiniBand's threshold is an integer
        return next(n for n in range(1, 100_000) if flop_share * 4 * n * n * _CP_D * _CP_H / Fraction(_H100_BF16)
                    >= Fraction(2 * n * _CP_D * _CP_HKV * _CP_C) / Fraction(link))

    section = " ".join(_section(rendered, "ch06b", "6.20").split())
    for link in (_NVLINK, _IB):
        full, causal = smallest(link, Fraction(1)), smallest(link, Fraction(1, 2))
        assert f"n ≥ **{full}**" in section and f"n ≥ **{causal}**" in section, (link, full, causal)
    n = _CP_S // _CP
    compute = 4 * n * n * _CP_D * _CP_H / _H100_BF16 / 2
    assert f"computes for {compute * 1e3:.2f} ms at peak" in section
    assert f"in {2 * n * _CP_HKV * _CP_D * _CP_C / _NVLINK * 1e3:.3f} ms over NVLink" in section


def test_activation_memory_per_rank_divides_by_cp(rendered):
    """6.21: (34·n·b·h + 4·a·n·b) bytes per layer with FlashAttention, n = s/cp, 32 layers; the 80 GB crossings."""
    def gb(s: int, cp: int) -> float:
        n = s // cp
        return _CP_LAYERS * (34 * n * _CP_DMODEL + 4 * _CP_H * n) / 1e9

    section = " ".join(_section(rendered, "ch06b", "6.21").split())
    row = "| 131,072 | " + " | ".join(f"{gb(131_072, cp):.1f}" for cp in (1, 2, 4, 8)) + " |"
    assert row in section, row
    per_token = _CP_LAYERS * (34 * _CP_DMODEL + 4 * _CP_H) / 1e9
    assert f"s ≈ {int(80 / per_token):,} tokens" in section and f"s ≈ {int(80 * 8 / per_token):,}" in section
    scores = 5 * _CP_H * _CP_S * _CP_S / 1e9
    assert f"{scores:.0f} GB per layer at 128k without cp" in section


def test_causal_imbalance_counts_pairs(rendered):
    """6.22: the work of a rank is Σ (p + 1) over its positions p (query p sees keys 0 … p), counted here from the
    layouts' positions; contiguous's max/min is 1 + 2(cp−1)·n/(n+1), zig-zag's exactly 1. The ring's time, the
    slowest rank's pairs per step, gives zig-zag a speed-up of about 2 − 1/cp."""
    def pairs(lo: int, hi: int) -> int:  # Σ_{p=lo}^{hi−1} (p + 1)
        return (hi * (hi + 1) - lo * (lo + 1)) // 2

    section = " ".join(_section(rendered, "ch06b", "6.22").split())
    for cp in (2, 4, 8):
        n, c = _CP_S // cp, _CP_S // (2 * cp)
        contiguous = [pairs(r * n, (r + 1) * n) for r in range(cp)]
        zigzag = [pairs(r * c, (r + 1) * c) + pairs((2 * cp - 1 - r) * c, (2 * cp - r) * c) for r in range(cp)]
        assert sum(contiguous) == sum(zigzag) == _CP_S * (_CP_S + 1) // 2
        assert f"| {cp} | {max(contiguous) / min(contiguous):.5f} | {max(zigzag) / min(zigzag):.5f} | {2 * cp - 1} |" \
            in section
        slow_contiguous = n * (n + 1) // 2 + (cp - 1) * n * n
        slow_zigzag = 2 * c * c + c + (cp - 1) * 2 * c * c
        assert f"**{slow_contiguous / slow_zigzag:.3f}**" in section
        assert abs(slow_contiguous / slow_zigzag - (2 - 1 / cp)) < 1e-3
