"""Stage 2 — mixed precision, loss scaling and activation memory (handout/02-mixed-precision.md).

Every check compares against something independent of the code under test: numpy's IEEE fp16/fp32
arithmetic, torch.autocast run op by op, torch.amp.GradScaler, a plain fp32 training loop, and
hand-counted bytes.

The implementation runs in the worker (``worker.call``): the module-level functions below build the
same seeded models and inputs as the test, call the implementation and return what it computed — sums,
dtypes, scales, losses, parameters, byte counts — as data. The tests compute the expected values here, in
the judge (GradScaler, the plain training loops, the test's own saved-tensor hook), and compare. Loops
that the test used to run step by step come back step by step (:func:`tests.support.precision.stepwise`):
the test checks each step's values in the old order and meets a failure where the implementation raised.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kit.impl
from kit.checks import outcome_of
from kit.model import TransformerLM, cross_entropy, get_config
from kit.testing import assert_close, assert_equal, assert_raised
from tests.support.precision import Steps, checkpointed_by_test, saved_bytes_independent, stepwise

pytestmark = pytest.mark.stage2

SEC = "handout 02 §{}"


def _batch(config, batch_size: int, context_length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch_size, context_length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


INF_STEPS = {4, 5, 13, 31, 50}
NAN_STEPS = {9, 22, 45}


def _inject(model: torch.nn.Module, step: int) -> None:
    """Overwrite one scaled gradient element with inf or nan at the chosen steps (as an fp16 overflow would)."""
    if step in INF_STEPS:
        model.weight.grad[0, 0] = -math.inf if step == 50 else math.inf
    elif step in NAN_STEPS:
        model.weight.grad[1, 2] = math.nan


def _unscales_at(step: int) -> bool:
    """The steps of test_scaler_matches_grad_scaler that call unscale_ and clip (two of them overflows)."""
    return step % 7 == 0 or step in (13, 45)


def _dropout_blocks() -> torch.nn.ModuleList:
    return torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.Tanh())
                               for _ in range(3))


def _grads_after_backward(model, batch) -> tuple[float, dict[str, torch.Tensor | None]]:
    loss = cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    return loss.item(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------------------------------
# What runs in the worker: the implementation on the test's seeded models and inputs; data back
# ----------------------------------------------------------------------------------------------------


def _precision():
    return kit.impl.load().precision


def _model(config, state: dict) -> TransformerLM:
    """The kit's TransformerLM with the judge's weights (a copy of the judge's ``base``)."""
    model = TransformerLM(config)
    model.load_state_dict(state)
    return model


def _params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _accumulation(kwargs: dict) -> dict:
    return _precision().accumulation_experiment(**kwargs)


def _autocast_report(x, dtype, targets=None) -> dict:
    precision = _precision()
    torch.manual_seed(0)
    model = precision.ToyModel(in_features=20, out_features=5)
    kwargs = {} if targets is None else {"targets": targets}
    return precision.autocast_dtype_report(model, x, dtype, **kwargs)


def _autocast_report_leaves_grads_none(x) -> bool:
    """Whether every .grad is still None after a report on a model without gradients."""
    precision = _precision()
    torch.manual_seed(0)
    model = precision.ToyModel(in_features=20, out_features=5)
    model.zero_grad(set_to_none=True)
    precision.autocast_dtype_report(model, x, "bf16")
    return all(p.grad is None for p in model.parameters())


def _scaler_run(kwargs: dict, state: dict, inputs: list) -> dict:
    """test_scaler_matches_grad_scaler's loop with the implementation's scaler, step by step."""
    precision = _precision()
    model = torch.nn.Linear(6, 4)
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = precision.DynamicLossScaler(**kwargs)

    def step(i: int, record: dict) -> None:
        x, y = inputs[i]
        opt.zero_grad(set_to_none=True)
        scaler.scale(F.mse_loss(model(x), y)).backward()
        _inject(model, i)
        if _unscales_at(i):
            record["found"] = bool(scaler.unscale_(opt))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        record["grads"] = [p.grad.clone() for p in model.parameters()]
        scaler.update()
        record["scale"] = scaler.get_scale()
        record["steps_taken"] = float(opt.state[model.weight].get("step", torch.tensor(0.0)))
        record["params"] = [p.detach().clone() for p in model.parameters()]

    return stepwise(step, 60)


def _scaler_step(model, opt, scaler, overflow: bool = False) -> None:
    """test_scaler_state_dict's step (the judge runs the same with GradScaler)."""
    opt.zero_grad()
    scaler.scale(model(torch.randn(2, 3)).sum()).backward()
    if overflow:
        model.weight.grad[0, 0] = math.inf
    scaler.step(opt)
    scaler.update()


def _scaler_state_after(kwargs: dict, overflows: tuple) -> dict:
    precision = _precision()
    torch.manual_seed(0)
    scaler = precision.DynamicLossScaler(**kwargs)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for overflow in overflows:
        _scaler_step(model, opt, scaler, overflow)
    return scaler.state_dict()


def _scaler_loaded(source: dict, extra_steps: int) -> dict:
    """A scaler loaded from ``source``: its scale (step 0), then after each of ``extra_steps`` clean steps."""
    precision = _precision()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = []

    def step(i: int, record: dict) -> None:
        if i == 0:
            scaler.append(precision.DynamicLossScaler())
            scaler[0].load_state_dict(source)
        else:
            _scaler_step(model, opt, scaler[0])
        record["scale"] = scaler[0].get_scale()

    return stepwise(step, 1 + extra_steps)


def _scaler_constructor_outcomes(cases: list[dict]) -> list[dict]:
    Scaler = _precision().DynamicLossScaler
    return [outcome_of(Scaler, **kwargs) for kwargs in cases]


def _scaler_unscale_twice() -> dict:
    scaler = _precision().DynamicLossScaler()
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.randn(3, 2)).sum()).backward()
    scaler.unscale_(opt)
    return outcome_of(scaler.unscale_, opt)


