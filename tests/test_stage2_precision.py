"""Stage 2 — mixed precision, loss scaling and activation memory (handout/02-mixed-precision.md).

Every check compares against something independent of the code under test: numpy's IEEE fp16/fp32
arithmetic, torch.autocast run op by op, torch.amp.GradScaler, a plain fp32 training loop, and
hand-counted bytes.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from kit.model import TransformerLM, cross_entropy, get_config
from kit.testing import assert_close, assert_equal

pytestmark = pytest.mark.stage2

SEC = "handout 02 §{}"


def _batch(config, batch_size: int, context_length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch_size, context_length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


# ------------------------------------------------------------------------------------------------------
# §1 Accumulation


def _numpy_sums(value: float, steps: int) -> dict[str, float]:
    """The four sums with numpy scalars: IEEE rounding after every add, independent of torch."""
    v32, v16 = np.float32(value), np.float16(value)
    s32, s16, mixed = np.float32(0), np.float16(0), np.float32(0)
    for _ in range(steps):
        s32 = np.float32(s32 + v32)
        s16 = np.float16(s16 + v16)
        mixed = np.float32(mixed + np.float32(v16))
    return {"fp32": float(s32), "fp16": float(s16), "fp16_into_fp32": float(mixed),
            "fp16_upcast_into_fp32": float(mixed)}


@pytest.mark.points(2)
def test_accumulation_experiment(impl) -> None:
    """The four sums equal IEEE fp32/fp16 arithmetic exactly, for the default and another value."""
    for kwargs in ({}, {"value": 0.1, "steps": 300}):
        got = impl.precision.accumulation_experiment(**kwargs)
        expected = _numpy_sums(kwargs.get("value", 0.01), kwargs.get("steps", 1000))
        assert_equal(sorted(got), sorted(expected), name="accumulation_experiment keys", section=SEC.format(1))
        for key, value in expected.items():
            assert_close(torch.tensor(got[key], dtype=torch.float64), torch.tensor(value, dtype=torch.float64),
                         name=f"accumulation_experiment({kwargs})[{key!r}]", section=SEC.format(1), rtol=0, atol=0)
    got = impl.precision.accumulation_experiment()
    assert abs(got["fp16"] - 10) > 10 * abs(got["fp32"] - 10), (
        f"an fp16 sum should lose far more than an fp32 one, got {got}. See {SEC.format(1)}.")


# ------------------------------------------------------------------------------------------------------
# §2 Autocast


@pytest.mark.points(3)
def test_autocast_dtype_report_toy_model(impl) -> None:
    """The report's dtypes match the ToyModel's layers run one by one under bf16 autocast on the CPU."""
    model = impl.precision.ToyModel(in_features=20, out_features=5)
    x = torch.randn(8, 20)
    targets = torch.randint(0, 5, (8,))
    report = impl.precision.autocast_dtype_report(model, x, torch.bfloat16, targets=targets)

    # The independent reference: each layer by hand under the same autocast, backward outside it.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h1 = model.fc1(x)
        h2 = model.relu(h1)
        h3 = model.ln(h2)
        logits = model.fc2(h3)
        loss = F.cross_entropy(logits, targets)
        param_dtype = model.fc1.weight.dtype
    loss.backward()
    expected = {"parameters": param_dtype, "fc1": h1.dtype, "relu": h2.dtype, "ln": h3.dtype,
                "fc2": logits.dtype, "logits": logits.dtype, "loss": loss.dtype,
                "gradients": model.fc1.weight.grad.dtype}
    for key, dtype in expected.items():
        assert key in report, (
            f"autocast_dtype_report has no {key!r} entry (keys: {sorted(report)}). See {SEC.format(2)}.")
        assert_equal(report[key], dtype, name=f"dtype of {key} under bf16 autocast", section=SEC.format(2))
    # The lessons themselves, as torch implements them.
    assert report["parameters"] == torch.float32 and report["gradients"] == torch.float32
    assert report["fc1"] == torch.bfloat16 and report["loss"] == torch.float32

    model.zero_grad(set_to_none=True)
    impl.precision.autocast_dtype_report(model, x, "bf16")
    assert all(p.grad is None for p in model.parameters()), (
        f"autocast_dtype_report must leave the model's .grad as it found it. See {SEC.format(2)}.")
    half = impl.precision.autocast_dtype_report(model, x, torch.float16, targets=targets)
    assert_equal(half["fc1"], torch.float16, name="fc1 output under fp16 autocast (the dtype asked for)",
                 section=SEC.format(2))
    plain = impl.precision.autocast_dtype_report(model, x, torch.float32)
    assert_equal(plain["fc1"], torch.float32, name="fc1 output with autocast off (fp32)", section=SEC.format(2))


# ------------------------------------------------------------------------------------------------------
# §4 Loss scaling

INF_STEPS = {4, 5, 13, 31, 50}
NAN_STEPS = {9, 22, 45}


def _inject(model: torch.nn.Module, step: int) -> None:
    """Overwrite one scaled gradient element with inf or nan at the chosen steps (as an fp16 overflow would)."""
    if step in INF_STEPS:
        model.weight.grad[0, 0] = -math.inf if step == 50 else math.inf
    elif step in NAN_STEPS:
        model.weight.grad[1, 2] = math.nan


@pytest.mark.points(5)
def test_scaler_matches_grad_scaler(impl) -> None:
    """60 steps with inf/nan gradients injected: the same scale, skipped steps and parameters as GradScaler."""
    torch.manual_seed(0)
    ours_model = torch.nn.Linear(6, 4)
    ref_model = copy.deepcopy(ours_model)
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    # Factors that are not reciprocal powers of two (3 and 0.4, not 2 and 0.5): halving is not the same as
    # dividing by the growth factor, and a scale of 1000 makes 1/S inexact, so a swapped or inverted factor
    # changes the scale. All are exact in fp32 steps of GradScaler's own arithmetic.
    kwargs = {"init_scale": 1000.0, "growth_factor": 3.0, "backoff_factor": 0.4, "growth_interval": 3}
    ours = impl.precision.DynamicLossScaler(**kwargs)
    ref = torch.amp.GradScaler("cpu", **kwargs)
    scales = []
    for step in range(60):
        x, y = torch.randn(5, 6), torch.randn(5, 4)
        grads_after_step = []
        for model, opt, scaler in ((ours_model, ours_opt, ours), (ref_model, ref_opt, ref)):
            opt.zero_grad(set_to_none=True)
            scaler.scale(F.mse_loss(model(x), y)).backward()
            _inject(model, step)
            if step % 7 == 0 or step in (13, 45):  # the unscale_-then-clip path on some steps, two of them overflows
                found = scaler.unscale_(opt)
                if scaler is ours:
                    assert_equal(bool(found), step in INF_STEPS | NAN_STEPS, name=f"unscale_() return value at step "
                                 f"{step} (whether any gradient is inf or nan)", section=SEC.format(4))
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            grads_after_step.append([p.grad.clone() for p in model.parameters()])
            scaler.update()
        where = f"after step {step}"
        event = ("an inf gradient was injected: skip the step, scale × backoff_factor, reset the count"
                 if step in INF_STEPS else "a nan gradient was injected: skip the step, scale × backoff_factor, "
                 "reset the count" if step in NAN_STEPS else "a clean step: count it; × growth_factor after "
                 f"growth_interval={kwargs['growth_interval']} clean steps in a row")
        if ours.get_scale() != ref.get_scale() and math.isclose(ours.get_scale(), ref.get_scale(), rel_tol=2**-23):
            event += ("; equal but for fp32 rounding: GradScaler keeps S in an fp32 tensor, round every new scale "
                      "to fp32")
        assert_equal(ours.get_scale(), ref.get_scale(), name=f"scale {where} ({event})", section=SEC.format(4))
        ours_steps = ours_opt.state[ours_model.weight].get("step", torch.tensor(0.0))
        ref_steps = ref_opt.state[ref_model.weight].get("step", torch.tensor(0.0))
        assert_equal(float(ours_steps), float(ref_steps), name=f"optimizer steps taken {where} (a skipped step "
                     "must not reach optimizer.step)", section=SEC.format(4))
        # AdamW is nearly blind to a uniform scale of the gradients, so check the gradients themselves: step()
        # unscales them in place (× fp32(1/S)) unless unscale_ already did. Same fp32 ops on parameters that agree
        # to rtol 1e-6: rtol 1e-5 allows that and dividing by S instead of × fp32(1/S) (≤ 1 ulp); a missing or
        # inverted unscale is off by a factor S or S² ≥ 1e2.
        if step not in INF_STEPS | NAN_STEPS:
            for (name, _), g, h in zip(ours_model.named_parameters(), *grads_after_step):
                assert_close(g, h, name=f"{name}.grad after scaler.step() {where} (step unscales the gradients in "
                             "place, × 1/S, unless unscale_ already did)", section=SEC.format(4), rtol=1e-5, atol=1e-7)
        # Same ops in the same order on the same fp32 values as GradScaler: the parameters agree to the last
        # bit or so; rtol 1e-6 (≈ 16 fp32 ulps) allows a reordered clip-norm sum, atol 1e-7 values near 0.
        for (name, p), q in zip(ours_model.named_parameters(), ref_model.parameters()):
            assert_close(p, q, name=f"parameter {name} {where}", section=SEC.format(4), rtol=1e-6, atol=1e-7)
        scales.append(ours.get_scale())
    # The run must have exercised both directions, or it proves nothing.
    assert max(scales) > kwargs["init_scale"] and min(scales) < kwargs["init_scale"]
    assert_equal(int(ref_opt.state[ref_model.weight]["step"]), 60 - len(INF_STEPS | NAN_STEPS),
                 name="steps GradScaler took", section=SEC.format(4))


@pytest.mark.points(1)
def test_scaler_state_dict(impl) -> None:
    """state_dict uses GradScaler's keys and values (the growth tracker included): after the same steps as a
    GradScaler it equals the GradScaler's, and a scaler loaded from either goes on exactly as GradScaler does."""
    kwargs = {"init_scale": 256.0, "growth_factor": 3.0, "backoff_factor": 0.4, "growth_interval": 3}
    ours = impl.precision.DynamicLossScaler(**kwargs)
    ref = torch.amp.GradScaler("cpu", **kwargs)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def one_step(scaler, overflow: bool = False) -> None:
        opt.zero_grad()
        scaler.scale(model(torch.randn(2, 3)).sum()).backward()
        if overflow:
            model.weight.grad[0, 0] = math.inf
        scaler.step(opt)
        scaler.update()

    # Clean, clean, clean (grow), clean, inf (back off), clean, clean: the tracker ends at 2, one clean step
    # short of growing, so a lost or reset tracker changes the next scale.
    for overflow in (False, False, False, False, True, False, False):
        one_step(ours, overflow)
        one_step(ref, overflow)
    for key, value in ref.state_dict().items():
        assert_equal(ours.state_dict().get(key), value, name=f"state_dict()[{key!r}] after 7 steps (GradScaler's, "
                     "same steps)", section=SEC.format(4))
    for source, label in ((ours.state_dict(), "your state_dict()"), (ref.state_dict(), "GradScaler.state_dict()")):
        loaded = impl.precision.DynamicLossScaler()
        loaded.load_state_dict(source)
        expected = torch.amp.GradScaler("cpu")
        expected.load_state_dict(ref.state_dict())
        assert_equal(loaded.get_scale(), expected.get_scale(), name=f"scale loaded from {label}", section=SEC.format(4))
        for extra in range(2):
            one_step(loaded)
            one_step(expected)
            assert_equal(loaded.get_scale(), expected.get_scale(), name=f"scale {extra + 1} clean step(s) after "
                         f"load_state_dict({label}) (the growth tracker must survive the round trip)",
                         section=SEC.format(4))


