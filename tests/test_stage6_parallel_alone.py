"""Stage 6 — each parallelism alone equals its single-process counterpart (handout/06-4d-parallelism.md).

One 2-rank spawn (``kit.checks``) runs every distributed check (tensor, pipeline and expert parallelism,
bad input); each test below reads its own check, so a failure names the piece that is wrong. The
functions that need no ranks (schedule orders, layer split, bubble, the MoE on one process) run in the
worker (``worker.call``). Every rank and the worker return data — outputs, gradients, orders — and the
single-process references are computed here, in the judge, with torch's own autograd (the mixture of
experts with the judge's own layer, ``tests/support/moe.py``).
"""

from __future__ import annotations

import pytest
import torch

import kit.impl
from kit.checks import outcome_of, run_checks, spawned_checks
from kit.model import ModelConfig, TransformerLM, cross_entropy
from kit.testing import assert_close, assert_equal, assert_raised
from tests.support.moe import ReferenceMoE

pytestmark = pytest.mark.stage6

BLOCK_CFG = ModelConfig(vocab_size=64, context_length=16, d_model=32, d_ff=64, num_layers=1, num_heads=4)
PIPE_CFG = ModelConfig(vocab_size=64, context_length=16, d_model=32, d_ff=64, num_layers=3, num_heads=4)
MOE = dict(d_model=16, d_ff=24, num_experts=4, top_k=2, capacity_factor=1.0)
M, MBS, T = 4, 2, 8  # micro-batches, micro-batch size, sequence length for the pipeline checks


# ------------------------------------------------------------------------------------------------
# Inputs shared by the ranks and the single-process references (same seeds → same tensors)
# ------------------------------------------------------------------------------------------------


def _block_and_input(seed: int = 0):
    torch.manual_seed(seed)
    block = TransformerLM(BLOCK_CFG).layers[0]
    x = torch.randn(2, 8, BLOCK_CFG.d_model, generator=torch.Generator().manual_seed(seed + 1))
    grad_out = torch.randn(2, 8, BLOCK_CFG.d_model, generator=torch.Generator().manual_seed(seed + 2))
    return block, x, grad_out


def _pipe_model_and_batches(seed: int = 0):
    torch.manual_seed(seed)
    model = TransformerLM(PIPE_CFG)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, PIPE_CFG.vocab_size, (M, MBS, T + 1), generator=g)
    return model, [(tokens[i, :, :-1], tokens[i, :, 1:]) for i in range(M)]