def _train(config, state: dict, batch_shape: tuple[int, int], *, dtype, steps: int, optimizer: str, lr: float,
           scaler: dict | None = None, max_grad_norm: float | None = None, params_each_step: bool = False) -> dict:
    """``steps`` calls of mixed_precision_train_step on a copy of the judge's model: each step's loss (and the
    scale, and the parameters if asked), then the parameters."""
    precision = _precision()
    model = _model(config, state)
    batch = _batch(config, *batch_shape)
    opt = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer](model.parameters(), lr=lr)
    loss_scaler = precision.DynamicLossScaler(**scaler) if scaler is not None else None
    kwargs = {}
    if loss_scaler is not None:
        kwargs["scaler"] = loss_scaler
    if max_grad_norm is not None:
        kwargs["max_grad_norm"] = max_grad_norm

    def step(i: int, record: dict) -> None:
        record["loss"] = precision.mixed_precision_train_step(model, batch, opt, dtype=dtype, **kwargs)
        if loss_scaler is not None:
            record["scale"] = loss_scaler.get_scale()
        if params_each_step:
            record["params"] = _params(model)

    return stepwise(step, steps, final=lambda: _params(model))


def _fp16_step_without_scaler(config, state: dict, batch_shape: tuple[int, int]) -> dict:
    model = _model(config, state)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return outcome_of(_precision().mixed_precision_train_step, model, _batch(config, *batch_shape), opt,
                      dtype=torch.float16)