@pytest.mark.points(1)
def test_scaler_rejects_bad_arguments(impl) -> None:
    """Bad constructor arguments and unscale_ twice raise errors that name the problem (GradScaler raises too)."""
    Scaler = impl.precision.DynamicLossScaler
    for kwargs, argument in (({"growth_interval": 0}, "growth_interval"), ({"growth_interval": -5}, "growth_interval"),
                             ({"backoff_factor": 1.0}, "backoff_factor"), ({"backoff_factor": 1.5}, "backoff_factor"),
                             ({"growth_factor": 1.0}, "growth_factor"), ({"init_scale": 0.0}, "init_scale")):
        with pytest.raises(ValueError, match=argument):
            Scaler(**kwargs)
    for scaler in (Scaler(), torch.amp.GradScaler("cpu")):
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.scale(model(torch.randn(3, 2)).sum()).backward()
        scaler.unscale_(opt)
        with pytest.raises(RuntimeError, match="unscale_"):
            scaler.unscale_(opt)


# ------------------------------------------------------------------------------------------------------
# §5 The training step


def _reference_fp32_losses(model, batch, steps: int, max_grad_norm: float | None) -> list[float]:
    """Plain fp32 training: the baseline mixed precision must track."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.points(2)
def test_bf16_train_step_tracks_fp32(impl) -> None:
    """fp32 mode equals a plain training loop; bf16 losses stay within 0.01 of it; weights stay fp32."""
    config = get_config("tiny", num_layers=1)
    base = TransformerLM(config)
    batch = _batch(config, 2, 32)
    expected = _reference_fp32_losses(copy.deepcopy(base), batch, steps=4, max_grad_norm=0.5)
    # fp32 runs the same ops as the loop above (atol 1e-5 on a loss of ≈ 6.2: a few fp32 ulps, 2⁻²³·6.2 ≈ 7e-7,
    # times the reassociation of a clip-norm sum). bf16 (u = 2⁻⁹ ≈ 2e-3 per rounding) perturbs the logits by
    # ~u·|logit| ≈ 1e-3 and the loss, a mean over 64 tokens, by less; 1e-2 is a ≥ 3× margin.
    # Before any update every correct step computes the same first loss: the autocast forward, then the fp32
    # loss. Same ops on the same values, so rtol 1e-6 (≈ 8 fp32 ulps) allows only a reordered mean; a loss kept in
    # bf16 is off by up to half a bf16 ulp, 2⁻⁶ ≈ 0.016 at 6.2.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        bf16_logits = base(batch[0])
    first_bf16_loss = cross_entropy(bf16_logits, batch[1]).item()
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(4):
            loss = impl.precision.mixed_precision_train_step(model, batch, opt, dtype=dtype, max_grad_norm=0.5)
            assert isinstance(loss, float), f"mixed_precision_train_step must return a float, got {type(loss)}"
            if dtype == torch.bfloat16 and step == 0:
                assert_close(torch.tensor(loss), torch.tensor(first_bf16_loss), name="bf16 loss at step 0 (the "
                             "autocast forward's logits, then the loss in fp32 with kit.model.cross_entropy)",
                             section=SEC.format(5), rtol=1e-6, atol=0)
            assert_close(torch.tensor(loss), torch.tensor(expected[step]), name=f"{dtype} loss at step {step}",
                         section=SEC.format(5), rtol=0, atol=atol)
        for name, p in model.named_parameters():
            assert_equal(p.dtype, torch.float32, name=f"dtype of master weight {name} after {dtype} steps",
                         section=SEC.format(5))
        moved = (model.lm_head.weight - base.lm_head.weight).abs().max().item()
        assert moved > 0, f"the {dtype} steps did not change the weights. See {SEC.format(5)}."


@pytest.mark.points(2)
def test_fp16_train_step_with_scaler_matches_grad_scaler(impl) -> None:
    """fp16 with DynamicLossScaler equals a loop driven by torch.amp.GradScaler; fp16 without a scaler is refused."""
    config = get_config("tiny", num_layers=1)
    base = TransformerLM(config)
    batch = _batch(config, 2, 16)
    ref_model = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=3e-3)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = impl.precision.DynamicLossScaler(init_scale=2.0**12, growth_interval=2)
    for step in range(3):
        ref_opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = ref_model(batch[0])
        ref_loss = cross_entropy(logits, batch[1])
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        loss = impl.precision.mixed_precision_train_step(model, batch, opt, dtype=torch.float16, scaler=scaler)
        # The same autocast ops as the loop above: equal up to fp32 rounding of the loss (≈ 6.2, ulp 5e-7).
        assert_close(torch.tensor(loss), ref_loss.detach(), name=f"fp16 loss at step {step}", section=SEC.format(5),
                     rtol=1e-6, atol=1e-6)
        assert_equal(scaler.get_scale(), ref_scaler.get_scale(), name=f"scale after step {step}", section=SEC.format(4))
    # Same ops, so only reassociation differs: 3 AdamW steps of size lr = 3e-3 each, rounded in fp32; rtol 1e-5
    # (≈ 100 ulps) and atol 1e-6 (weights near 0) allow it; a different step moves weights by ~lr = 3e-3.
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert_close(p, q, name=f"parameter {name} after 3 fp16 steps", section=SEC.format(5), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="scaler"):
        impl.precision.mixed_precision_train_step(model, batch, opt, dtype=torch.float16)


def _float64_clipped_sgd_update(model, batch, lr: float, max_grad_norm: float) -> dict[str, torch.Tensor]:
    """The update one SGD step makes with the *true* gradients clipped to ``max_grad_norm``, in float64
    (the kit's RMSNorm and loss upcast to fp32 only, whatever the input)."""
    model64 = copy.deepcopy(model).double()
    cross_entropy(model64(batch[0]), batch[1]).backward()
    norm = torch.sqrt(sum((p.grad**2).sum() for p in model64.parameters())).item()
    factor = min(1.0, max_grad_norm / (norm + 1e-6))  # clip_grad_norm_'s rule, eps included
    assert factor < 0.2, f"test setup: the gradient norm {norm:.3g} must be well above max_grad_norm"
    return {name: -lr * factor * p.grad for name, p in model64.named_parameters()}


@pytest.mark.points(2)
def test_train_step_with_scaler_clips_the_unscaled_gradients(impl) -> None:
    """With a loss scaler *and* max_grad_norm the step clips the true (unscaled) gradients: (a) fp32 with a
    scale of 1000 moves the weights exactly as a float64 SGD step on the clipped true gradients; (b) fp16 steps
    equal a torch.amp.GradScaler loop that calls unscale_ before clip_grad_norm_."""
    config = get_config("tiny", num_layers=1)
    torch.manual_seed(0)
    base = TransformerLM(config)
    batch = _batch(config, 2, 16)
    lr, max_norm = 0.5, 0.05
    # (a) A scale that is not a power of two: clipping the scaled gradients (norm ≈ 1000 × the true one)
    # and then unscaling gives weight updates 1000× too small; forgetting to clip gives them ≈ 30× too big.
    expected = _float64_clipped_sgd_update(base, batch, lr, max_norm)
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = impl.precision.DynamicLossScaler(init_scale=1000.0)
    impl.precision.mixed_precision_train_step(model, batch, opt, dtype=torch.float32, scaler=scaler,
                                              max_grad_norm=max_norm)
    # Error model: the fp32 gradients carry a relative error ≲ 1e-5 (reductions over ≤ 512 terms in fp32,
    # u = 6e-8, plus the fp32 norms), the scale/unscale round trip 2 ulps: rtol 1e-3 is a ≥ 10× margin. The
    # update is read back as (new − old) weights, each rounded to fp32: atol = one ulp of the largest weight.
    atol = 2.0**-23 * max(p.abs().max().item() for p in base.parameters())
    for (name, p), p0 in zip(model.named_parameters(), base.parameters()):
        assert_close(p.detach().double() - p0.detach().double(), expected[name],
                     name=f"SGD update of {name} (fp32, scaler S=1000, max_grad_norm={max_norm}; clip the "
                     "gradients after scaler.unscale_, never the scaled ones)", section=SEC.format(5),
                     rtol=1e-3, atol=atol)
    # (b) fp16 autocast against GradScaler: unscale_, clip, step, update — three steps, the scale growing.
    ref_model, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=lr)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, growth_factor=3.0, growth_interval=2)
    scaler = impl.precision.DynamicLossScaler(init_scale=1000.0, growth_factor=3.0, growth_interval=2)
    for step in range(3):
        ref_opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = ref_model(batch[0])
        ref_scaler.scale(cross_entropy(logits, batch[1])).backward()
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        impl.precision.mixed_precision_train_step(model, batch, opt, dtype=torch.float16, scaler=scaler,
                                                  max_grad_norm=max_norm)
        assert_equal(scaler.get_scale(), ref_scaler.get_scale(), name=f"scale after fp16 step {step}",
                     section=SEC.format(4))
        # Same ops in the same order as the loop above; the clipped update is lr × ≤ 0.05 per step, so
        # rtol 1e-5 and atol 1e-6 allow fp32 reassociation only.
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert_close(p, q, name=f"parameter {name} after fp16 step {step} with scaler and max_grad_norm={max_norm} "
                         "(unscale_ before clip_grad_norm_)", section=SEC.format(5), rtol=1e-5, atol=1e-6)


