"""Stage 6 — memory and communication accounting on paper (handout 06 §6). No ranks needed.

The accounting functions run in the worker (``worker.call``): the module-level functions below call them
and return their numbers as data; the tests judge those numbers here, against the formulas, the ZeRO
paper's figures and a model the judge builds itself (``tests/support/moe.py``).

The communication counts are also checked against a real training step in test_stage6_mesh_4d.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import kit.impl
from kit.checks import outcome_of
from kit.model import ModelConfig
from kit.testing import assert_close, assert_equal, assert_raised
from tests.support.moe import moe_transformer

pytestmark = pytest.mark.stage6

GB = 1e9

# ----------------------------------------------------------------------------------------------------
# What runs in the worker: the implementation's accounting, its numbers back
# ----------------------------------------------------------------------------------------------------


def _accounting():
    return kit.impl.load().parallel.accounting


def _training_state(printed: dict[int, float]) -> dict:
    acc = _accounting()
    return {"paper": {stage: acc.training_state_bytes(7.5e9, zero_stage=stage, dp=64)["total"] for stage in printed},
            "parts": acc.training_state_bytes(1e9, zero_stage=2, dp=8),
            "bad_stage": outcome_of(acc.training_state_bytes, 1e9, zero_stage=4, dp=8)}


def _devices_needed(cases: list[tuple[int, int]]) -> dict:
    acc = _accounting()
    return {(mp, stage): acc.devices_needed(405e9, 80 * GB, zero_stage=stage, model_parallel=mp) for mp, stage in cases}


def _activation_memory(s: int, b: int, h: int, a: int) -> dict:
    acc = _accounting()
    return {"tp": {t: acc.activation_bytes_per_layer(s, b, h, a, tp=t) for t in (1, 8)},
            "sp": acc.activation_bytes_per_layer(s, b, h, a, tp=8, sequence_parallel=True),
            "tp8": acc.activation_bytes_per_layer(s, b, h, a, tp=8),
            "mem": acc.memory_per_device(175e9, num_layers=96, seq_len=s, micro_batch=b, d_model=h, num_heads=a,
                                         dp=8, tp=8, pp=8, zero_stage=1)}


def _stage_parameter_counts(kwargs: dict) -> list:
    impl = kit.impl.load()
    cfg = impl.parallel.train_4d.Train4DConfig(**kwargs)
    return [impl.parallel.accounting.stage_parameter_counts(cfg, stage) for stage in range(cfg.pp)]


def _fsdp_tp_compute_bound(kwargs: dict) -> dict:
    return _accounting().fsdp_tp_compute_bound(**kwargs)


def _cp_accounting(s: int, b: int, h: int, a: int, cfg_kwargs: dict) -> dict:
    impl = kit.impl.load()
    acc = impl.parallel.accounting
    cfg = impl.parallel.train_4d.Train4DConfig(**cfg_kwargs)
    mem = {cp: acc.memory_per_device(175e9, num_layers=96, seq_len=s, micro_batch=b, d_model=h, num_heads=a,
                                     dp=8, tp=8, pp=8, zero_stage=1, cp=cp) for cp in (1, 4)}
    return {"mem": mem, "per_layer_short": acc.activation_bytes_per_layer(s // 4, b, h, a, tp=8),
            "volume": {stage: acc.comm_volume_per_step(cfg, stage) for stage in range(cfg.pp)}}


# ----------------------------------------------------------------------------------------------------
# The tests: the judge's side
# ----------------------------------------------------------------------------------------------------


@pytest.mark.points(2)
def test_training_state_matches_zero_paper(worker):
    # ZeRO paper, Figure 1: Ψ = 7.5B parameters, N_d = 64 data-parallel devices, K = 12.
    printed = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    got = worker.call(_training_state, printed)
    for stage, gb in printed.items():
        total = got["paper"][stage] / GB
        # The paper prints one decimal: half a unit of it, 0.05 GB (fp64 arithmetic adds ~1e-16 relative).
        assert abs(total - gb) < 0.05, (
            f"training_state_bytes(7.5e9, zero_stage={stage}, dp=64) = {total:.2f} GB; the ZeRO paper prints {gb} GB. "
            "See handout 06 §6.1.")
    parts = got["parts"]
    # Closed forms in fp64 (u = 2⁻⁵³ ≈ 1e-16): a few roundings in any order, ≲ 1e-15; rtol 1e-12 here and below,
    # where a wrong coefficient is ≥ 1 % off. memory_per_device sums more terms: rtol 1e-9.
    assert_close(torch.tensor([parts["weights"], parts["gradients"], parts["optimizer"]], dtype=torch.float64),
                 torch.tensor([2e9, 2e9 / 8, 12e9 / 8], dtype=torch.float64),
                 name="ZeRO-2 weights, gradients, optimizer bytes for 1B parameters on 8 ranks",
                 section="handout 06 §6.1", rtol=1e-12, atol=0)
    assert_raised(got["bad_stage"], ValueError, "zero_stage", what="training_state_bytes(1e9, zero_stage=4, dp=8)",
                  section="handout 06 §6.1")


def _brute_force_devices(psi: float, memory: float, stage: int, model_parallel: int) -> int | None:
    per = psi / model_parallel
    for dp in range(1, 100_000):
        w = 2 * per / (dp if stage >= 3 else 1)
        g = 2 * per / (dp if stage >= 2 else 1)
        o = 12 * per / (dp if stage >= 1 else 1)
        if w + g + o <= memory:
            return dp * model_parallel
    return None


@pytest.mark.points(2)
def test_devices_needed_for_405b(worker):
    cases = [(model_parallel, stage) for model_parallel in (1, 16) for stage in range(4)]
    got = worker.call(_devices_needed, cases)
    for model_parallel, stage in cases:
        expected = _brute_force_devices(405e9, 80 * GB, stage, model_parallel)
        assert_equal(got[(model_parallel, stage)], expected, name=f"devices for 405B parameters on 80 GB devices, "
                     f"ZeRO-{stage}, tp·pp = {model_parallel}", section="handout 06 §6.1")


@pytest.mark.points(1)
def test_activation_memory_formula(worker):
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B, as in Korthikanti et al. 2022
    got = worker.call(_activation_memory, s, b, h, a)
    for t in (1, 8):
        expected = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        assert_close(torch.tensor(got["tp"][t], dtype=torch.float64),
                     torch.tensor(expected, dtype=torch.float64), name=f"activation bytes per layer, tp={t}",
                     section="handout 06 §6.2", rtol=1e-12, atol=0)
    assert_close(torch.tensor(got["sp"], dtype=torch.float64), torch.tensor(s * b * h * (34 + 5 * a * s / h) / 8,
                 dtype=torch.float64), name="activation bytes per layer, tp=8 with sequence parallelism",
                 section="handout 06 §6.2", rtol=1e-12, atol=0)
    mem = got["mem"]
    state = 175e9 / 64 * (2 + 2 + 12 / 8)
    act = got["tp8"] * 96 / 8 * 8  # stage 0 of 1F1B: pp micro-batches
    assert_close(torch.tensor([mem["activations"], mem["total"]], dtype=torch.float64),
                 torch.tensor([act, state + act], dtype=torch.float64),
                 name="memory_per_device activations and total (175B, dp8 tp8 pp8, ZeRO-1)",
                 section="handout 06 §6.2", rtol=1e-9, atol=0)


# train_4d.TINY_MOE with 5 layers, and Train4DConfig's model defaults (given code), spelled out: the judge builds
# the same model to count its parameters.
COUNTED = dict(dp=1, tp=2, pp=3, ep=2, global_batch_size=4, micro_batch_size=2, grad_accum_steps=1,
               model=ModelConfig(vocab_size=128, context_length=16, d_model=32, d_ff=64, num_layers=5, num_heads=4),
               num_experts=4, top_k=2, capacity_factor=1.25, seed=0)


def _documented_split(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Handout 06 §3.1: contiguous layer ranges, the first ``num_layers % pp`` stages one layer more."""
    base, extra = divmod(num_layers, pp)
    bounds, start = [], 0
    for s in range(pp):
        bounds.append((start, start + base + (s < extra)))
        start = bounds[-1][1]
    return bounds