def _bad_dtype_outcomes(config, bad) -> list[dict]:
    """mixed_precision_train_step, autocast_dtype_report and activation_memory_estimate, each given ``bad``."""
    precision = _precision()
    torch.manual_seed(0)
    model = TransformerLM(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = _batch(config, 1, 8)
    return [outcome_of(precision.mixed_precision_train_step, model, batch, opt, dtype=bad),
            outcome_of(precision.autocast_dtype_report, precision.ToyModel(), torch.randn(2, 20), bad),
            outcome_of(precision.activation_memory_estimate, config, 1, 8, bad)]


def _small_graph_saved_bytes() -> int:
    torch.manual_seed(0)
    a = torch.randn(1000, requires_grad=True)

    def fn():
        y = a.exp()                   # saves y: 4000 bytes
        z = y * y                     # saves y twice: same storage, nothing new
        w = z.sin()                   # saves z: 4000 bytes
        v = a.to(torch.bfloat16).sin()  # saves the bf16 copy: 2000 bytes
        u = a * a                     # saves the leaf a: not activation memory
        t = y[:500].cos()             # saves a view of y: y's storage, already counted
        return w.sum() + v.float().sum() + u.sum() + t.sum()

    return _precision().saved_activation_bytes(fn)


def _estimate(config, batch_size: int, context_length: int, dtype, **kwargs) -> dict:
    return _precision().activation_memory_estimate(config, batch_size, context_length, dtype, device_type="cpu",
                                                   **kwargs)


def _segments(num_blocks: int, policy, raw: bool = False):
    """checkpoint_segments' plan, each segment as a list (``raw``: as returned, for the empty plan)."""
    segments = _precision().checkpoint_segments(num_blocks, policy)
    return segments if raw else [list(s) for s in segments]


def _segments_outcome(num_blocks: int, policy) -> dict:
    return outcome_of(_precision().checkpoint_segments, num_blocks, policy)


def _checkpointed_saved_bytes(config, state: dict, batch_shape: tuple[int, int], policy) -> int:
    """The bytes the test's own hook sees saved by a forward of the judge's model checkpointed by the
    implementation (the judge measures the uncheckpointed model with the same hook)."""
    model = _precision().checkpointed(_model(config, state), policy)
    return saved_bytes_independent(model, *_batch(config, *batch_shape), torch.float32)


def _checkpointed_grads(config, state: dict, batch_shape: tuple[int, int], policy) -> tuple:
    model = _precision().checkpointed(_model(config, state), policy)
    return _grads_after_backward(model, _batch(config, *batch_shape))


def _dropout_grads_checkpointed(state: dict, x: torch.Tensor, policy) -> dict:
    """The dropout blocks of _check_dropout_replayed, checkpointed by the implementation: their gradients."""
    blocks = _dropout_blocks()
    blocks.load_state_dict(state)
    blocks = _precision().checkpointed(blocks, policy)
    torch.manual_seed(1)
    h = x.clone().requires_grad_()
    for block in blocks:  # the caller runs the blocks in order, as TransformerLM does
        h = block(h)
    h.square().sum().backward()
    return {n: p.grad.clone() for n, p in blocks.named_parameters()}


def _gpu_peaks_and_estimates() -> dict:
    precision = _precision()
    config = get_config("mini")
    torch.manual_seed(0)
    model = TransformerLM(config).cuda()
    batch = tuple(t.cuda() for t in _batch(config, 4, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # One step first: Adam's state is allocated then, so both measurements see the same steady state.
    precision.mixed_precision_train_step(model, batch, opt, dtype=torch.float32)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        peak = precision.step_peak_memory(model, batch, dtype=dtype, mode="train_step", optimizer=opt)

        def fn(dtype=dtype):
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                logits = model(batch[0])
            return cross_entropy(logits, batch[1])

        out[name] = {"peak": peak, "measured": precision.saved_activation_bytes(fn),
                     "estimate": precision.activation_memory_estimate(config, 4, 128, dtype, device_type="cuda")}
    return out


# ----------------------------------------------------------------------------------------------------
# The tests: the judge's side
# ----------------------------------------------------------------------------------------------------

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
def test_accumulation_experiment(worker) -> None:
    """The four sums equal IEEE fp32/fp16 arithmetic exactly, for the default and another value."""
    for kwargs in ({}, {"value": 0.1, "steps": 300}):
        got = worker.call(_accumulation, kwargs)
        expected = _numpy_sums(kwargs.get("value", 0.01), kwargs.get("steps", 1000))
        assert_equal(sorted(got), sorted(expected), name="accumulation_experiment keys", section=SEC.format(1))
        for key, value in expected.items():  # IEEE rounding after every add is deterministic: exact
            assert_close(torch.tensor(got[key], dtype=torch.float64), torch.tensor(value, dtype=torch.float64),
                         name=f"accumulation_experiment({kwargs})[{key!r}]", section=SEC.format(1), rtol=0, atol=0)
    got = worker.call(_accumulation, {})
    # The lesson, on values already checked bit for bit: 1000 adds of 0.01 lose ≲ n·u·10 = 6e-4 in fp32 (1.3e-4
    # here) and 0.047 in fp16, whose ulp at 8–16 (2⁻⁷) is near the addend; 10× is a qualitative margin.
    assert abs(got["fp16"] - 10) > 10 * abs(got["fp32"] - 10), (
        f"an fp16 sum should lose far more than an fp32 one, got {got}. See {SEC.format(1)}.")


# ------------------------------------------------------------------------------------------------------
# §2 Autocast


class _ToyModel(torch.nn.Module):
    """The handout's ToyModel (given code in precision.py), the judge's own copy: linear → relu → layernorm →
    linear. The expected dtypes depend only on these layer types."""

    def __init__(self, in_features: int = 20, out_features: int = 5, hidden: int = 10):
        super().__init__()
        self.fc1 = torch.nn.Linear(in_features, hidden, bias=False)
        self.relu = torch.nn.ReLU()
        self.ln = torch.nn.LayerNorm(hidden)
        self.fc2 = torch.nn.Linear(hidden, out_features, bias=False)


@pytest.mark.points(3)
def test_autocast_dtype_report_toy_model(worker) -> None:
    """The report's dtypes match the ToyModel's layers run one by one under bf16 autocast on the CPU."""
    model = _ToyModel(in_features=20, out_features=5)
    x = torch.randn(8, 20)
    targets = torch.randint(0, 5, (8,))
    report = worker.call(_autocast_report, x, torch.bfloat16, targets)

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

    assert worker.call(_autocast_report_leaves_grads_none, x), (
        f"autocast_dtype_report must leave the model's .grad as it found it. See {SEC.format(2)}.")
    half = worker.call(_autocast_report, x, torch.float16, targets)
    assert_equal(half["fc1"], torch.float16, name="fc1 output under fp16 autocast (the dtype asked for)",
                 section=SEC.format(2))
    plain = worker.call(_autocast_report, x, torch.float32)
    assert_equal(plain["fc1"], torch.float32, name="fc1 output with autocast off (fp32)", section=SEC.format(2))


# ------------------------------------------------------------------------------------------------------
# §4 Loss scaling


@pytest.mark.builds("grad-scaler")
@pytest.mark.points(5)
def test_scaler_matches_grad_scaler(worker) -> None:
    """60 steps with inf/nan gradients injected: the same scale, skipped steps and parameters as GradScaler."""
    torch.manual_seed(0)
    ref_model = torch.nn.Linear(6, 4)
    state = copy.deepcopy(ref_model.state_dict())
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    # Factors that are not reciprocal powers of two (3 and 0.4, not 2 and 0.5): halving is not the same as
    # dividing by the growth factor, and a scale of 1000 makes 1/S inexact, so a swapped or inverted factor
    # changes the scale. All are exact in fp32 steps of GradScaler's own arithmetic.
    kwargs = {"init_scale": 1000.0, "growth_factor": 3.0, "backoff_factor": 0.4, "growth_interval": 3}
    ref = torch.amp.GradScaler("cpu", **kwargs)
    inputs = [(torch.randn(5, 6), torch.randn(5, 4)) for _ in range(60)]
    ours = Steps(worker.call(_scaler_run, kwargs, state, inputs), "_scaler_run")
    scales = []
    for step in range(60):
        x, y = inputs[step]
        ref_opt.zero_grad(set_to_none=True)
        ref.scale(F.mse_loss(ref_model(x), y)).backward()
        _inject(ref_model, step)
        if _unscales_at(step):  # the unscale_-then-clip path on some steps, two of them overflows
            assert_equal(ours.get(step, "found"), step in INF_STEPS | NAN_STEPS, name=f"unscale_() return value at "
                         f"step {step} (whether any gradient is inf or nan)", section=SEC.format(4))
            ref.unscale_(ref_opt)
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
        ref.step(ref_opt)
        ref_grads = [p.grad.clone() for p in ref_model.parameters()]
        ref.update()
        scale = ours.get(step, "scale")
        where = f"after step {step}"
        event = ("an inf gradient was injected: skip the step, scale × backoff_factor, reset the count"
                 if step in INF_STEPS else "a nan gradient was injected: skip the step, scale × backoff_factor, "
                 "reset the count" if step in NAN_STEPS else "a clean step: count it; × growth_factor after "
                 f"growth_interval={kwargs['growth_interval']} clean steps in a row")
        # A hint only (the scale is compared exactly below): within one fp32 ulp (≤ 2u relative, 2⁻²³) means the
        # arithmetic is right but the scale was kept in fp64.
        if scale != ref.get_scale() and math.isclose(scale, ref.get_scale(), rel_tol=2**-23):
            event += ("; equal but for fp32 rounding: GradScaler keeps S in an fp32 tensor, round every new scale "
                      "to fp32")
        assert_equal(scale, ref.get_scale(), name=f"scale {where} ({event})", section=SEC.format(4))
        ref_steps = ref_opt.state[ref_model.weight].get("step", torch.tensor(0.0))
        assert_equal(ours.get(step, "steps_taken"), float(ref_steps), name=f"optimizer steps taken {where} (a "
                     "skipped step must not reach optimizer.step)", section=SEC.format(4))
        # AdamW is nearly blind to a uniform scale of the gradients, so check the gradients themselves: step()
        # unscales them in place (× fp32(1/S)) unless unscale_ already did. Same fp32 ops on parameters that agree
        # to rtol 1e-6: rtol 1e-5 allows that and dividing by S instead of × fp32(1/S) (≤ 1 ulp); a missing or
        # inverted unscale is off by a factor S or S² ≥ 1e2.
        if step not in INF_STEPS | NAN_STEPS:
            for (name, _), g, h in zip(ref_model.named_parameters(), ours.get(step, "grads"), ref_grads):
                assert_close(g, h, name=f"{name}.grad after scaler.step() {where} (step unscales the gradients in "
                             "place, × 1/S, unless unscale_ already did)", section=SEC.format(4), rtol=1e-5, atol=1e-7)
        # Same ops in the same order on the same fp32 values as GradScaler: the parameters agree to the last
        # bit or so; rtol 1e-6 (≈ 8 fp32 ulps) allows a reordered clip-norm sum, atol 1e-7 values near 0. Such
        # differences are relative to g, so they never flip an AdamW step's sign: ≲ lr·2u ≈ 1e-9 a step, 60 steps.
        for (name, q), p in zip(ref_model.named_parameters(), ours.get(step, "params")):
            assert_close(p, q, name=f"parameter {name} {where}", section=SEC.format(4), rtol=1e-6, atol=1e-7)
        scales.append(scale)
    # The run must have exercised both directions, or it proves nothing.
    assert max(scales) > kwargs["init_scale"] and min(scales) < kwargs["init_scale"]
    assert_equal(int(ref_opt.state[ref_model.weight]["step"]), 60 - len(INF_STEPS | NAN_STEPS),
                 name="steps GradScaler took", section=SEC.format(4))


# Clean, clean, clean (grow), clean, inf (back off), clean, clean: the tracker ends at 2, one clean step
# short of growing, so a lost or reset tracker changes the next scale.
_STATE_DICT_OVERFLOWS = (False, False, False, False, True, False, False)


@pytest.mark.builds("grad-scaler")
@pytest.mark.points(1)
def test_scaler_state_dict(worker) -> None:
    """state_dict uses GradScaler's keys and values (the growth tracker included): after the same steps as a
    GradScaler it equals the GradScaler's, and a scaler loaded from either goes on exactly as GradScaler does."""
    kwargs = {"init_scale": 256.0, "growth_factor": 3.0, "backoff_factor": 0.4, "growth_interval": 3}
    ref = torch.amp.GradScaler("cpu", **kwargs)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for overflow in _STATE_DICT_OVERFLOWS:
        _scaler_step(model, opt, ref, overflow)
    ours = worker.call(_scaler_state_after, kwargs, _STATE_DICT_OVERFLOWS)
    for key, value in ref.state_dict().items():
        assert_equal(ours.get(key), value, name=f"state_dict()[{key!r}] after 7 steps (GradScaler's, "
                     "same steps)", section=SEC.format(4))
    for source, label in ((ours, "your state_dict()"), (ref.state_dict(), "GradScaler.state_dict()")):
        loaded = Steps(worker.call(_scaler_loaded, source, 2), "_scaler_loaded")
        expected = torch.amp.GradScaler("cpu")
        expected.load_state_dict(ref.state_dict())
        assert_equal(loaded.get(0, "scale"), expected.get_scale(), name=f"scale loaded from {label}",
                     section=SEC.format(4))
        for extra in range(2):
            _scaler_step(model, opt, expected)
            assert_equal(loaded.get(extra + 1, "scale"), expected.get_scale(), name=f"scale {extra + 1} clean "
                         f"step(s) after load_state_dict({label}) (the growth tracker must survive the round trip)",
                         section=SEC.format(4))


@pytest.mark.builds("grad-scaler")
@pytest.mark.points(1)
def test_scaler_rejects_bad_arguments(worker) -> None:
    """Bad constructor arguments and unscale_ twice raise errors that name the problem (GradScaler raises too)."""
    cases = [({"growth_interval": 0}, "growth_interval"), ({"growth_interval": -5}, "growth_interval"),
             ({"backoff_factor": 1.0}, "backoff_factor"), ({"backoff_factor": 1.5}, "backoff_factor"),
             ({"growth_factor": 1.0}, "growth_factor"), ({"init_scale": 0.0}, "init_scale")]
    outcomes = worker.call(_scaler_constructor_outcomes, [kwargs for kwargs, _ in cases])
    for (kwargs, argument), outcome in zip(cases, outcomes):
        call = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        assert_raised(outcome, ValueError, argument, what=f"DynamicLossScaler({call})", section=SEC.format(4))
    assert_raised(worker.call(_scaler_unscale_twice), RuntimeError, "unscale_",
                  what="unscale_(optimizer) a second time in one iteration", section=SEC.format(4))
    # GradScaler raises too: the rule is torch's.
    scaler = torch.amp.GradScaler("cpu")
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
def test_bf16_train_step_tracks_fp32(worker) -> None:
    """fp32 mode equals a plain training loop; bf16 losses stay within 0.01 of it; weights stay fp32."""
    config = get_config("tiny", num_layers=1)
    base = TransformerLM(config)
    batch = _batch(config, 2, 32)
    expected = _reference_fp32_losses(copy.deepcopy(base), batch, steps=4, max_grad_norm=0.5)
    # fp32 runs the same ops as the loop above (atol 1e-5 on a loss of ≈ 6.2: a few fp32 ulps, 2⁻²³·6.2 ≈ 7e-7,
    # times the reassociation of a clip-norm sum). bf16 (u = 2⁻⁸ ≈ 4e-3 per rounding) perturbs each logit by
    # ~u·|logit| ≲ 4e-3 with signs that average out over the 64 tokens of the mean loss; 1e-2 is a ≥ 3× margin.
    # Before any update every correct step computes the same first loss: the autocast forward, then the fp32
    # loss. Same ops on the same values, so rtol 1e-6 (≈ 8 fp32 ulps) allows only a reordered mean; a loss kept in
    # bf16 is off by up to half a bf16 ulp, 2⁻⁶ ≈ 0.016 at 6.2.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        bf16_logits = base(batch[0])
    first_bf16_loss = cross_entropy(bf16_logits, batch[1]).item()
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        run = Steps(worker.call(_train, config, base.state_dict(), (2, 32), dtype=dtype, steps=4, optimizer="adamw",
                                lr=3e-3, max_grad_norm=0.5), "_train")
        for step in range(4):
            loss = run.get(step, "loss")
            assert isinstance(loss, float), f"mixed_precision_train_step must return a float, got {type(loss)}"
            if dtype == torch.bfloat16 and step == 0:  # rtol 1e-6: the same ops as first_bf16_loss (above)
                assert_close(torch.tensor(loss), torch.tensor(first_bf16_loss), name="bf16 loss at step 0 (the "
                             "autocast forward's logits, then the loss in fp32 with kit.model.cross_entropy)",
                             section=SEC.format(5), rtol=1e-6, atol=0)
            # atol: 1e-5 for fp32, 1e-2 for bf16 (derived above; measured 7e-4 with bf16 emulated, MKL_CBWR=AVX2)
            assert_close(torch.tensor(loss), torch.tensor(expected[step]), name=f"{dtype} loss at step {step}",
                         section=SEC.format(5), rtol=0, atol=atol)
        params = run.final()
        for name, p in params.items():
            assert_equal(p.dtype, torch.float32, name=f"dtype of master weight {name} after {dtype} steps",
                         section=SEC.format(5))
        moved = (params["lm_head.weight"] - base.lm_head.weight.detach()).abs().max().item()
        assert moved > 0, f"the {dtype} steps did not change the weights. See {SEC.format(5)}."


@pytest.mark.builds("grad-scaler")
@pytest.mark.points(2)
def test_fp16_train_step_with_scaler_matches_grad_scaler(worker) -> None:
    """fp16 with DynamicLossScaler equals a loop driven by torch.amp.GradScaler; fp16 without a scaler is refused."""
    config = get_config("tiny", num_layers=1)
    base = TransformerLM(config)
    batch = _batch(config, 2, 16)
    ref_model = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=3e-3)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    run = Steps(worker.call(_train, config, base.state_dict(), (2, 16), dtype=torch.float16, steps=3,
                            optimizer="adamw", lr=3e-3, scaler={"init_scale": 2.0**12, "growth_interval": 2}), "_train")
    for step in range(3):
        ref_opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = ref_model(batch[0])
        ref_loss = cross_entropy(logits, batch[1])
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        # The same autocast ops as the loop above: equal up to fp32 rounding of the loss (≈ 6.2, ulp 4.8e-7);
        # rtol 1e-6 + atol 1e-6 ≈ 7e-6 is ~15 ulps.
        assert_close(torch.tensor(run.get(step, "loss")), ref_loss.detach(), name=f"fp16 loss at step {step}",
                     section=SEC.format(5), rtol=1e-6, atol=1e-6)
        assert_equal(run.get(step, "scale"), ref_scaler.get_scale(), name=f"scale after step {step}",
                     section=SEC.format(4))
    # Same ops, so only reassociation differs: 3 AdamW steps of size lr = 3e-3 each, rounded in fp32; rtol 1e-5
    # (≈ 100 ulps) and atol 1e-6 (weights near 0) allow it; a different step moves weights by ~lr = 3e-3.
    params = run.final()
    for name, q in ref_model.named_parameters():
        assert_close(params[name], q, name=f"parameter {name} after 3 fp16 steps", section=SEC.format(5), rtol=1e-5,
                     atol=1e-6)
    assert_raised(worker.call(_fp16_step_without_scaler, config, base.state_dict(), (2, 16)), ValueError, "scaler",
                  what="mixed_precision_train_step(dtype=torch.float16) without a scaler", section=SEC.format(5))


def _float64_clipped_sgd_update(model, batch, lr: float, max_grad_norm: float) -> dict[str, torch.Tensor]:
    """The update one SGD step makes with the *true* gradients clipped to ``max_grad_norm``, in float64
    (the kit's RMSNorm and loss upcast to fp32 only, whatever the input)."""
    model64 = copy.deepcopy(model).double()
    cross_entropy(model64(batch[0]), batch[1]).backward()
    norm = torch.sqrt(sum((p.grad**2).sum() for p in model64.parameters())).item()
    factor = min(1.0, max_grad_norm / (norm + 1e-6))  # clip_grad_norm_'s rule, eps included
    assert factor < 0.2, f"test setup: the gradient norm {norm:.3g} must be well above max_grad_norm"
    return {name: -lr * factor * p.grad for name, p in model64.named_parameters()}


@pytest.mark.builds("grad-scaler")
@pytest.mark.points(2)
def test_train_step_with_scaler_clips_the_unscaled_gradients(worker) -> None:
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
    params = Steps(worker.call(_train, config, base.state_dict(), (2, 16), dtype=torch.float32, steps=1,
                               optimizer="sgd", lr=lr, scaler={"init_scale": 1000.0}, max_grad_norm=max_norm),
                   "_train").final()
    # Error model: the fp32 gradients carry a relative error ≲ 1e-5 (reductions over ≤ 512 terms in fp32,
    # u = 6e-8, plus the fp32 norms), the scale/unscale round trip 2 ulps: rtol 1e-3 is a ≥ 10× margin. The
    # update is read back as (new − old) weights, each rounded to fp32: atol = one ulp of the largest weight.
    atol = 2.0**-23 * max(p.abs().max().item() for p in base.parameters())
    for name, p0 in base.named_parameters():
        assert_close(params[name].double() - p0.detach().double(), expected[name],
                     name=f"SGD update of {name} (fp32, scaler S=1000, max_grad_norm={max_norm}; clip the "
                     "gradients after scaler.unscale_, never the scaled ones)", section=SEC.format(5),
                     rtol=1e-3, atol=atol)
    # (b) fp16 autocast against GradScaler: unscale_, clip, step, update — three steps, the scale growing.
    ref_model = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=lr)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, growth_factor=3.0, growth_interval=2)
    run = Steps(worker.call(_train, config, base.state_dict(), (2, 16), dtype=torch.float16, steps=3,
                            optimizer="sgd", lr=lr, scaler={"init_scale": 1000.0, "growth_factor": 3.0,
                                                            "growth_interval": 2},
                            max_grad_norm=max_norm, params_each_step=True), "_train")
    for step in range(3):
        ref_opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = ref_model(batch[0])
        ref_scaler.scale(cross_entropy(logits, batch[1])).backward()
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        assert_equal(run.get(step, "scale"), ref_scaler.get_scale(), name=f"scale after fp16 step {step}",
                     section=SEC.format(4))
        # Same ops in the same order as the loop above; the clipped update is lr × ≤ 0.05 per step, so
        # rtol 1e-5 and atol 1e-6 allow fp32 reassociation only.
        params = run.get(step, "params")
        for name, q in ref_model.named_parameters():
            assert_close(params[name], q, name=f"parameter {name} after fp16 step {step} with scaler and "
                         f"max_grad_norm={max_norm} (unscale_ before clip_grad_norm_)", section=SEC.format(5),
                         rtol=1e-5, atol=1e-6)