@pytest.mark.points(1)
def test_unsupported_dtype_is_rejected(impl) -> None:
    """fp64, fp8 and ints are not compute dtypes here: ValueError naming `dtype`."""
    config = get_config("tiny", num_layers=1)
    model = TransformerLM(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = _batch(config, 1, 8)
    for bad in (torch.float64, torch.int8, "fp8"):
        with pytest.raises(ValueError, match="dtype"):
            impl.precision.mixed_precision_train_step(model, batch, opt, dtype=bad)
        with pytest.raises(ValueError, match="dtype"):
            impl.precision.autocast_dtype_report(impl.precision.ToyModel(), torch.randn(2, 20), bad)
        with pytest.raises(ValueError, match="dtype"):
            impl.precision.activation_memory_estimate(config, 1, 8, bad)


# ------------------------------------------------------------------------------------------------------
# §6 Activation memory


@pytest.mark.points(1)
def test_saved_activation_bytes_small_graph(impl) -> None:
    """Hand-counted: exp saves its output, mul both inputs, sin and cos their input; a shared storage (a tensor
    and its view) counts once, leaves that require grad (parameters) do not count, a bf16 copy does."""
    a = torch.randn(1000, requires_grad=True)

    def fn():
        y = a.exp()                   # saves y: 4000 bytes
        z = y * y                     # saves y twice: same storage, nothing new
        w = z.sin()                   # saves z: 4000 bytes
        v = a.to(torch.bfloat16).sin()  # saves the bf16 copy: 2000 bytes
        u = a * a                     # saves the leaf a: not activation memory
        t = y[:500].cos()             # saves a view of y: y's storage, already counted
        return w.sum() + v.float().sum() + u.sum() + t.sum()

    got = impl.precision.saved_activation_bytes(fn)
    assert_equal(got, 4000 + 4000 + 2000, name="saved_activation_bytes of the small graph", section=SEC.format(6))


def _measure(impl, model, batch, dtype) -> int:
    def fn():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logits = model(batch[0])
        return cross_entropy(logits, batch[1])

    return impl.precision.saved_activation_bytes(fn)


def _saved_bytes_independent(model, inputs, targets, dtype) -> int:
    """What autograd saves in one forward + loss, measured by the test's own pack hook (handout 02 §6 rules:
    each storage once at its full size; leaves that require grad and their views not counted)."""
    storages = {}

    def pack(t):
        base = t._base if t._base is not None else t
        if not (base.is_leaf and base.requires_grad):
            storages.setdefault((t.device, t.untyped_storage().data_ptr()), t.untyped_storage())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logits = model(inputs)
        cross_entropy(logits, targets)
    return sum(st.nbytes() for st in storages.values())


def _hand_count(config, B: int, T: int, dtype) -> dict[str, int]:
    """Handout 02 §6 item by item, on a CPU, for the diagnosis in a failure message (the test compares
    against the measurement, not against this)."""
    d, F_, H, V, L = config.d_model, config.d_ff, config.num_heads, config.vocab_size, config.num_layers
    c = 4 if dtype == torch.float32 else 2
    lowp = dtype != torch.float32
    BTd = B * T * d
    items = {
        "residual": 2 * BTd * 4,
        "norms": 2 * (BTd * 4 + B * T * 4),
        "linear inputs": 6 * BTd * c if lowp else 3 * BTd * 4,
        "rope": 2 * BTd * c + 2 * T * (d // H) * c,
        "attention softmax": B * H * T * T * c,
        "causal mask": T * T,
        "attention v copy": BTd * c,
        "mlp": 4 * B * T * F_ * c,
    }
    outside = {
        "embedding": B * T * 8,
        "head": 2 * BTd * 4 + B * T * 4 + BTd * c,
        "loss": B * T * V * 4 + B * T * 8,
        "weight_copies": (L * (4 * d * d + 3 * d * F_) + d * V) * c if lowp else 0,
    }
    return {**{f"per_layer[{k!r}]": v for k, v in items.items()}, **outside}


def _breakdown(est: dict, expected: dict[str, int]) -> tuple[str, str]:
    """(the items that differ from the hand count, in one line; every item next to the hand count, one a line)."""
    rows, differ = [], []
    for key, want in expected.items():
        if key.startswith("per_layer["):
            per_layer = est.get("per_layer")
            got = per_layer.get(key[len("per_layer['"):-2]) if isinstance(per_layer, dict) else None
        else:
            got = est.get(key)
        mark = "" if got == want else "   <-- differs"
        if got != want:
            differ.append(f"{key} (yours {got}, hand count {want})")
        rows.append(f"    {key:32s} yours {got!s:>10}  hand count {want:>10}{mark}")
    summary = ("items that differ from a hand count: " + ", ".join(differ)) if differ else (
        "every item you return under the handout's names equals a hand count, so look at the total itself")
    return summary, "\n".join(rows)


# Sizes chosen so no term hides behind another: two batch sizes, contexts 16–48 (T² vs T terms), d_model
# 64 and 96 (3 heads of 32, d_ff not 4·d), 1–3 layers (per-layer vs once-per-model terms).
ESTIMATE_CASES = [
    ({"num_layers": 2}, 2, 32),
    ({"num_layers": 1}, 3, 16),
    ({"num_layers": 3}, 1, 48),
    ({"d_model": 96, "d_ff": 160, "num_heads": 3, "num_layers": 1}, 2, 24),
]
# Tolerance: the count is exact except for 0-dim tensors, which it leaves out — the loss saves one fp32
# scalar (4 bytes). 16 bytes (four such scalars) is below the smallest item at every size tested (the T²-byte
# causal mask, 256 bytes at T = 16), so dropping or miscounting any item fails.
ESTIMATE_ATOL_BYTES = 16


@pytest.mark.points(3)
def test_activation_estimate_matches_measurement(impl) -> None:
    """The analytic count equals the measured saved bytes to within 16 bytes (fp32 and bf16, several sizes),
    and one layer's count equals what adding one layer measures."""
    for overrides, B, T in ESTIMATE_CASES:
        config = get_config("tiny", **overrides)
        # Separate storages, as a data loader gives them: two views of one token tensor would be one storage.
        inputs, targets = (t.clone() for t in _batch(config, B, T))
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            measured = _saved_bytes_independent(TransformerLM(config), inputs, targets, dtype)
            est = impl.precision.activation_memory_estimate(config, B, T, dtype, device_type="cpu")
            where = (f"L={config.num_layers}, d_model={config.d_model}, heads={config.num_heads}, "
                     f"d_ff={config.d_ff}, B={B}, T={T}, {dtype}, device_type='cpu'")
            assert isinstance(est, dict) and "total" in est, f"activation_memory_estimate returned {est!r}"
            diff = est["total"] - measured
            if abs(diff) > ESTIMATE_ATOL_BYTES:
                summary, table = _breakdown(est, _hand_count(config, B, T, dtype))
                raise AssertionError(
                    f"estimated total {est['total']} bytes vs measured {measured} ({where}): off by {diff:+d} bytes, "
                    f"more than the {ESTIMATE_ATOL_BYTES} allowed; {summary}. See {SEC.format(6)}.\n"
                    f"The count is exact but for the loss's 4-byte scalar. Your items against a hand count of "
                    f"handout 02 §6 (per_layer items count once per layer):\n{table}")
            assert_equal(sum(est["per_layer"].values()), est["layer_total"], name="sum of per_layer items",
                         section=SEC.format(6))
    # One layer: (2 layers) − (1 layer) measured, against layer_total plus, under autocast, that block's
    # weight copies. Exact (the loss scalar cancels).
    B, T = 2, 32
    for dtype in (torch.float32, torch.bfloat16):
        measured = {}
        for layers in (1, 2):
            config = get_config("tiny", num_layers=layers)
            inputs, targets = (t.clone() for t in _batch(config, B, T))
            measured[layers] = _saved_bytes_independent(TransformerLM(config), inputs, targets, dtype)
        est = impl.precision.activation_memory_estimate(config, B, T, dtype, device_type="cpu")
        weight_copies = (4 * config.d_model**2 + 3 * config.d_model * config.d_ff) * 2 if dtype != torch.float32 else 0
        assert_equal(est["layer_total"] + weight_copies, measured[2] - measured[1],
                     name=f"estimated bytes of one layer ({dtype}, B={B}, T={T}; layer_total plus the block's weight "
                     "copies under autocast) vs measured 2-layer minus 1-layer", section=SEC.format(6))
    # With checkpoint_policy, against a model the test checkpoints itself (torch.utils.checkpoint around each
    # segment of k blocks): the blocks keep only each segment's input, and their weight copies are made again in
    # backward. Exact to the same 16 bytes. 3 layers and k = 2: segments of 2 and 1 blocks.
    config = get_config("tiny", num_layers=3)
    inputs, targets = (t.clone() for t in _batch(config, B, T))
    for policy, k in (("every_block", 1), (2, 2)):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            measured = _saved_bytes_independent(_checkpointed_by_test(TransformerLM(config), k), inputs, targets,
                                                dtype)
            est = impl.precision.activation_memory_estimate(config, B, T, dtype, device_type="cpu",
                                                            checkpoint_policy=policy)
            diff = est["total"] - measured
            if abs(diff) > ESTIMATE_ATOL_BYTES:
                raise AssertionError(
                    f"estimated total {est['total']} bytes with checkpoint_policy={policy!r} vs measured {measured} "
                    f"(L=3, B={B}, T={T}, {dtype}): off by {diff:+d} bytes, more than the {ESTIMATE_ATOL_BYTES} "
                    f"allowed. Checkpointed blocks keep only each segment's fp32 input (⌈L/k⌉ = {math.ceil(3 / k)} "
                    f"of {B * T * config.d_model * 4} bytes; yours: layers = {est.get('layers')}), and under autocast "
                    f"only the LM head's weight copy stays saved (yours: weight_copies = {est.get('weight_copies')}). "
                    f"See {SEC.format(6)} and {SEC.format(7)}.")


class _Segments(torch.nn.Module):
    """The test's own checkpointing: k consecutive blocks under one non-reentrant torch.utils.checkpoint."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def _run(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self._run, x, use_reentrant=False)


def _checkpointed_by_test(model, k: int):
    blocks = list(model.layers)
    model.layers = torch.nn.ModuleList(_Segments(blocks[i:i + k]) for i in range(0, len(blocks), k))
    return model


# ------------------------------------------------------------------------------------------------------
# §7 Checkpointing


def _grads_after_backward(model, batch) -> tuple[float, dict[str, torch.Tensor | None]]:
    loss = cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    return loss.item(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _check_policy(impl, policy, k: int) -> None:
    """Saved bytes drop to (what the blocks saved) replaced by (one input per segment); gradients unchanged."""
    L, B, T = 4, 2, 32
    plan = [list(seg) for seg in impl.precision.checkpoint_segments(L, policy)]
    assert_equal(plan, [list(range(i, min(i + k, L))) for i in range(0, L, k)],
                 name=f"checkpoint_segments({L}, {policy!r}) (segments of k = {k} consecutive blocks)",
                 section=SEC.format(7))
    config = get_config("tiny", num_layers=L)
    base = TransformerLM(config)
    batch = _batch(config, B, T)
    full = _measure(impl, base, batch, torch.float32)
    one_fewer = _measure(impl, TransformerLM(config.with_(num_layers=L - 1)), batch, torch.float32)
    block_bytes = full - one_fewer
    segment_input = B * T * config.d_model * 4
    expected = full - L * block_bytes + math.ceil(L / k) * segment_input
    model = impl.precision.checkpointed(copy.deepcopy(base), policy)
    got = _measure(impl, model, batch, torch.float32)
    # Exact: every term of `expected` is a measurement of the same forward or a B·T·d fp32 segment input; only
    # 0-dim scalars could differ, so the same 16-byte slack as the estimate (ESTIMATE_ATOL_BYTES).
    assert_close(torch.tensor(float(got)), torch.tensor(float(expected)),
                 name=f"saved bytes with checkpoint policy {policy!r} (uncheckpointed: {full})",
                 section=SEC.format(7), rtol=0, atol=ESTIMATE_ATOL_BYTES)
    assert full / got >= 0.9 * full / expected, f"checkpointing saved too little: {full} → {got} bytes"
    loss_ref, grads_ref = _grads_after_backward(copy.deepcopy(base), batch)
    loss, grads = _grads_after_backward(model, batch)
    # Recomputation replays the same fp32 ops on the same inputs, so loss and gradients agree to rounding
    # (the backward may sum in another order): rtol 1e-5 ≈ 100 fp32 ulps, atol 1e-6 for values near 0.
    assert_close(torch.tensor(loss), torch.tensor(loss_ref), name=f"loss with policy {policy!r} (the same function "
                 "as without checkpointing: every block of the segment runs, in order)",
                 section=SEC.format(7), rtol=1e-6, atol=1e-6)
    for name, g in grads_ref.items():
        assert grads[name] is not None, (
            f"parameter {name} got no gradient with checkpoint policy {policy!r}: its block never ran in the forward "
            f"(the segment's checkpointed forward must run every block of the segment, in order). See {SEC.format(7)}.")
        assert_close(grads[name], g, name=f"gradient of {name} with policy {policy!r}", section=SEC.format(7),
                     rtol=1e-5, atol=1e-6)


def _check_dropout_replayed(impl, policy) -> None:
    """Blocks with dropout, checkpointed as an nn.ModuleList: backward's recomputation must draw the same dropout
    masks as the forward did (torch.utils.checkpoint restores the RNG state), or the gradients are wrong."""
    torch.manual_seed(0)
    base = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.Tanh())
                               for _ in range(3))
    x = torch.randn(8, 16, requires_grad=True)
    grads = []
    for blocks in (copy.deepcopy(base), impl.precision.checkpointed(copy.deepcopy(base), policy)):
        torch.manual_seed(1)
        h = x
        for block in blocks:  # the caller runs the blocks in order, as TransformerLM does
            h = block(h)
        h.square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in blocks.named_parameters()})
    # Same fp32 ops on the same values if the masks are replayed: rtol 1e-5, atol 1e-6 allow reordering only; a
    # fresh mask zeroes a different half of the units, an O(1) change.
    for name, g in grads[0].items():
        assert_close(grads[1][name], g, name=f"gradient of {name} in dropout blocks with policy {policy!r} (the "
                     "recomputation must replay the forward's dropout masks: keep checkpoint's RNG-state restore)",
                     section=SEC.format(7), rtol=1e-5, atol=1e-6)


@pytest.mark.points(3)
def test_checkpoint_every_block(impl) -> None:
    """Every block checkpointed: each block keeps only its input; gradients equal the uncheckpointed ones, also
    with dropout in the blocks."""
    _check_policy(impl, "every_block", 1)
    _check_dropout_replayed(impl, "every_block")


@pytest.mark.points(1)
def test_checkpoint_every_k_blocks(impl) -> None:
    """Segments of k blocks: the segment plan, a bad policy, and the saved bytes and gradients for k = 2."""
    segments = impl.precision.checkpoint_segments(5, 2)
    assert_equal([list(s) for s in segments], [[0, 1], [2, 3], [4]], name="checkpoint_segments(5, 2)",
                 section=SEC.format(7))
    assert_equal([list(s) for s in impl.precision.checkpoint_segments(3, "every_block")], [[0], [1], [2]],
                 name="checkpoint_segments(3, 'every_block')", section=SEC.format(7))
    assert_equal(impl.precision.checkpoint_segments(3, "none"), [], name="checkpoint_segments(3, 'none')",
                 section=SEC.format(7))
    for bad in (0, -1, "sqrt"):
        with pytest.raises(ValueError, match="policy"):
            impl.precision.checkpoint_segments(4, bad)
    _check_policy(impl, 2, 2)
    _check_dropout_replayed(impl, 2)


# ------------------------------------------------------------------------------------------------------
# §8 On a GPU (checks, not graded)


@pytest.mark.gpu
def test_gpu_peak_memory_and_estimate(impl) -> None:
    """On CUDA: bf16 forward peaks below fp32; the estimate (device_type='cuda') matches the measurement."""
    config = get_config("mini")
    model = TransformerLM(config).cuda()
    batch = tuple(t.cuda() for t in _batch(config, 4, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # One step first: Adam's state is allocated then, so both measurements see the same steady state.
    impl.precision.mixed_precision_train_step(model, batch, opt, dtype=torch.float32)
    peaks = {}
    for dtype in (torch.float32, torch.bfloat16):
        peaks[dtype] = impl.precision.step_peak_memory(model, batch, dtype=dtype, mode="train_step", optimizer=opt)

        def fn(dtype=dtype):
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                logits = model(batch[0])
            return cross_entropy(logits, batch[1])

        measured = impl.precision.saved_activation_bytes(fn)
        est = impl.precision.activation_memory_estimate(config, 4, 128, dtype, device_type="cuda")
        # Not yet measured on a GPU at a tight tolerance: by handout 02 §6 the CUDA count differs from the CPU
        # one (exact to ESTIMATE_ATOL_BYTES above) only in the fp32 softmax. Until a GPU run confirms the count
        # is exact on CUDA too, 10% guards against gross errors only (a dropped softmax is ≈ 20% at T = 128).
        assert_close(torch.tensor(float(est["total"])), torch.tensor(float(measured)),
                     name=f"CUDA estimated total bytes ({dtype})", section=SEC.format(6), rtol=0.10, atol=0)
    assert peaks[torch.bfloat16] < peaks[torch.float32], peaks
