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
    """3.6(a): naive attention's forward holds 2N²·c + 2N² bytes per batch·head at its peak (two score-sized
    tensors and two boolean masks, counted by hand from kit.model.naive_attention); at the grid's batch·heads 16
    that first exceeds 80 GB at N = 32768 in both dtypes."""
    section = " ".join(_section(rendered, "ch03", "3.6").split())
    forward = {c: (lambda n, c=c: 16 * (2 * n * n * c + 2 * n * n) / 2**30) for c in (2, 4)}
    first_oom = {c: next(n for n in (8192, 16384, 32768, 65536) if forward[c](n) > 79.1) for c in (2, 4)}
    assert first_oom == {2: 32768, 4: 32768}
    assert "the first OOM is at **N = 32768**" in section
    cells = f"{forward[4](8192):.0f} | {forward[4](16384):.0f} | {forward[4](32768):.0f} **OOM**"
    assert f"| fp32 | forward | 10.00 | {cells}" in rendered["ch03"]


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
    from kit.handout_check import parse_handout

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