@pytest.mark.points(1)
def test_unsupported_dtype_is_rejected(worker) -> None:
    """fp64, fp8 and ints are not compute dtypes here: ValueError naming `dtype`."""
    config = get_config("tiny", num_layers=1)
    for bad in (torch.float64, torch.int8, "fp8"):
        outcomes = worker.call(_bad_dtype_outcomes, config, bad)
        for outcome, what in zip(outcomes, (f"mixed_precision_train_step(dtype={bad!r})",
                                            f"autocast_dtype_report(ToyModel(), x, {bad!r})",
                                            f"activation_memory_estimate(config, 1, 8, {bad!r})")):
            assert_raised(outcome, ValueError, "dtype", what=what, section=SEC.format(2))


# ------------------------------------------------------------------------------------------------------
# §6 Activation memory


@pytest.mark.points(1)
def test_saved_activation_bytes_small_graph(worker) -> None:
    """Hand-counted: exp saves its output, mul both inputs, sin and cos their input; a shared storage (a tensor
    and its view) counts once, leaves that require grad (parameters) do not count, a bf16 copy does."""
    got = worker.call(_small_graph_saved_bytes)  # the graph is in _small_graph_saved_bytes, item by item
    assert_equal(got, 4000 + 4000 + 2000, name="saved_activation_bytes of the small graph", section=SEC.format(6))


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
def test_activation_estimate_matches_measurement(worker) -> None:
    """The analytic count equals the measured saved bytes to within 16 bytes (fp32 and bf16, several sizes),
    and one layer's count equals what adding one layer measures."""
    for overrides, B, T in ESTIMATE_CASES:
        config = get_config("tiny", **overrides)
        # Separate storages, as a data loader gives them: two views of one token tensor would be one storage.
        inputs, targets = (t.clone() for t in _batch(config, B, T))
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            measured = saved_bytes_independent(TransformerLM(config), inputs, targets, dtype)
            est = worker.call(_estimate, config, B, T, dtype)
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
            measured[layers] = saved_bytes_independent(TransformerLM(config), inputs, targets, dtype)
        est = worker.call(_estimate, config, B, T, dtype)
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
            measured = saved_bytes_independent(checkpointed_by_test(TransformerLM(config), k), inputs, targets, dtype)
            est = worker.call(_estimate, config, B, T, dtype, checkpoint_policy=policy)
            diff = est["total"] - measured
            if abs(diff) > ESTIMATE_ATOL_BYTES:
                raise AssertionError(
                    f"estimated total {est['total']} bytes with checkpoint_policy={policy!r} vs measured {measured} "
                    f"(L=3, B={B}, T={T}, {dtype}): off by {diff:+d} bytes, more than the {ESTIMATE_ATOL_BYTES} "
                    f"allowed. Checkpointed blocks keep only each segment's fp32 input (⌈L/k⌉ = {math.ceil(3 / k)} "
                    f"of {B * T * config.d_model * 4} bytes; yours: layers = {est.get('layers')}), and under autocast "
                    f"only the LM head's weight copy stays saved (yours: weight_copies = {est.get('weight_copies')}). "
                    f"See {SEC.format(6)} and {SEC.format(7)}.")