@pytest.mark.points(2)
def test_stage_parameter_counts_match_the_model(worker):
    cfg = COUNTED
    got = worker.call(_stage_parameter_counts, cfg)
    model = moe_transformer(cfg["model"], seed=cfg["seed"], num_experts=cfg["num_experts"], top_k=cfg["top_k"],
                            capacity_factor=cfg["capacity_factor"])
    # The stages hold the layers handout 06 §3.1 gives them (the split train_4d's PipelineStage uses).
    bounds = _documented_split(cfg["model"].num_layers, cfg["pp"])
    for stage, (start, end) in enumerate(bounds):
        dense = expert = 0
        for name, p in model.named_parameters():
            if name.startswith("layers."):
                if not start <= int(name.split(".")[1]) < end:
                    continue
            elif name.startswith("token_embeddings") and stage != 0:
                continue
            elif (name.startswith("final_norm") or name.startswith("lm_head")) and stage != cfg["pp"] - 1:
                continue
            if name.endswith(("ffn.w1", "ffn.w2", "ffn.w3")):
                expert += p.numel() // cfg["ep"]
            elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "output_proj.weight")):
                dense += p.numel() // cfg["tp"]
            else:
                dense += p.numel()
        assert_equal(got[stage], {"dense": dense, "expert": expert},
                     name=f"stage {stage} (layers {start}–{end - 1}) parameters per rank, tp2 ep2",
                     section="handout 06 §6.3")