def _moe_input(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(3, 4, MOE["d_model"], generator=g), torch.randn(3, 4, MOE["d_model"], generator=g)


def _make_moe(moe_class, seed: int = 3):
    """The layer under test: the implementation's ``MoEFeedForward`` in a rank or the worker, the judge's
    :class:`ReferenceMoE` here (created the same way, so with the same weights)."""
    torch.manual_seed(seed)
    return moe_class(MOE["d_model"], MOE["d_ff"], MOE["num_experts"], top_k=MOE["top_k"],
                     capacity_factor=MOE["capacity_factor"])


# ------------------------------------------------------------------------------------------------
# What each rank runs
# ------------------------------------------------------------------------------------------------


def _tp_ops_check(tp):
    import torch.distributed as dist

    r = dist.get_rank()
    x = torch.arange(6.0, requires_grad=True)
    w = torch.full((6,), float(r + 1))
    (tp.copy_to_tensor_parallel(x) * w).sum().backward()
    xr = (torch.arange(6.0) * (r + 1)).requires_grad_()
    y = tp.reduce_from_tensor_parallel(xr)
    (y * torch.arange(6.0)).sum().backward()
    return {"f_forward": tp.copy_to_tensor_parallel(x).detach(), "f_grad": x.grad, "g_forward": y.detach(),
            "g_grad": xr.grad}


def _tp_linear_check(tp):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(8, 6, generator=g), torch.randn(6, 8, generator=g)
    x, up = torch.randn(2, 3, 6, generator=g), torch.randn(2, 3, 8, generator=g)
    out = {}
    col = tp.ColumnParallelLinear(a)
    xc = x.clone().requires_grad_()
    yc = col(xc)
    (yc * up.chunk(2, dim=-1)[dist.get_rank()]).sum().backward()
    out.update(col_y=yc.detach(), col_x_grad=xc.grad, col_w_grad=col.weight.grad)
    gathered = tp.ColumnParallelLinear(a, gather_output=True)
    out["col_gather_y"] = gathered(x).detach()
    row = tp.RowParallelLinear(b)
    xr = torch.randn(2, 3, 8, generator=g).chunk(2, dim=-1)[dist.get_rank()].clone().requires_grad_()
    yr = row(xr)
    (yr * torch.randn(2, 3, 6, generator=g)).sum().backward()
    out.update(row_y=yr.detach(), row_x_grad=xr.grad, row_w_grad=row.weight.grad)
    return out


def _tp_block_check(tp):
    block, x, grad_out = _block_and_input()
    tp.parallelize_block(block, None)
    x = x.requires_grad_()
    y = block(x)
    y.backward(grad_out)
    return {"y": y.detach(), "x_grad": x.grad,
            "grads": {n: p.grad.clone() for n, p in block.named_parameters()},
            "shapes": {n: tuple(p.shape) for n, p in block.named_parameters()}}


def _pipeline_check(pp, kind):
    import torch.distributed as dist

    model, batches = _pipe_model_and_batches()
    stage = pp.PipelineStage(model, dist.get_rank(), 2)
    run = pp.gpipe if kind == "gpipe" else pp.one_f_one_b
    res = run(stage, batches, group=None, activation_shape=(MBS, T, PIPE_CFG.d_model))
    return {"loss": res.loss, "peak_bytes": res.peak_activation_bytes, "in_flight": res.peak_in_flight,
            "grads": {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}}


def _activation_bytes_one_microbatch(pp):
    """This stage's saved-activation bytes for one micro-batch, measured with a plain forward."""
    import torch.distributed as dist

    model, batches = _pipe_model_and_batches()
    stage = pp.PipelineStage(model, dist.get_rank(), 2)
    meter = pp.ActivationMeter(list(stage.parameters()))
    x = batches[0][0] if stage.is_first else torch.randn(MBS, T, PIPE_CFG.d_model, requires_grad=True)
    with meter:
        y = stage(x)
        if stage.is_last:
            y = cross_entropy(y, batches[0][1])
    return meter.peak


def _moe_check(impl):
    import torch.distributed as dist

    ep = impl.parallel.expert_parallel
    moe = ep.parallelize_moe(_make_moe(ep.MoEFeedForward), None)
    x, up = _moe_input(dist.get_rank())
    x = x.requires_grad_()
    y = moe(x)
    (y * up).sum().backward()
    return {"y": y.detach(), "dropped": moe.dropped_tokens, "aux": moe.aux_loss.detach(), "x_grad": x.grad,
            "grads": {n: p.grad.clone() for n, p in moe.named_parameters()}}


def _bad_input_check(impl):
    """Each entry: the exception type name raised (or 'none').

    A check that rejects the bad input is only half the job: the ``valid_*`` entries make the same calls with
    input one step away from the bad one, which must be accepted (so the argument checks alone — given code in
    the guided stubs — earn nothing, and a check that rejects everything is caught).
    """
    def raised(fn) -> str:
        try:
            fn()
        except (ValueError, TypeError) as exc:
            return type(exc).__name__
        return "none"

    def accepted(fn) -> str:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 — the test reports whatever went wrong, stubs included
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        return "accepted"

    torch.manual_seed(0)
    three_heads = TransformerLM(ModelConfig(vocab_size=16, context_length=8, d_model=12, d_ff=24, num_layers=1,
                                            num_heads=3)).layers[0]
    odd_ff = TransformerLM(ModelConfig(vocab_size=16, context_length=8, d_model=16, d_ff=25, num_layers=1,
                                       num_heads=2)).layers[0]
    three_experts = impl.parallel.expert_parallel.MoEFeedForward(8, 8, 3, top_k=1)
    four_heads = TransformerLM(ModelConfig(vocab_size=16, context_length=8, d_model=16, d_ff=24, num_layers=1,
                                           num_heads=4)).layers[0]
    four_experts = impl.parallel.expert_parallel.MoEFeedForward(8, 8, 4, top_k=1)
    return {
        "valid_block": accepted(lambda: impl.parallel.tensor_parallel.parallelize_block(four_heads, None)),
        "valid_moe": accepted(lambda: impl.parallel.expert_parallel.parallelize_moe(four_experts, None)),
        "valid_mesh": accepted(lambda: impl.parallel.mesh.build_mesh(dp=2, tp=1, pp=1, ep=1, device_type="cpu")),
        "heads_not_divisible": raised(lambda: impl.parallel.tensor_parallel.parallelize_block(three_heads, None)),
        "d_ff_not_divisible": raised(lambda: impl.parallel.tensor_parallel.parallelize_block(odd_ff, None)),
        "experts_not_divisible": raised(lambda: impl.parallel.expert_parallel.parallelize_moe(three_experts, None)),
        "mesh_wrong_product": raised(lambda: impl.parallel.mesh.build_mesh(dp=2, tp=2, pp=1, ep=1, device_type="cpu")),
        "mesh_zero_axis": raised(lambda: impl.parallel.mesh.build_mesh(dp=2, tp=0, pp=1, ep=1, device_type="cpu")),
    }


def _alone_rank_fn() -> dict:
    impl = kit.impl.load()
    return run_checks({
        "tp_ops": lambda: _tp_ops_check(impl.parallel.tensor_parallel),
        "tp_linear": lambda: _tp_linear_check(impl.parallel.tensor_parallel),
        "tp_block": lambda: _tp_block_check(impl.parallel.tensor_parallel),
        "gpipe": lambda: _pipeline_check(impl.parallel.pipeline_parallel, "gpipe"),
        "1f1b": lambda: _pipeline_check(impl.parallel.pipeline_parallel, "1f1b"),
        "act_one_mb": lambda: _activation_bytes_one_microbatch(impl.parallel.pipeline_parallel),
        "moe_ep": lambda: _moe_check(impl),
        "bad_input": lambda: _bad_input_check(impl),
    })


# ------------------------------------------------------------------------------------------------
# What runs in the worker (no ranks needed)
# ------------------------------------------------------------------------------------------------


def _pipeline_parallel():
    return kit.impl.load().parallel.pipeline_parallel


def _schedule_orders(p: int, m: int) -> dict:
    pp = _pipeline_parallel()
    return {"gpipe": [pp.gpipe_order(p, s, m) for s in range(p)],
            "1f1b": [pp.one_f_one_b_order(p, s, m) for s in range(p)], "few": pp.one_f_one_b_order(4, 0, 2)}


def _split_layers(cases: list[tuple[int, int]]) -> dict:
    pp = _pipeline_parallel()
    return {"splits": [pp.split_layers(num_layers, stages) for num_layers, stages in cases],
            "too_many_stages": outcome_of(pp.split_layers, 2, 3)}


def _bubble(cases: list[tuple[int, int]]) -> dict:
    pp = _pipeline_parallel()
    return {"fraction": [pp.bubble_fraction(p, m) for p, m in cases],
            "timeline": {kind: [pp.simulate_schedule(kind, p, m, 1.0, 2.0) for p, m in cases]
                         for kind in ("gpipe", "1f1b")},
            "no_microbatches": outcome_of(pp.bubble_fraction, 2, 0)}


def _moe_one_process() -> dict:
    """The implementation's MoE on one process, on the tokens of each rank in turn."""
    ep = kit.impl.load().parallel.expert_parallel
    moe = _make_moe(ep.MoEFeedForward)
    weights = {n: p.detach().clone() for n, p in moe.named_parameters()}
    runs = []
    for rank in (0, 1):
        x, _ = _moe_input(rank)
        y = moe(x)
        runs.append({"y": y.detach(), "dropped": moe.dropped_tokens, "aux": moe.aux_loss.detach()})
    return {"weights": weights, "runs": runs, "top_k_too_big": outcome_of(ep.MoEFeedForward, 8, 8, 2, top_k=3),
            "capacity": ep.expert_capacity(10, 4, 2, 1.25)}


# Per check, the two ranks' values, or the check's failure re-raised in the test that reads it.
alone = spawned_checks(_alone_rank_fn, 2, timeout=90)


# ------------------------------------------------------------------------------------------------
# Tensor parallelism (handout 06 §2)
# ------------------------------------------------------------------------------------------------


@pytest.mark.points(2)
def test_f_and_g_operators(alone):
    ranks = alone.values("tp_ops")
    x = torch.arange(6.0)
    # Small integers, and sums of them: exact in fp32, so the default tolerance admits only the exact answers.
    for r, v in enumerate(ranks):
        assert_close(v["f_forward"], x, name=f"rank {r}: f forward (identity)", section="handout 06 §2.1")
        # ∂/∂x Σ_ranks (x · w_r) with w_r = r + 1: the backward of f all-reduces 1 + 2.
        assert_close(v["f_grad"], torch.full((6,), 3.0), name=f"rank {r}: f backward (all-reduced gradient)",
                     section="handout 06 §2.1")
        assert_close(v["g_forward"], x * 3, name=f"rank {r}: g forward (sum over ranks)", section="handout 06 §2.1")
        assert_close(v["g_grad"], x, name=f"rank {r}: g backward (identity)", section="handout 06 §2.1")


@pytest.mark.points(3)
def test_column_and_row_parallel_linear(alone):
    ranks = alone.values("tp_linear")
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(8, 6, generator=g).double(), torch.randn(6, 8, generator=g).double()
    x, up = torch.randn(2, 3, 6, generator=g).double(), torch.randn(2, 3, 8, generator=g).double()
    xr_full, up_r = torch.randn(2, 3, 8, generator=g).double(), torch.randn(2, 3, 6, generator=g).double()
    y = x @ a.T
    # fp32 against float64: dot products of K ≤ 8 terms of randn values (the row-parallel ones as 2 partial sums of 4,
    # all-reduced). Typical error √K·u·Σ|terms| ≈ 1e-7 (measured ≤ 8e-7). The worst case K·u·Σ|terms| (u = 2⁻²⁴) is at
    # most 4.5e-6 on these inputs — 1.17× the default rtol 1e-5 / atol 1e-6 on a small element, 0.25× of atol = 1e-5 —
    # so 1e-5 holds on any summation order, and every catalogued mistake (a missing all-reduce, the wrong slice, a
    # doubled gradient) is O(1) off.
    tol = {"rtol": 1e-5, "atol": 1e-5}
    for r, v in enumerate(ranks):
        s = "handout 06 §2.2"
        assert_close(v["col_y"], y.chunk(2, -1)[r], name=f"rank {r}: ColumnParallelLinear output slice", section=s,
                     **tol)
        # L = Σ_r <y_r, up_r> = <y, up>: ∂L/∂x needs every rank's slice (the all-reduce in f's backward).
        assert_close(v["col_x_grad"], up @ a, name=f"rank {r}: ColumnParallelLinear ∂L/∂x", section=s, **tol)
        assert_close(v["col_w_grad"], (up.reshape(-1, 8).T @ x.reshape(-1, 6)).chunk(2, 0)[r],
                     name=f"rank {r}: ColumnParallelLinear ∂L/∂weight shard", section=s, **tol)
        assert_close(v["col_gather_y"], y, name=f"rank {r}: ColumnParallelLinear gather_output", section=s, **tol)
        assert_close(v["row_y"], xr_full @ b.T, name=f"rank {r}: RowParallelLinear output (after g)", section=s, **tol)
        assert_close(v["row_x_grad"], (up_r @ b).chunk(2, -1)[r], name=f"rank {r}: RowParallelLinear ∂L/∂x slice",
                     section=s, **tol)
        assert_close(v["row_w_grad"], (up_r.reshape(-1, 6).T @ xr_full.reshape(-1, 8)).chunk(2, 1)[r],
                     name=f"rank {r}: RowParallelLinear ∂L/∂weight shard", section=s, **tol)


# Which dimension of each full weight a tp rank keeps a slice of (None: replicated). Handout 06 §2.3.
TP_SHARD_DIM = {"attn.q_proj.weight": 0, "attn.k_proj.weight": 0, "attn.v_proj.weight": 0,
                "attn.output_proj.weight": 1, "ffn.w1.weight": 0, "ffn.w3.weight": 0, "ffn.w2.weight": 1}


@pytest.mark.points(4)
def test_parallelized_block_matches_single_process(alone):
    ranks = alone.values("tp_block")
    block, x, grad_out = _block_and_input()
    x = x.requires_grad_()
    y = block(x)
    y.backward(grad_out)
    s = "handout 06 §2.3"
    # fp32 against one fp32 process: tp splits heads and d_ff and all-reduces 2 partial sums, reordering sums of
    # K ≤ 64 terms. Each side is ~√K·u·Σ|terms| from exact: against float64, y and ∂L/∂x (|·| ≲ 5) are ≤ 1.1e-6 off
    # and the weight gradients (16 rows more, |g| ≲ 13) ≤ 0.12 of rtol 1e-4 / atol 1e-5; twice that still fits.
    for r, v in enumerate(ranks):
        assert_close(v["y"], y, name=f"rank {r}: block output", section=s, rtol=1e-5, atol=1e-5)
        assert_close(v["x_grad"], x.grad, name=f"rank {r}: block ∂L/∂x", section=s, rtol=1e-5, atol=1e-5)
        for name, p in block.named_parameters():
            dim = TP_SHARD_DIM.get(name)
            expected = p.grad if dim is None else p.grad.chunk(2, dim)[r]
            assert name in v["grads"], f"rank {r}: parameter {name} missing after parallelize_block ({s})"
            assert_close(v["grads"][name], expected, name=f"rank {r}: gradient of {name} (shard dim {dim})",
                         section=s, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Pipeline parallelism (handout 06 §3)
# ------------------------------------------------------------------------------------------------


def _sequential_reference():
    model, batches = _pipe_model_and_batches()
    losses = []
    for inputs, targets in batches:
        loss = cross_entropy(model(inputs), targets)
        (loss / M).backward()
        losses.append(loss.item())
    return sum(losses) / M, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.points(3)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_pipeline_schedule_matches_sequential(alone, kind):
    ranks = alone.values(kind)
    loss, grads = _sequential_reference()
    s = "handout 06 §3.2" if kind == "gpipe" else "handout 06 §3.3"
    seen = set()
    # The stages run the sequential model's layers in order on the same micro-batches: the loss (≈ 4) differs only
    # in how the M = 4 micro-batch losses are averaged, a few ulps (4.8e-7 each); 1e-5. The gradients add the same
    # micro-batches; the 1/M scaling (on the loss or the received gradient) rounds differently, a few u relative:
    # rtol 1e-4 is ≥ 100× that, atol 1e-6 for elements near 0.
    for r, v in enumerate(ranks):
        assert abs(v["loss"] - loss) < 1e-5, (
            f"rank {r}: {kind} reported loss {v['loss']:.6f}, sequential training gives {loss:.6f} — the loss lives "
            f"on the last stage and every stage must report it. See {s}.")
        for name, g in v["grads"].items():
            seen.add(name)
            assert_close(g, grads[name], name=f"stage {r}: gradient of {name} after {M} micro-batches", section=s,
                         rtol=1e-4, atol=1e-6)
    missing = sorted(set(grads) - seen)
    assert not missing, f"{kind}: no stage produced a gradient for {missing}. See {s}."


@pytest.mark.points(3)
def test_one_f_one_b_keeps_at_most_p_microbatches(alone):
    gpipe, ofob, one = (alone.values(k) for k in ("gpipe", "1f1b", "act_one_mb"))
    p, s = 2, "handout 06 §3.3"
    for r in range(p):
        assert_equal(gpipe[r]["in_flight"], M, name=f"GPipe stage {r}: micro-batches alive at once", section=s)
        assert_equal(ofob[r]["in_flight"], min(p - r, M), name=f"1F1B stage {r}: micro-batches alive at once",
                     section=s)
        # Measured bytes of saved activations: GPipe holds all M micro-batches, 1F1B at most p − r. Bytes, not
        # rounding: a storage every micro-batch saves (the RoPE cos/sin buffers) counts once, not M times, ≈ 0.3 %
        # of M micro-batches here; 2 % is 6× that, while one micro-batch more or fewer is ≥ 25 % off.
        assert one[r] > 0, f"stage {r}: ActivationMeter measured no saved activations. See {s}."
        assert_close(torch.tensor(float(gpipe[r]["peak_bytes"])), torch.tensor(float(M * one[r])),
                     name=f"GPipe stage {r}: peak saved-activation bytes (= {M} × one micro-batch)", section=s,
                     rtol=0.02, atol=0)
        assert_close(torch.tensor(float(ofob[r]["peak_bytes"])), torch.tensor(float(min(p - r, M) * one[r])),
                     name=f"1F1B stage {r}: peak saved-activation bytes (= {min(p - r, M)} × one micro-batch)",
                     section=s, rtol=0.02, atol=0)


def _in_flight(order) -> int:
    alive, peak = set(), 0
    for op, i in order:
        if op == "F":
            alive.add(i)
        else:
            assert i in alive, f"backward of micro-batch {i} before its forward"
            alive.remove(i)
        peak = max(peak, len(alive))
    return peak


@pytest.mark.points(2)
def test_schedule_orders(worker):
    p, m = 4, 6
    got = worker.call(_schedule_orders, p, m)
    for s in range(p):
        gp = got["gpipe"][s]
        assert_equal(gp, [("F", i) for i in range(m)] + [("B", i) for i in range(m)],
                     name=f"gpipe_order(p={p}, s={s}, m={m})", section="handout 06 §3.2")
        order = got["1f1b"][s]
        assert_equal(sorted(order), sorted(gp), name=f"one_f_one_b_order(p={p}, s={s}, m={m}) as a set of ops",
                     section="handout 06 §3.3")
        warmup = min(p - s - 1, m)
        assert_equal(order[:warmup + 1], [("F", i) for i in range(warmup + 1)],
                     name=f"1F1B stage {s}: the warm-up forwards", section="handout 06 §3.3")
        assert_equal(order[warmup + 1], ("B", 0), name=f"1F1B stage {s}: first backward right after warm-up",
                     section="handout 06 §3.3")
        assert_equal(_in_flight(order), min(p - s, m), name=f"1F1B stage {s}: most micro-batches in flight",
                     section="handout 06 §3.3")
        # Point-to-point messages between two stages are matched in the order they are posted, so every stage
        # must run the forwards, and the backwards, in the same (micro-batch) order.
        for op in ("F", "B"):
            assert_equal([i for o, i in order if o == op], list(range(m)),
                         name=f"1F1B stage {s}: micro-batch order of the {op} operations", section="handout 06 §3.3")
    assert_equal(got["few"], [("F", 0), ("F", 1), ("B", 0), ("B", 1)],
                 name="one_f_one_b_order(p=4, s=0, m=2) with fewer micro-batches than stages",
                 section="handout 06 §3.3")


@pytest.mark.points(1)
def test_split_layers_gives_earlier_stages_the_remainder(worker):
    # Uneven splits tell "the first num_layers % pp stages get one more" from any other balanced split.
    cases = ((3, 2, [(0, 2), (2, 3)]), (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
             (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]), (7, 1, [(0, 7)]))
    got = worker.call(_split_layers, [(num_layers, stages) for num_layers, stages, _ in cases])
    for (num_layers, stages, expected), split in zip(cases, got["splits"]):
        assert_equal(split, expected, name=f"split_layers({num_layers}, {stages})", section="handout 06 §3.1")
    assert_raised(got["too_many_stages"], ValueError, "pp", what="split_layers(2, 3): more stages than layers",
                  section="handout 06 §3.1")


@pytest.mark.points(1)
def test_bubble_fraction_matches_simulated_schedule(worker):
    cases = ((2, 4), (4, 4), (4, 16), (8, 3))
    got = worker.call(_bubble, list(cases))
    for n, (p, m) in enumerate(cases):
        expected = (p - 1) / (m + p - 1)
        fraction = got["fraction"][n]
        # fp64 (u = 2⁻⁵³ ≈ 1e-16), a division or two: 1e-12 admits any algebraically equal formula. The simulated
        # idle fraction adds ≲ 100 slot times per stage, ≲ 1e-14 off; 1e-9 allows non-integer slot lengths.
        assert abs(fraction - expected) < 1e-12, (
            f"bubble_fraction({p}, {m}) = {fraction}, expected (p−1)/(m+p−1) = {expected}")
        for kind in ("gpipe", "1f1b"):
            timeline = got["timeline"][kind][n]
            end = max(e[3] for stage in timeline for e in stage)
            idle = 1 - sum(e[3] - e[2] for e in timeline[0]) / end
            assert abs(idle - expected) < 1e-9, (
                f"{kind} p={p} m={m}: simulated idle fraction {idle:.4f} ≠ {expected:.4f}")
    assert_raised(got["no_microbatches"], ValueError, "m", what="bubble_fraction(2, 0)", section="handout 06 §3.2")


# ------------------------------------------------------------------------------------------------
# Expert parallelism (handout 06 §4)
# ------------------------------------------------------------------------------------------------


def naive_moe(moe, x: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    """A loop-by-loop float64 mixture of experts with the handout's routing rules (§4.1)."""
    xs = x.reshape(-1, moe.d_model).double()
    n, e, k = xs.shape[0], moe.num_experts, moe.top_k
    capacity = n if moe.capacity_factor is None else max(1, -(-int(moe.capacity_factor * n * k * 1000) // (e * 1000)))
    w1, w2, w3, wr = (t.detach().double() for t in (moe.w1, moe.w2, moe.w3, moe.router.weight))
    probs = torch.softmax(xs @ wr.T, dim=-1)
    choices = [sorted(range(e), key=lambda j: (-probs[i, j].item(), j))[:k] for i in range(n)]
    used, dropped, out = [0] * e, 0, torch.zeros(n, moe.d_model, dtype=torch.float64)
    counts = [0] * e
    for c in range(k):  # every first choice before any second choice
        for i in range(n):
            j = choices[i][c]
            counts[j] += 1
            if used[j] >= capacity:
                dropped += 1
                continue
            used[j] += 1
            gate = probs[i, j] / sum(probs[i, jj] for jj in choices[i])
            h = torch.nn.functional.silu(xs[i] @ w1[j]) * (xs[i] @ w3[j])
            out[i] += gate * (h @ w2[j])
    aux = e * sum(counts[j] / (n * k) * probs[:, j].mean() for j in range(e))
    return out.reshape(x.shape), dropped, aux


@pytest.mark.points(3)
def test_moe_matches_naive_loop(worker):
    got = worker.call(_moe_one_process)
    moe = _make_moe(ReferenceMoE)  # the same weights, created here: naive_moe reads them
    s = "handout 06 §4.1"
    for name, p in moe.named_parameters():  # the same seeded initialisation: bit for bit
        assert_close(got["weights"].get(name), p, name=f"test set-up: MoEFeedForward's initial {name} (the given "
                     "__init__, seed 3) differs from the judge's copy of it; keep the given initialisation",
                     section=s, rtol=0, atol=0)
    for rank in (0, 1):
        x, _ = _moe_input(rank)
        ref, dropped, aux = naive_moe(moe, x)
        v = got["runs"][rank]
        assert dropped > 0, "test set-up: the capacity factor should drop some assignments"
        assert_equal(v["dropped"], dropped, name=f"input {rank}: dropped token assignments", section=s)
        # fp32 against float64: K = 16 then 24 products, a softmax over 4 experts, ≤ 2 experts added: ~√K·u·Σ|terms|,
        # measured ≤ 9e-7 at |y| ≲ 2.5 (≤ 0.03 of the tolerance) and 1e-7 on the aux loss (≈ 1.0, ≤ 0.01 of it).
        assert_close(v["y"], ref, name=f"input {rank}: MoE output", section=s, rtol=1e-5, atol=1e-5)
        assert_close(v["aux"], torch.as_tensor(aux), name=f"input {rank}: load-balancing loss", section=s,
                     rtol=1e-5, atol=1e-6)
    assert_raised(got["top_k_too_big"], ValueError, "top_k", what="MoEFeedForward(8, 8, num_experts=2, top_k=3)",
                  section=s)
    assert_equal(got["capacity"], 7, name="expert_capacity(10 tokens, 4 experts, top-2, factor 1.25) = ceil(6.25)",
                 section=s)


@pytest.mark.points(4)
def test_expert_parallel_moe_matches_single_process(alone):
    ranks = alone.values("moe_ep")
    s = "handout 06 §4.2"
    local = MOE["num_experts"] // 2
    # One process, one MoE with all experts, each rank's tokens routed as their own group. An expert's
    # gradient collects the tokens of *every* rank (they were sent to it); the router's only its own.
    moes, xs = [], []
    for r in range(2):
        moe = _make_moe(ReferenceMoE)
        x, up = _moe_input(r)
        x = x.requires_grad_()
        (moe(x) * up).sum().backward()
        moes.append(moe)
        xs.append(x)
    expert_grad = {n: moes[0].get_parameter(n).grad + moes[1].get_parameter(n).grad for n in ("w1", "w2", "w3")}
    for r, v in enumerate(ranks):
        moe, x = moes[r], xs[r]
        y = moe(x.detach())
        assert_equal(v["dropped"], moe.dropped_tokens, name=f"rank {r}: dropped token assignments", section=s)
        # fp32 against one fp32 process: the same per-token expert math, batched over other tokens (~1e-7 relative,
        # tests/support/moe.py), so y, aux and ∂L/∂x to rtol 1e-5. The expert gradients add both ranks' tokens, the
        # router's its own, in another order (≲ √n·u·Σ|terms|): rtol 1e-4; atols for elements near 0.
        assert_close(v["y"], y, name=f"rank {r}: MoE output", section=s, rtol=1e-5, atol=1e-6)
        assert_close(v["aux"], moe.aux_loss, name=f"rank {r}: load-balancing loss", section=s, rtol=1e-5, atol=1e-7)
        assert_close(v["x_grad"], x.grad, name=f"rank {r}: ∂L/∂x", section=s, rtol=1e-5, atol=1e-6)
        assert_close(v["grads"]["router.weight"], moe.router.weight.grad,
                     name=f"rank {r}: gradient of router.weight (its own tokens)", section=s, rtol=1e-4, atol=1e-6)
        for name, g in expert_grad.items():
            assert_close(v["grads"][name], g[r * local:(r + 1) * local],
                         name=f"rank {r}: gradient of its experts' {name} (tokens of both ranks)", section=s,
                         rtol=1e-4, atol=1e-6)


@pytest.mark.points(1)
def test_bad_input_is_rejected(alone):
    (v, _) = alone.values("bad_input")
    for case, kind in (("heads_not_divisible", "ValueError"), ("d_ff_not_divisible", "ValueError"),
                       ("experts_not_divisible", "ValueError"), ("mesh_wrong_product", "ValueError"),
                       ("mesh_zero_axis", "ValueError")):
        assert_equal(v[case], kind, name=f"error raised for {case.replace('_', ' ')}", section="handout 06 §1–4")
    for case, call in (("valid_block", "parallelize_block on a 4-head block over 2 ranks"),
                       ("valid_moe", "parallelize_moe with 4 experts over 2 ranks"),
                       ("valid_mesh", "build_mesh(dp=2, tp=1, pp=1, ep=1) on 2 ranks")):
        if v[case].startswith("NotImplementedError:"):  # a stub: reported as one, like every other test's
            raise NotImplementedError(f"{v[case].split(': ', 1)[1]} (raised by {call})")
        assert v[case] == "accepted", (
            f"{call} must be accepted — it is one step from the bad input above, so a check that rejects it is "
            f"wrong, and an argument check alone is not the function; it raised {v[case]} (handout 06 §1–4)")