# ------------------------------------------------------------------------------------------------------
# §7 Checkpointing


def _check_policy(worker, policy, k: int) -> None:
    """Saved bytes drop to (what the blocks saved) replaced by (one input per segment); gradients unchanged."""
    L, B, T = 4, 2, 32
    plan = worker.call(_segments, L, policy)
    assert_equal(plan, [list(range(i, min(i + k, L))) for i in range(0, L, k)],
                 name=f"checkpoint_segments({L}, {policy!r}) (segments of k = {k} consecutive blocks)",
                 section=SEC.format(7))
    config = get_config("tiny", num_layers=L)
    base = TransformerLM(config)
    batch = _batch(config, B, T)
    # The uncheckpointed bytes are measured here, with the test's own hook; the worker measures the model the
    # implementation checkpointed with the same hook (the test used to measure all three with the
    # implementation's saved_activation_bytes, whose own test is test_saved_activation_bytes_small_graph).
    full = saved_bytes_independent(base, *batch, torch.float32)
    one_fewer = saved_bytes_independent(TransformerLM(config.with_(num_layers=L - 1)), *batch, torch.float32)
    block_bytes = full - one_fewer
    segment_input = B * T * config.d_model * 4
    expected = full - L * block_bytes + math.ceil(L / k) * segment_input
    got = worker.call(_checkpointed_saved_bytes, config, base.state_dict(), (B, T), policy)
    # Exact: every term of `expected` is a measurement of the same forward or a B·T·d fp32 segment input; only
    # 0-dim scalars could differ, so the same 16-byte slack as the estimate (ESTIMATE_ATOL_BYTES).
    assert_close(torch.tensor(float(got)), torch.tensor(float(expected)),
                 name=f"saved bytes with checkpoint policy {policy!r} (uncheckpointed: {full})",
                 section=SEC.format(7), rtol=0, atol=ESTIMATE_ATOL_BYTES)
    # Byte counts, not rounding: got equals expected to 16 B (just checked), so this ratio can fail only when the
    # check above passed on a tiny saving; 0.9 of the expected saving factor is a qualitative floor.
    assert full / got >= 0.9 * full / expected, f"checkpointing saved too little: {full} → {got} bytes"
    loss_ref, grads_ref = _grads_after_backward(copy.deepcopy(base), batch)
    loss, grads = worker.call(_checkpointed_grads, config, base.state_dict(), (B, T), policy)
    # Recomputation replays the same fp32 ops on the same inputs, so loss and gradients agree to rounding
    # (the backward may sum in another order): the loss, one mean, to rtol 1e-6 ≈ 8 ulps; the gradients to
    # rtol 1e-5 ≈ 80 ulps; atol 1e-6 for values near 0.
    assert_close(torch.tensor(loss), torch.tensor(loss_ref), name=f"loss with policy {policy!r} (the same function "
                 "as without checkpointing: every block of the segment runs, in order)",
                 section=SEC.format(7), rtol=1e-6, atol=1e-6)
    for name, g in grads_ref.items():
        assert grads[name] is not None, (
            f"parameter {name} got no gradient with checkpoint policy {policy!r}: its block never ran in the forward "
            f"(the segment's checkpointed forward must run every block of the segment, in order). See {SEC.format(7)}.")
        assert_close(grads[name], g, name=f"gradient of {name} with policy {policy!r}", section=SEC.format(7),
                     rtol=1e-5, atol=1e-6)