@pytest.mark.points(1)
def test_fsdp_tp_compute_bound(worker):
    # H100 SXM: ~989 TFLOP/s bf16; 400 Gb/s InfiniBand per GPU between nodes; ~450 GB/s NVLink per direction.
    got = worker.call(_fsdp_tp_compute_bound, dict(peak_flops=989e12, fsdp_bandwidth=50e9, tp_bandwidth=450e9,
                                                   d_ff=28672, fsdp=64))
    per_shard = 989e12 / 50e9
    expected = {"min_tokens_per_fsdp_shard": per_shard, "min_global_tokens": per_shard * 64,
                "max_tp": 28672 * 450e9 / 989e12}
    for key, value in expected.items():
        assert math.isclose(got[key], value, rel_tol=1e-9), (
            f"fsdp_tp_compute_bound()[{key!r}] = {got[key]:.6g}, expected {value:.6g}. See handout 06 §6.4.")


# cp2 × tp2 × pp2 (8 ranks) on train_4d's tiny model: the ring's traffic per stage, on paper.
CP_COUNTED = dict(dp=1, tp=2, pp=2, ep=1, cp=2, global_batch_size=4, micro_batch_size=2, grad_accum_steps=2,
                  seq_len=16, model=ModelConfig(vocab_size=128, context_length=16, d_model=32, d_ff=64, num_layers=4,
                                                num_heads=4), num_experts=4, top_k=2, capacity_factor=1.25, seed=0)


@pytest.mark.points(1)
def test_context_parallel_accounting(worker):
    """Handout 06b §6: a cp rank holds seq_len / cp tokens — its activations are a seq_len / cp sequence's, its tp
    and pp traffic shrinks by cp — and the ring moves K/V blocks of b·(T/cp)·(d/tp) values: cp − 1 hops each of K
    and V forward, again backward, and cp hops each of dK and dV back to their owner."""
    s, b, h, a = 2048, 1, 12288, 96
    got = worker.call(_cp_accounting, s, b, h, a, CP_COUNTED)
    mem = got["mem"]
    # Only the activations change with cp: those of 96/8 layers × 8 micro-batches of a 512-token sequence (the
    # Korthikanti formula at s/cp, the judge's), the training state stays (replicated over cp).
    short = (s // 4) * b * h * (10 + 24 / 8 + 5 * a * (s // 4) / (h * 8))
    assert_close(torch.tensor([mem[4]["activations"], mem[4]["total"] - mem[4]["activations"]], dtype=torch.float64),
                 torch.tensor([short * 96, mem[1]["total"] - mem[1]["activations"]], dtype=torch.float64),
                 name="memory_per_device(cp=4): activations (those of seq_len / cp tokens) and the rest (unchanged)",
                 section="handout 06b §6", rtol=1e-9, atol=0)
    cfg, fp32 = CP_COUNTED, 4
    t, d = cfg["seq_len"] // cfg["cp"], cfg["model"].d_model
    block = cfg["micro_batch_size"] * t * (d // cfg["tp"]) * fp32  # one K (or V) block: local tokens, local heads
    layers, m, cp = cfg["model"].num_layers // cfg["pp"], cfg["grad_accum_steps"], cfg["cp"]
    ring = layers * m * block * (2 * (cp - 1) + 2 * (cp - 1) + 2 * cp)
    activation = cfg["micro_batch_size"] * t * d * fp32
    for stage, volume in got["volume"].items():
        # Integers: exact.
        assert_equal({k: volume.get(k) for k in (("cp", "send"), ("cp", "recv"), ("tp", "all_reduce"))},
                     {("cp", "send"): ring, ("cp", "recv"): ring, ("tp", "all_reduce"): 2 * layers * m * activation},
                     name=f"comm_volume_per_step(cp2 × tp2 × pp2, stage {stage}): the ring's bytes and tp's "
                     "(on seq_len / cp tokens)", section="handout 06b §6")
