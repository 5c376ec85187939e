"""The gate, in this process: the naive reference step, the tolerances derived from the dtypes, the comparison of
the ranks' records with the reference, and :func:`gate` itself (handout 07b §6)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kit.model import ModelConfig

from .steps import _gate_rank, impl_builder
from .tasks import SECTION, Task, batches, rows, step_config

# ----------------------------------------------------------------------------------------------------
# In this process: the naive reference, the tolerances, the comparison
# ----------------------------------------------------------------------------------------------------


def naive_reference(config: dict[str, Any], global_batches: list, *, shards: int = 1) -> dict:
    """The naive step in this process, one process on each whole global batch, in fp32: the same record as
    :func:`record_steps`, plus ``initial`` (the parameters before the first step). With ``shards > 1`` also
    ``shard_grads``: the gradient of each rank's rows alone, at the first step (to recognise a step whose
    gradients were never averaged over the ranks)."""
    import torch

    from kit.model import TransformerLM, cross_entropy

    def fresh() -> TransformerLM:
        torch.manual_seed(config.get("seed", 0))
        return TransformerLM(ModelConfig(**config["model"]))

    model = fresh()
    out: dict[str, Any] = {"losses": [], "initial": {n: p.detach().clone() for n, p in model.named_parameters()},
                           "tokens": global_batches[0][0].numel()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], betas=tuple(config["betas"]),
                                  eps=config["eps"], weight_decay=config["weight_decay"])
    for s, (x, y) in enumerate(global_batches):
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        loss = cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        out["losses"].append(float(loss.detach()))
        if s == 0:
            out["logit_rms"] = float(logits.detach().double().pow(2).mean().sqrt())  # sets the loss's tolerance
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    if shards > 1:
        x, y = global_batches[0]
        out["shard_grads"] = []
        for r in range(shards):
            model = fresh()
            cross_entropy(model(rows(x, r, shards)), rows(y, r, shards)).backward()
            out["shard_grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return out


UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8}


@dataclass(frozen=True)
class Tolerances:
    """How far a correct step may be from the naive fp32 step (see :func:`tolerances` for the derivation).

    Attributes:
        loss_atol: absolute error of the first step's loss; step s (0-based) is allowed ``(1 + s)`` times it.
        grad: error of a gradient element, relative to the largest |element| of its tensor.
        param_rounding: relative rounding of a stored parameter: fp32's unit roundoff, or for bf16 weights twice
            bf16's (the initial weights and the updated ones are both rounded to bf16).
        why: the derivation in one line, for messages and entry files.
    """

    loss_atol: float
    grad: float
    param_rounding: float
    why: str

    def as_dict(self) -> dict[str, Any]:
        return {"loss_atol": self.loss_atol, "grad": self.grad, "param_rounding": self.param_rounding,
                "why": self.why}


def tolerances(config: dict[str, Any], tokens: int, *, logit_rms: float, loss: float) -> Tolerances:
    """Tolerances for a step with ``config``'s dtype against the naive fp32 step, over ``tokens`` global tokens;
    ``logit_rms`` and ``loss`` are the naive step's first root-mean-square logit and loss (:func:`naive_reference`).

    Error model. A correct step differs from the naive one only in *where it rounds*: tiles, ranks, micro-batches,
    fused kernels, bf16 matmul inputs. Two sources, u the unit roundoff of a dtype (fp32 2⁻²⁴, bf16 2⁻⁸):

    * **rounded inputs**: every matmul input rounded to the compute dtype (bf16 under autocast or with bf16
      weights; fp32 otherwise) perturbs a value relatively by u_in, and a gradient passes through about
      ``c = 8·(L + 1)`` such roundings on its way back through L blocks and the head (≈ 8 matmuls and
      element-wise products a block, counted on the kit's block), so ≤ ``c·u_in`` of the tensor's largest element;
    * **accumulation**: fp32 sums of n terms in another order differ by ≈ √n·u₃₂ of the terms' magnitude (random
      rounding errors add like a random walk; the worst case n·u₃₂ is never approached by sums of mixed signs);
      the longest sum is over the ``tokens`` of the batch (weight gradients) or ``d_ff`` (the feed-forward), and
      each of the c steps adds one: ≤ ``c·√n·u₃₂``.

    So ``grad = c·(u_in + √n·u₃₂)``.

    The loss is derived from the forward alone, which passes through half of those roundings, ``c_f = c/2`` (each
    matmul's forward product; its two backward products are the rest). A token's loss lse − z_y moves by
    Σ_v (p_v − [v = y])·Δz_v, and Σ_v (p_v − [v = y])² ≤ 2, so a logit error of ``c_f·(u_in + √n·u₃₂)`` of the
    logits' size (their root mean square) moves it by at most √2 times that. Tokens' errors are independent and the
    loss is their mean: the standard deviation falls by √tokens, and ``k = 4`` deviations are allowed. Summing the
    tokens' fp32 losses in another order adds ≈ √tokens·u₃₂·|loss|. So
    ``loss_atol = 4·√2·c_f·(u_in + √n·u₃₂)·rms(z)/√tokens + √tokens·u₃₂·|loss|``. What it rejects: a loss rounded
    to bf16 (up to 2⁻⁹ of it, 0.2 %: on the Stage 7 test model 0.43 % where this allows 0.34 % and a correct
    bf16 step lands within 0.006 %). A parameter after the first AdamW step (m̂ = g, √v̂ = |g|) is
    ``p·(1 − lr·λ) − lr·g/(|g| + ε)``: where |g| exceeds the gradient's tolerance δ the update keeps its sign and
    moves by at most ``lr·δ·ε/(|g| − δ + ε)²``; where it does not, the sign may flip: up to 2·lr (see
    :func:`compare`). Then the stored weight is rounded (``param_rounding``).

    On the cpu task's gate instance (2 layers, 128 tokens) this allows 1.8·10⁻⁵ of a gradient's largest element
    in fp32 (measured with the reference's pieces: ≤ 6·10⁻⁷) and 9.4·10⁻² in bf16 (measured: ≤ 1.8·10⁻²); wrong
    steps (gradients summed over the ranks or never averaged, a micro-batch left out) are off by 10⁻¹ to 1.
    """
    model = ModelConfig(**config["model"]) if isinstance(config["model"], dict) else config["model"]
    dtype = config.get("dtype", "fp32")
    u_in = UNIT_ROUNDOFF["bf16" if dtype in ("bf16", "bf16_autocast") else "fp32"]
    c = 8 * (model.num_layers + 1)
    n = max(tokens, model.d_ff, model.d_model)
    per_rounding = u_in + math.sqrt(n) * UNIT_ROUNDOFF["fp32"]
    grad = c * per_rounding
    c_forward = c // 2
    loss_atol = (4 * math.sqrt(2) * c_forward * per_rounding * logit_rms / math.sqrt(tokens)
                 + math.sqrt(tokens) * UNIT_ROUNDOFF["fp32"] * abs(loss))
    rounding = 2 * UNIT_ROUNDOFF["bf16"] if dtype == "bf16" else UNIT_ROUNDOFF["fp32"]
    why = (f"dtype {dtype}: c = 8·(L+1) = {c} roundings, u_in = {u_in:.3g}, √n·u32 with n = {n}: gradient "
           f"{grad:.3g} of its tensor's max; loss from the forward's c/2 roundings of logits of rms {logit_rms:.3g} "
           f"over {tokens} tokens: {loss_atol:.3g}")
    return Tolerances(loss_atol=loss_atol, grad=grad, param_rounding=rounding, why=why)


def compare(records: list[dict], reference: dict, config: dict[str, Any], *, section: str = SECTION) -> list[str]:
    """What is wrong with the step's ``records`` (one per rank, from :func:`record_steps`) against the naive
    ``reference`` (:func:`naive_reference`): a list of teaching messages, empty when the step passes.

    Checked in this order, the most telling first (each message names the quantity, the tolerance and the worst
    element): rank 0's gradients after the first step (and whether they look unaveraged: equal to one rank's own
    gradient, or a multiple of the right one); rank 0's parameters after the first step; every rank's losses
    against the reference's over the k steps; every rank holds the same parameters.
    """
    import torch

    world = len(records)
    tol = tolerances(config, tokens=reference["tokens"], logit_rms=reference["logit_rms"],
                     loss=reference["losses"][0])
    failures: list[str] = []
    first = records[0]
    params, want_params, initial = first.get("params", {}), reference["params"], reference["initial"]
    shared = [n for n in initial if n in params and params[n].shape == initial[n].shape]
    if shared:  # AdamW's first step moves a weight by at most lr·(1 + λ|p|): far more means another start
        distance = torch.cat([(params[n].double() - initial[n].double()).abs().flatten() for n in shared]).median()
        if float(distance) > 20 * config["lr"]:
            failures.append(
                f"rank 0: after the first step the parameters are a median {float(distance):.3g} away from the seeded "
                f"initial weights, where one AdamW step moves each by at most about lr = {config['lr']:g}: the model "
                "did not start from TransformerLM(config.model) built right after torch.manual_seed(config.seed). "
                f"See {section}.")
    grads, want_grads = first.get("grads", {}), reference["grads"]
    missing = sorted(set(want_grads) - set(grads))
    if missing:
        failures.append(f"rank 0: no gradient after the first step for {missing[:4]}{' …' if len(missing) > 4 else ''} "
                        f"(every parameter of the kit's model gets one). See {section}.")
    for name in want_grads:
        if name not in grads:
            continue
        g, e = grads[name].double(), want_grads[name].double()
        if g.shape != e.shape:
            failures.append(f"rank 0: gradient of {name} has shape {tuple(g.shape)}, expected {tuple(e.shape)}. "
                            f"See {section}.")
            continue
        scale = float(e.abs().max()) or 1.0
        err = (g - e).abs()
        if not torch.isfinite(g).all() or float(err.max()) > tol.grad * scale:
            i = int(torch.nan_to_num(err, nan=math.inf).flatten().argmax())
            hint = _unaveraged_hint(g, reference, name, world, tol.grad * scale)
            # The hint first: a report keeps a message's first 500 characters, and the derivation is long.
            failures.append(
                f"rank 0: the gradient of {name} after the first step is off by {float(err.max()):.3g} at flat index "
                f"{i} (got {float(g.flatten()[i]):.6g}, expected {float(e.flatten()[i]):.6g}).{hint} Allowed "
                f"{tol.grad:.3g} × max|g| = {tol.grad * scale:.3g} ({tol.why}). See {section}.")
            break  # the first parameter off says enough; the rest follow from it
    for name in want_params:
        if name not in params or name not in want_grads:
            continue
        message = _param_mismatch(params[name], want_params[name], initial[name], want_grads[name], config, tol)
        if message:
            failures.append(f"rank 0: the parameter {name} after the first step {message} See {section}.")
            break
    for r, rec in enumerate(records):
        got, want = rec.get("losses", []), reference["losses"]
        if len(got) != len(want):
            failures.append(f"rank {r}: {len(got)} losses for {len(want)} steps. See {section}.")
            continue
        for s, (a, e) in enumerate(zip(got, want)):
            # Step s's loss rounds like the first (loss_atol) and starts from parameters that each earlier step's
            # rounded gradients moved a little; to first order those perturbations add: (1 + s)·loss_atol.
            allowed = tol.loss_atol * (1 + s)
            if not (math.isfinite(a) and abs(a - e) <= allowed):
                failures.append(
                    f"rank {r}: the loss of step {s + 1} is {a:.7g}, the naive step's {e:.7g}: |diff| "
                    f"{abs(a - e):.3g} > allowed {allowed:.3g}. The loss returned is the mean over the global "
                    "batch's tokens, the same on every rank; a loss rounded to bf16, or summed in bf16, is off by up "
                    f"to 0.4 %: sum the tokens' losses in fp32. Allowed: {tol.loss_atol:.3g} × {1 + s} ({tol.why}). "
                    f"See {section}.")
                break
        if any(f.startswith("rank ") and "the loss of step" in f for f in failures):
            break  # one rank's wrong loss says enough
    for r, rec in enumerate(records[1:], start=1):
        for name, p in rec.get("params", {}).items():
            if name in params and not torch.equal(p, params[name]):
                diff = float((p - params[name]).abs().max())
                failures.append(f"rank {r}: its parameter {name} differs from rank 0's by {diff:.3g} after the first "
                                f"step: the replicas must stay identical (every rank applies the same averaged "
                                f"gradient). See {section}.")
                break
    return failures


def _unaveraged_hint(g: Any, reference: dict, name: str, world: int, allowed: float) -> str:
    """A hint when rank 0's gradient is one rank's own (never averaged), or a multiple of the right one (a loss
    summed where it should be averaged: over the ranks, or over micro-batches)."""
    e = reference["grads"][name].double()
    ratio = float((g * e).sum() / (e * e).sum()) if float((e * e).sum()) > 0 else 1.0
    # A hint after the check failed, not a verdict: a least-squares scale ≥ 5 % from 1 (rounding errors of mixed
    # sign move a fit over the whole tensor far less than tol.grad), within 5 % of the world size for "summed".
    if math.isfinite(ratio) and abs(ratio - 1) > 0.05 and float((g - ratio * e).abs().max()) <= allowed * abs(ratio):
        which = (f"summed over the {world} ranks, not averaged across them (divide by the world size)"
                 if world > 1 and abs(ratio - world) < 0.05 else
                 "a loss summed where the mean belongs: over micro-batches, divide each one's loss by their number; "
                 "over ranks, divide the all-reduced sum by the world size")
        return f" It is {ratio:.3g}× the expected gradient everywhere: {which}."
    shards = reference.get("shard_grads")
    if not shards or world < 2:
        return ""
    own = shards[0][name].double()
    if float((g - own).abs().max()) <= allowed:
        return (" It equals the gradient of rank 0's own rows: the gradients were not averaged across the ranks "
                "(handout 04 §2).")
    return ""


# fp32 operations between a gradient and its AdamW update, in any order the handout allows (see _param_mismatch).
UPDATE_ROUNDINGS = 10


def _param_mismatch(p: Any, expected: Any, initial: Any, grad: Any, config: dict, tol: Tolerances) -> str:
    """'' when ``p`` (a parameter after the first step) is within the first-AdamW-step bound of :func:`tolerances`,
    else the rest of a sentence saying where it is not."""
    import torch

    lr, eps = config["lr"], config["eps"]
    p, e, g = p.double(), expected.double(), grad.double()
    if p.shape != e.shape:
        return f"has shape {tuple(p.shape)}, expected {tuple(e.shape)}."
    delta = tol.grad * float(g.abs().max())
    safe = g.abs() > delta
    margin = (g.abs() - delta).clamp_min(0) + eps
    sensitivity = torch.where(safe, lr * delta * eps / margin**2, torch.full_like(g, 2 * lr))
    # Rounding: p·(1 − lr·λ) and the subtraction of the update each round relative to the largest magnitude
    # involved (the initial weight, the result, lr), in the parameter's dtype. And the update lr·m̂/(√v̂ + ε) itself
    # (≤ lr at the first step) is computed in fp32 through at most UPDATE_ROUNDINGS operations in any order the
    # handout allows (m, v, two bias corrections, √, + ε, ÷, × lr, −): torch's folded form and the textbook m̂, v̂
    # form each round that many times, so the two differ by ≤ 2·UPDATE_ROUNDINGS·u₃₂·lr.
    update_rounding = 2 * UPDATE_ROUNDINGS * UNIT_ROUNDOFF["fp32"] * lr
    allowed = sensitivity + tol.param_rounding * 2 * (initial.double().abs() + e.abs() + lr) + update_rounding
    err = (p - e).abs()
    bad = ~(err <= allowed)
    if not bad.any():
        return ""
    i = int(torch.where(bad, err - allowed, torch.full_like(err, -math.inf)).flatten().argmax())
    moved = float((p - initial.double()).flatten()[i])
    want_moved = float((e - initial.double()).flatten()[i])
    return (f"is {float(p.flatten()[i]):.7g} at flat index {i}, expected {float(e.flatten()[i]):.7g} (|diff| "
            f"{float(err.flatten()[i]):.3g} > allowed {float(allowed.flatten()[i]):.3g}: {int(bad.sum())} of "
            f"{p.numel()} elements out). It moved by {moved:.3g} from its initial value where AdamW's first step "
            f"moves it by {want_moved:.3g} (weight decay, then lr·g/(|g| + eps) with bias correction).")

# ----------------------------------------------------------------------------------------------------
# The gate
# ----------------------------------------------------------------------------------------------------

@dataclass
class GateResult:
    """The gate's verdict: ``passed``, the failures' messages, the tolerances used, the losses compared."""

    passed: bool
    failures: list[str]
    tolerances: dict[str, Any]
    losses: list[float] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "failures": self.failures, "tolerances": self.tolerances,
                "losses": self.losses, "reference_losses": self.reference_losses, "seconds": round(self.seconds, 2)}


def gate(task: Task, options: dict[str, Any], builder: Callable[[dict, Any], Any] = impl_builder, *,
         timeout: float = 600.0) -> GateResult:
    """Run the step (``builder``) on the task's small instance in ``task.world`` ranks and compare it here with the
    naive step. A step that raises fails the gate with its error."""
    from kit.spawn import RankFailedError, RankTimeoutError, run_on_ranks

    start = time.perf_counter()
    config = step_config(task, options, gate=True)
    data = batches(config["model"], task.gate_batch, task.gate_steps)
    reference = naive_reference(config, data, shards=task.world)
    try:
        records = run_on_ranks(_gate_rank, task.world, args=(builder, config, data), timeout=timeout,
                               backend="nccl" if task.device == "cuda" else "gloo")
    except (RankFailedError, RankTimeoutError) as exc:
        return _verdict(task, config, reference, None, f"the step did not run: {str(exc)[:3000]}", start)
    return _verdict(task, config, reference, records, None, start)


def _verdict(task: Task, config: dict[str, Any], reference: dict, records: list[dict] | None, error: str | None,
             start: float) -> GateResult:
    """The gate's result from the ranks' ``records`` (or the ``error`` that stopped them) against ``reference``."""
    tol = tolerances(config, task.gate_batch * task.gate_model.context_length, logit_rms=reference["logit_rms"],
                     loss=reference["losses"][0])
    if records is None:
        return GateResult(False, [error or "the step did not run"], tol.as_dict(),
                          reference_losses=reference["losses"], seconds=time.perf_counter() - start)
    failures = compare(records, reference, config)
    return GateResult(not failures, failures, tol.as_dict(), losses=records[0]["losses"],
                      reference_losses=reference["losses"], seconds=time.perf_counter() - start)