def _check_dropout_replayed(worker, policy) -> None:
    """Blocks with dropout, checkpointed as an nn.ModuleList: backward's recomputation must draw the same dropout
    masks as the forward did (torch.utils.checkpoint restores the RNG state), or the gradients are wrong."""
    torch.manual_seed(0)
    base = _dropout_blocks()
    x = torch.randn(8, 16)
    # Without checkpointing, here; checkpointed by the implementation, in the worker (same weights, same seed 1).
    blocks = copy.deepcopy(base)
    torch.manual_seed(1)
    h = x.clone().requires_grad_()
    for block in blocks:  # the caller runs the blocks in order, as TransformerLM does
        h = block(h)
    h.square().sum().backward()
    expected = {n: p.grad.clone() for n, p in blocks.named_parameters()}
    got = worker.call(_dropout_grads_checkpointed, base.state_dict(), x, policy)
    # Same fp32 ops on the same values if the masks are replayed: rtol 1e-5, atol 1e-6 allow reordering only; a
    # fresh mask zeroes a different half of the units, an O(1) change.
    for name, g in expected.items():
        assert_close(got[name], g, name=f"gradient of {name} in dropout blocks with policy {policy!r} (the "
                     "recomputation must replay the forward's dropout masks: keep checkpoint's RNG-state restore)",
                     section=SEC.format(7), rtol=1e-5, atol=1e-6)


