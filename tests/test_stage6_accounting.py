"""Stage 6 — memory and communication accounting on paper (handout 06 §6). No ranks needed.

The communication counts are also checked against a real training step in test_stage6_mesh_4d.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from kit.testing import assert_close, assert_equal

pytestmark = pytest.mark.stage6

GB = 1e9


@pytest.mark.points(2)
def test_training_state_matches_zero_paper(impl):
    acc = impl.parallel.accounting
    # ZeRO paper, Figure 1: Ψ = 7.5B parameters, N_d = 64 data-parallel devices, K = 12.
    printed = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in printed.items():
        got = acc.training_state_bytes(7.5e9, zero_stage=stage, dp=64)["total"] / GB
        assert abs(got - gb) < 0.05, (
            f"training_state_bytes(7.5e9, zero_stage={stage}, dp=64) = {got:.2f} GB; the ZeRO paper prints {gb} GB. "
            "See handout 06 §6.1.")
    parts = acc.training_state_bytes(1e9, zero_stage=2, dp=8)
    assert_close(torch.tensor([parts["weights"], parts["gradients"], parts["optimizer"]], dtype=torch.float64),
                 torch.tensor([2e9, 2e9 / 8, 12e9 / 8], dtype=torch.float64),
                 name="ZeRO-2 weights, gradients, optimizer bytes for 1B parameters on 8 ranks",
                 section="handout 06 §6.1", rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="zero_stage"):
        acc.training_state_bytes(1e9, zero_stage=4, dp=8)


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
def test_devices_needed_for_405b(impl):
    acc = impl.parallel.accounting
    for model_parallel in (1, 16):
        for stage in range(4):
            expected = _brute_force_devices(405e9, 80 * GB, stage, model_parallel)
            got = acc.devices_needed(405e9, 80 * GB, zero_stage=stage, model_parallel=model_parallel)
            assert_equal(got, expected, name=f"devices for 405B parameters on 80 GB devices, ZeRO-{stage}, "
                         f"tp·pp = {model_parallel}", section="handout 06 §6.1")


@pytest.mark.points(1)
def test_activation_memory_formula(impl):
    acc = impl.parallel.accounting
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B, as in Korthikanti et al. 2022
    for t in (1, 8):
        expected = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        assert_close(torch.tensor(acc.activation_bytes_per_layer(s, b, h, a, tp=t), dtype=torch.float64),
                     torch.tensor(expected, dtype=torch.float64), name=f"activation bytes per layer, tp={t}",
                     section="handout 06 §6.2", rtol=1e-12, atol=0)
    sp = acc.activation_bytes_per_layer(s, b, h, a, tp=8, sequence_parallel=True)
    assert_close(torch.tensor(sp, dtype=torch.float64), torch.tensor(s * b * h * (34 + 5 * a * s / h) / 8,
                 dtype=torch.float64), name="activation bytes per layer, tp=8 with sequence parallelism",
                 section="handout 06 §6.2", rtol=1e-12, atol=0)
    mem = acc.memory_per_device(175e9, num_layers=96, seq_len=s, micro_batch=b, d_model=h, num_heads=a,
                                dp=8, tp=8, pp=8, zero_stage=1)
    state = 175e9 / 64 * (2 + 2 + 12 / 8)
    act = acc.activation_bytes_per_layer(s, b, h, a, tp=8) * 96 / 8 * 8  # stage 0 of 1F1B: pp micro-batches
    assert_close(torch.tensor([mem["activations"], mem["total"]], dtype=torch.float64),
                 torch.tensor([act, state + act], dtype=torch.float64),
                 name="memory_per_device activations and total (175B, dp8 tp8 pp8, ZeRO-1)",
                 section="handout 06 §6.2", rtol=1e-9, atol=0)


@pytest.mark.points(2)
def test_stage_parameter_counts_match_the_model(impl):
    t4, acc = impl.parallel.train_4d, impl.parallel.accounting
    cfg = t4.Train4DConfig(dp=1, tp=2, pp=3, ep=2, global_batch_size=4, micro_batch_size=2, grad_accum_steps=1,
                           model=t4.TINY_MOE.with_(num_layers=5))
    model = t4.build_model(cfg)
    bounds = impl.parallel.pipeline_parallel.split_layers(5, 3)
    for stage, (start, end) in enumerate(bounds):
        dense = expert = 0
        for name, p in model.named_parameters():
            if name.startswith("layers."):
                if not start <= int(name.split(".")[1]) < end:
                    continue
            elif name.startswith("token_embeddings") and stage != 0:
                continue
            elif (name.startswith("final_norm") or name.startswith("lm_head")) and stage != cfg.pp - 1:
                continue
            if name.endswith(("ffn.w1", "ffn.w2", "ffn.w3")):
                expert += p.numel() // cfg.ep
            elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "output_proj.weight")):
                dense += p.numel() // cfg.tp
            else:
                dense += p.numel()
        assert_equal(acc.stage_parameter_counts(cfg, stage), {"dense": dense, "expert": expert},
                     name=f"stage {stage} (layers {start}–{end - 1}) parameters per rank, tp2 ep2",
                     section="handout 06 §6.3")


@pytest.mark.points(1)
def test_fsdp_tp_compute_bound(impl):
    acc = impl.parallel.accounting
    # H100 SXM: ~989 TFLOP/s bf16; 400 Gb/s InfiniBand per GPU between nodes; ~450 GB/s NVLink per direction.
    got = acc.fsdp_tp_compute_bound(peak_flops=989e12, fsdp_bandwidth=50e9, tp_bandwidth=450e9, d_ff=28672, fsdp=64)
    per_shard = 989e12 / 50e9
    expected = {"min_tokens_per_fsdp_shard": per_shard, "min_global_tokens": per_shard * 64,
                "max_tp": 28672 * 450e9 / 989e12}
    for key, value in expected.items():
        assert math.isclose(got[key], value, rel_tol=1e-9), (
            f"fsdp_tp_compute_bound()[{key!r}] = {got[key]:.6g}, expected {value:.6g}. See handout 06 §6.4.")