@pytest.mark.points(3)
def test_checkpoint_every_block(worker) -> None:
    """Every block checkpointed: each block keeps only its input; gradients equal the uncheckpointed ones, also
    with dropout in the blocks."""
    _check_policy(worker, "every_block", 1)
    _check_dropout_replayed(worker, "every_block")


@pytest.mark.points(1)
def test_checkpoint_every_k_blocks(worker) -> None:
    """Segments of k blocks: the segment plan, a bad policy, and the saved bytes and gradients for k = 2."""
    assert_equal(worker.call(_segments, 5, 2), [[0, 1], [2, 3], [4]], name="checkpoint_segments(5, 2)",
                 section=SEC.format(7))
    assert_equal(worker.call(_segments, 3, "every_block"), [[0], [1], [2]],
                 name="checkpoint_segments(3, 'every_block')", section=SEC.format(7))
    assert_equal(worker.call(_segments, 3, "none", raw=True), [], name="checkpoint_segments(3, 'none')",
                 section=SEC.format(7))
    for bad in (0, -1, "sqrt"):
        assert_raised(worker.call(_segments_outcome, 4, bad), ValueError, "policy",
                      what=f"checkpoint_segments(4, {bad!r})", section=SEC.format(7))
    _check_policy(worker, 2, 2)
    _check_dropout_replayed(worker, 2)


# ------------------------------------------------------------------------------------------------------
# §8 On a GPU (checks, not graded)


@pytest.mark.gpu
def test_gpu_peak_memory_and_estimate(worker) -> None:
    """On CUDA: bf16 forward peaks below fp32; the estimate (device_type='cuda') matches the measurement."""
    got = worker.call(_gpu_peaks_and_estimates)
    config = get_config("mini")
    peaks = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        peaks[dtype] = got[name]["peak"]
        est = got[name]["estimate"]
        # Measured here, with the test's own hook on the kit's model (the saved bytes do not depend on the
        # weights). The test used to compare the estimate with the implementation's saved_activation_bytes; that
        # comparison is now two against this measurement: the estimate's, and the implementation's measurement's.
        torch.manual_seed(0)
        inputs, targets = (t.cuda() for t in _batch(config, 4, 128))
        measured = saved_bytes_independent(TransformerLM(config).cuda(), inputs, targets, dtype)
        # Not yet measured on a GPU at a tight tolerance: by handout 02 §6 the CUDA count differs from the CPU
        # one (exact to ESTIMATE_ATOL_BYTES above) only in the fp32 softmax. Until a GPU run confirms the count
        # is exact on CUDA too, 10% guards against gross errors only (a dropped softmax is ≈ 20% at T = 128).
        assert_close(torch.tensor(float(est["total"])), torch.tensor(float(measured)),
                     name=f"CUDA estimated total bytes ({dtype})", section=SEC.format(6), rtol=0.10, atol=0)
        # Two measurements of the same forward by the same rules should agree to ESTIMATE_ATOL_BYTES, as on the
        # CPU; until a GPU run confirms it on CUDA, the same 10% as the estimate.
        assert_close(torch.tensor(float(got[name]["measured"])), torch.tensor(float(measured)),
                     name=f"CUDA saved_activation_bytes of one forward + loss ({dtype})", section=SEC.format(6),
                     rtol=0.10, atol=0)
    assert peaks[torch.bfloat16] < peaks[torch.float32], peaks
