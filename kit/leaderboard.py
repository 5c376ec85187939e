"""The leaderboard: a whole training step, checked for correctness first, then timed (handout 07b §6–§7).

    python -m kit leaderboard --task cpu                     # your step (student/), 2 gloo ranks: an entry file
    python -m kit leaderboard --task cpu --set loss=fused    # one of your choices changed for this run
    python -m kit leaderboard --task cpu --step naive        # the kit's naive step: the baseline
    python -m kit leaderboard --collect entries/             # a folder of entries → a ranked table and a plot
    make leaderboard TASK=cpu [IMPL=reference] [STEP=naive]

**Tasks** (:data:`TASKS`) are fixed: the model, the global batch, the number of ranks, the optimizer's options
and the timing protocol. ``cpu`` runs on 2 gloo ranks in a couple of minutes on a 2-core laptop; ``gpu1`` is a
1.8 B-parameter model at 2 × 8192 tokens on one GPU; ``gpu2-8b`` is CS336's 2026 configuration (an 8 B model,
vocabulary 151,936, 2 × 32,768 tokens, bf16, two GPUs). What you choose is how the step is made — your
``leaderboard_options`` in ``student/whole_step/train_step.py`` (attention, loss, optimizer, dtype, micro-batches,
checkpointing), ``--set key=value`` to try one.

**The gate comes before any timing.** A fast wrong step gets no time. On a small instance of the task (the same
options, a small model, the same number of ranks), your step runs ``k`` steps in worker ranks
(:func:`kit.spawn.run_on_ranks`) and sends back data: each step's loss, the gradients after the first step, the
parameters after the first step. This process then computes the naive step itself — eager model, fp32, the loss
on full logits, ``torch.optim.AdamW``, one process on the global batch — and compares (:func:`compare`), with
tolerances derived from the dtypes (:func:`tolerances`). Nothing your code returns decides the verdict; it only
supplies the numbers the verdict is about.

**Timing** as CS336's: after the gate, the task's model is built, warmed up for ``warmup`` steps and timed for
``steps`` steps, each step the slowest rank's time (:func:`kit.bench.step_time`); the entry reports the median
and the spread (interquartile range, min, max), tokens/s of the global batch, MFU by the kit's FLOP convention
(:mod:`kit.flops`, on a GPU it knows) and peak memory. The whole run — gate included — must finish within a
wall-clock budget of 10 minutes from empty compilation caches (a fresh Triton cache), as CS336's.

**An entry** (JSON) carries the task, the options, the gate's verdict, the figures, the device and versions, a
SHA-256 of the implementation's ``.py`` files and a SHA-256 of the entry itself. ``--collect DIR`` ranks a
folder of entries by median step time per task, with the baselines (the naive step and the reference's best,
``benchmarks/results/leaderboard/``); an entry that failed its gate, ran over budget, was edited after it was
written, or whose files' hash does not match the code next to it (``DIR/<entry name>/``, when present) is
listed as such, unranked.

**Under torchrun** (``torchrun --nnodes 2 --nproc-per-node 1 … -m kit leaderboard --task cpu``; one torchrun per
node, as every distributed command: :mod:`kit.launch`) each process is one rank of the task: the task's ranks must
be torchrun's ``WORLD_SIZE`` (else a message naming both and exit status 2, before any rank waits for a peer).
Every process joins the process group once: the gate's ranks send their records to rank 0, which computes the naive
step and compares, and tells the others whether to time; the same ranks then time the task. Rank 0 alone prints
and writes the entry, stamped with the launch (``environment.launcher``). The trust is not the same: run alone, the
verdict is reached in this process, which never runs the implementation; under torchrun every process, rank 0
included, has imported the implementation, so an entry from torchrun is as trustworthy as the machines that ran it.
The gate still refuses a wrong step — an honest mistake gets no time either way — but a submission that tampers
with its own judge is only excluded when run alone.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import importlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kit.model import ModelConfig

ROOT = Path(__file__).resolve().parent.parent
BASELINES = ROOT / "benchmarks" / "results" / "leaderboard"
OUTPUT = ROOT / "leaderboard-output"
SECTION = "handout 07b §6"
FORMAT = 1  # the entry file's format version

# What a task fixes and a student may not change: the model, the seed and the optimizer's hyper-parameters
# (changing lr would change the answer). Everything else in StepConfig is the student's choice.
FIXED = ("model", "seed", "lr", "betas", "eps", "weight_decay", "device")
CHOICES = ("attention", "loss", "optimizer", "dtype", "micro_batches", "activation_checkpointing", "bucket_size_mb")
OPTIMIZER = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


@dataclass(frozen=True)
class Task:
    """A leaderboard task: what is timed, on what, and the small instance its gate checks.

    Attributes:
        name: ``cpu``, ``gpu1`` or ``gpu2-8b``.
        title: one line for the table.
        model: the timed model (sequence length = ``model.context_length``).
        batch: the global batch in sequences (split equally over the ranks).
        world: ranks (one per GPU on ``cuda``; gloo processes on ``cpu``).
        device: ``"cpu"`` or ``"cuda"``.
        warmup, steps: untimed then timed steps.
        gate_model, gate_batch, gate_steps: the gate's small instance (same options, same ranks).
        budget_s: the wall-clock budget of the whole run, gate included, from empty caches.
    """

    name: str
    title: str
    model: ModelConfig
    batch: int
    world: int
    device: str
    warmup: int
    steps: int
    gate_model: ModelConfig
    gate_batch: int
    gate_steps: int = 3
    budget_s: float = 600.0

    @property
    def tokens(self) -> int:
        """Tokens per step, the global batch."""
        return self.batch * self.model.context_length


# The gate's small instance for the GPU tasks: the head dimension of the big models (128), a vocabulary and a
# sequence that no kernel tile divides, two layers. Small enough that the fp32 reference runs on a CPU.
_GPU_GATE = ModelConfig(vocab_size=2000, context_length=200, d_model=256, d_ff=688, num_layers=2, num_heads=2)

TASKS: dict[str, Task] = {
    "cpu": Task(
        "cpu", "CPU, 2 gloo ranks: d 128, 4 layers, vocab 2048, 8 × 128 tokens, fp32 or bf16",
        ModelConfig(vocab_size=2048, context_length=128, d_model=128, d_ff=512, num_layers=4, num_heads=4),
        batch=8, world=2, device="cpu", warmup=3, steps=20,
        gate_model=ModelConfig(vocab_size=96, context_length=16, d_model=32, d_ff=64, num_layers=2, num_heads=2),
        gate_batch=8),
    "gpu1": Task(
        "gpu1", "one GPU: 1.8 B parameters (d 2048, 24 layers, vocab 151,936), 2 × 8192 tokens",
        ModelConfig(vocab_size=151_936, context_length=8192, d_model=2048, d_ff=5504, num_layers=24, num_heads=16),
        batch=2, world=1, device="cuda", warmup=3, steps=10, gate_model=_GPU_GATE, gate_batch=4),
    "gpu2-8b": Task(
        "gpu2-8b", "CS336 2026: 8 B (d 4096, d_ff 11008, 34 layers, 32 heads, vocab 151,936), 2 × 32768, 2 GPUs",
        ModelConfig(vocab_size=151_936, context_length=32_768, d_model=4096, d_ff=11_008, num_layers=34,
                    num_heads=32),
        batch=2, world=2, device="cuda", warmup=2, steps=8, gate_model=_GPU_GATE, gate_batch=4),
}


def get_task(name: str) -> Task:
    """The task named ``name``; ``ValueError`` listing the tasks otherwise."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name]


def hardware_problem(task: Task, launch: Any = None) -> str | None:
    """Why this machine cannot run ``task`` (``None`` when it can): a GPU task needs ``world`` CUDA GPUs, or under a
    launcher (``launch``, a :class:`kit.launch.Launch`) one for each of this node's ranks."""
    if task.device != "cuda":
        return None
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = task.world if launch is None else launch.local_world_size
    if have < need:
        return (f"task {task.name!r} needs {need} CUDA GPU(s){'' if launch is None else ' on this node'}; this "
                f"machine has {have}. Run --task cpu here, or this task on a machine with the GPUs (its figures are "
                "unmeasured until then)")
    return None


def check_launch(task: Task, launch: Any) -> None:
    """Under a launcher: raise :class:`kit.launch.LaunchError` unless it started exactly ``task.world`` ranks (the
    task fixes them). Checked from the environment alone, before any rank waits for a peer."""
    from kit.launch import LaunchError

    if launch is None or launch.world_size == task.world:
        return
    nodes = f"{launch.nodes} node(s) × " if launch.nodes else ""
    fits = sorted(name for name, t in TASKS.items() if t.world == launch.world_size)
    raise LaunchError(
        f"task {task.name!r} runs on {task.world} ranks (the task fixes them), but the launcher started "
        f"WORLD_SIZE={launch.world_size} ({nodes}{launch.local_world_size} per node; torchrun: --nnodes × "
        f"--nproc-per-node). Start {task.world} ranks in all"
        + (f", or run a task for {launch.world_size}: {', '.join(fits)}" if fits else ""))


def step_config(task: Task, options: dict[str, Any], *, gate: bool) -> dict[str, Any]:
    """The StepConfig fields (as data) of ``task`` with the student's ``options``: the task's model (or its gate
    model), seed 0, the fixed optimizer options, the task's device."""
    bad = sorted(set(options) - set(CHOICES))
    if bad:
        fixed = [k for k in bad if k in FIXED]
        why = f"{fixed} are fixed by the task" if fixed else f"the choices are {list(CHOICES)}"
        raise ValueError(f"options {bad} cannot be set: {why}")
    model = task.gate_model if gate else task.model
    return {"model": model.as_dict(), "seed": 0, **OPTIMIZER, "device": task.device, **options}


# ----------------------------------------------------------------------------------------------------
# The data every rank and the reference share
# ----------------------------------------------------------------------------------------------------


def batches(model: dict | ModelConfig, global_batch: int, steps: int, seed: int = 1000) -> list[tuple[Any, Any]]:
    """``steps`` global batches ``(inputs, targets)`` of ``global_batch`` random sequences (seeded: the same in
    every rank and in the reference)."""
    from kit.data import random_batch

    model = model if isinstance(model, ModelConfig) else ModelConfig(**model)
    return [random_batch(global_batch, model.context_length, model.vocab_size, seed=seed + s) for s in range(steps)]


def rows(t: Any, rank: int, world: int) -> Any:
    """This rank's equal share of the global batch's rows."""
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


# ----------------------------------------------------------------------------------------------------
# Steps: the implementation's, and the kit's naive one (module-level builders: ranks find them by name)
# ----------------------------------------------------------------------------------------------------


def impl_builder(config: dict[str, Any], world: Any) -> Any:
    """The implementation's ``build_train_step(StepConfig.from_dict(config), world=world)`` (``kit.impl``)."""
    from kit.impl import load

    module = importlib.import_module(f"{load().package}.whole_step.train_step")
    return module.build_train_step(module.StepConfig.from_dict(config), world=world)


def naive_builder(config: dict[str, Any], world: Any) -> NaiveStep:
    """The kit's naive step for ``config`` (its choices ignored): the leaderboard's baseline."""
    return NaiveStep(config, world)


class NaiveStep:
    """The naive step: eager ``TransformerLM`` in fp32 with the kit's attention, the loss on full logits in fp32,
    ``torch.optim.AdamW`` (its default for-each path), on several ranks torch's own ``DistributedDataParallel``.
    The same contract as a ``TrainStep``: ``step(inputs, targets) -> global mean loss``, ``.model``,
    ``.optimizer``, gradients left in ``.grad`` after a call."""

    def __init__(self, config: dict[str, Any], world: Any = None):
        import torch

        from kit.model import TransformerLM
        from kit.spawn import rank_device

        self.world = world
        self.device = rank_device() if config.get("device") == "cuda" else torch.device("cpu")
        torch.manual_seed(config.get("seed", 0))
        self.model = TransformerLM(ModelConfig(**config["model"])).to(self.device)
        self.net = self.model
        if world is not None:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.net = DistributedDataParallel(self.model, device_ids=ids, process_group=world)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config["lr"], betas=tuple(config["betas"]),
                                           eps=config["eps"], weight_decay=config["weight_decay"])

    def __call__(self, inputs: Any, targets: Any) -> float:
        import torch.distributed as dist

        from kit.model import cross_entropy

        self.optimizer.zero_grad(set_to_none=True)
        loss = cross_entropy(self.net(inputs.to(self.device)), targets.to(self.device))
        loss.backward()
        self.optimizer.step()
        total = loss.detach()
        if self.world is not None:
            dist.all_reduce(total, group=self.world)
            total = total / dist.get_world_size(self.world)
        return float(total)


# ----------------------------------------------------------------------------------------------------
# In the ranks: run the step, send back data
# ----------------------------------------------------------------------------------------------------


def record_steps(builder: Callable[[dict, Any], Any], config: dict[str, Any], global_batches: list) -> dict:
    """In a rank (or a single worker): build the step, run it on this rank's rows of each global batch, and return
    what the gate compares — each step's loss, every parameter's gradient and value after the first step (fp32
    copies on the CPU, by the kit's parameter names), and the names of the parameters without a gradient."""
    import torch
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    step = builder(config, dist.group.WORLD if distributed else None)
    out: dict[str, Any] = {"losses": []}
    for s, (x, y) in enumerate(global_batches):
        out["losses"].append(float(step(rows(x, rank, world), rows(y, rank, world))))
        if s == 0:
            named = list(step.model.named_parameters())
            out["grads"] = {n: p.grad.detach().to("cpu", torch.float32, copy=True) for n, p in named
                            if p.grad is not None}
            out["no_grad"] = [n for n, p in named if p.grad is None]
            out["params"] = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in named}
            out["dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for _, p in named})
    return out


def _options_rank(task: str, device: str) -> dict:
    """In a rank: the implementation's ``leaderboard_options(task, device)``."""
    from kit.impl import load

    module = importlib.import_module(f"{load().package}.whole_step.train_step")
    return dict(module.leaderboard_options(task, device))


def _gate_rank(builder: Callable[[dict, Any], Any], config: dict[str, Any], global_batches: list) -> dict:
    return record_steps(builder, config, global_batches)


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
        loss = cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        out["losses"].append(float(loss.detach()))
        if s == 0:
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
        loss_rtol: relative error of the first step's loss; step s (0-based) is allowed ``(1 + s)`` times it.
        grad: error of a gradient element, relative to the largest |element| of its tensor.
        param_rounding: relative rounding of a stored parameter: fp32's unit roundoff, or for bf16 weights twice
            bf16's (the initial weights and the updated ones are both rounded to bf16).
        why: the derivation in one line, for messages and entry files.
    """

    loss_rtol: float
    grad: float
    param_rounding: float
    why: str

    def as_dict(self) -> dict[str, Any]:
        return {"loss_rtol": self.loss_rtol, "grad": self.grad, "param_rounding": self.param_rounding,
                "why": self.why}


def tolerances(config: dict[str, Any], tokens: int) -> Tolerances:
    """Tolerances for a step with ``config``'s dtype against the naive fp32 step, over ``tokens`` global tokens.

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

    So ``grad = c·(u_in + √n·u₃₂)``. The loss is a mean over the tokens whose independent errors average:
    ``loss_rtol = grad / √tokens``. A parameter after the first AdamW step (m̂ = g, √v̂ = |g|) is
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
    grad = c * (u_in + math.sqrt(n) * UNIT_ROUNDOFF["fp32"])
    rounding = 2 * UNIT_ROUNDOFF["bf16"] if dtype == "bf16" else UNIT_ROUNDOFF["fp32"]
    why = (f"dtype {dtype}: c = 8·(L+1) = {c} roundings, u_in = {u_in:.3g}, √n·u32 with n = {n}: gradient "
           f"{grad:.3g} of its tensor's max, loss {grad / math.sqrt(tokens):.3g} relative")
    return Tolerances(loss_rtol=grad / math.sqrt(tokens), grad=grad, param_rounding=rounding, why=why)


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
    tol = tolerances(config, tokens=reference["tokens"])
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
            failures.append(
                f"rank 0: the gradient of {name} after the first step is off by {float(err.max()):.3g} at flat index "
                f"{i} (got {float(g.flatten()[i]):.6g}, expected {float(e.flatten()[i]):.6g}); allowed "
                f"{tol.grad:.3g} × max|g| = {tol.grad * scale:.3g} ({tol.why}).{hint} See {section}.")
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
            # Step s's loss rounds like the first (loss_rtol) and starts from parameters that each earlier step's
            # rounded gradients moved a little; to first order those perturbations add: (1 + s)·loss_rtol.
            allowed = tol.loss_rtol * (1 + s) * abs(e)
            if not (math.isfinite(a) and abs(a - e) <= allowed):
                failures.append(
                    f"rank {r}: the loss of step {s + 1} is {a:.7g}, the naive step's {e:.7g}: |diff| "
                    f"{abs(a - e):.3g} > allowed {allowed:.3g} ({tol.loss_rtol:.3g} relative × {1 + s}; {tol.why}). "
                    "The loss returned is "
                    f"the mean over the global batch's tokens, the same on every rank. See {section}.")
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
# The gate, and the timing
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
    tol = tolerances(config, task.gate_batch * task.gate_model.context_length)
    if records is None:
        return GateResult(False, [error or "the step did not run"], tol.as_dict(),
                          reference_losses=reference["losses"], seconds=time.perf_counter() - start)
    failures = compare(records, reference, config)
    return GateResult(not failures, failures, tol.as_dict(), losses=records[0]["losses"],
                      reference_losses=reference["losses"], seconds=time.perf_counter() - start)


def _launched_rank(task: Task, options: dict[str, Any], builder: Callable[[dict, Any], Any],
                   log: Callable[[str], None]) -> tuple[GateResult, dict | None]:
    """Under a launcher, in every rank (the process group joined once, by :func:`kit.launch.on_ranks`): the gate,
    then — if rank 0's verdict lets it through — the timing. Returns ``(verdict, this rank's timing or None)``.

    The gate's records go to rank 0, which computes the naive step and compares (:func:`gate`'s work, done in a
    rank: there is no other process), then broadcasts its verdict so that every rank times or none does. A step
    that raises on every rank (a stub, a bad option) fails the gate with its message; one that raises on some
    ranks only, mid-collective, leaves its peers waiting until torchrun stops them."""
    import traceback

    import torch.distributed as dist

    start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    config = step_config(task, options, gate=True)
    data = batches(config["model"], task.gate_batch, task.gate_steps)
    try:
        record: dict[str, Any] = record_steps(builder, config, data)
    except Exception as exc:  # noqa: BLE001 — the student's step failing is a verdict, not a crash
        record = {"error": f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"}
    records: list[Any] = [None] * world
    dist.all_gather_object(records, record)
    verdict: list[Any] = [None]
    if rank == 0:
        reference = naive_reference(config, data, shards=world)
        errors = [r["error"] for r in records if "error" in r]
        verdict[0] = (_verdict(task, config, reference, None, f"the step did not run: {errors[0][:3000]}", start)
                      if errors else _verdict(task, config, reference, records, None, start))
    dist.broadcast_object_list(verdict, src=0)
    result: GateResult = verdict[0]
    if not result.passed:
        return result, None
    log(f"gate passed in {result.seconds:.1f} s; timing {task.warmup} warm-up + {task.steps} steps")
    try:
        timing = _time_rank(builder, step_config(task, options, gate=False), task)
    except Exception as exc:  # noqa: BLE001 — idem: an entry that says why it has no time
        timing = {"error": f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"}
    return result, timing


def _time_rank(builder: Callable[[dict, Any], Any], config: dict[str, Any], task: Task) -> dict:
    """In a rank: build the task's step, warm up, time ``task.steps`` steps (the slowest rank's time each)."""
    import resource

    import torch
    import torch.distributed as dist

    from kit.bench import step_time

    rank, world = dist.get_rank(), dist.get_world_size()
    step = builder(config, dist.group.WORLD)
    cuda = config.get("device") == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    data = batches(config["model"], task.batch, 1, seed=7)[0]
    x, y = rows(data[0], rank, world), rows(data[1], rank, world)
    losses = [step(x, y) for _ in range(task.warmup)]
    times = [step_time(lambda: losses.append(step(x, y))) for _ in range(task.steps)]
    if cuda:
        peak, kind = torch.cuda.max_memory_allocated() / 2**20, "torch.cuda.max_memory_allocated"
    else:
        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "max RSS of the rank (torch included)"
    return {"times": times, "peak_mib": peak, "memory_kind": kind, "losses": losses,
            "device_name": torch.cuda.get_device_name() if cuda else "CPU"}


def _spread(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return {"median_s": statistics.median(times), "iqr_s": q[2] - q[0], "min_s": min(times), "max_s": max(times)}


# ----------------------------------------------------------------------------------------------------
# Entries
# ----------------------------------------------------------------------------------------------------


def files_hash(folder: Path) -> dict[str, Any]:
    """SHA-256 over the ``.py`` files under ``folder`` (relative path and bytes of each, sorted), and their count."""
    h = hashlib.sha256()
    paths = sorted(p for p in Path(folder).rglob("*.py") if "__pycache__" not in p.parts)
    for p in paths:
        h.update(p.relative_to(folder).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return {"sha256": h.hexdigest(), "count": len(paths)}


def entry_hash(entry: dict[str, Any]) -> str:
    """SHA-256 of an entry's content without its own ``entry_sha256`` (canonical JSON)."""
    body = {k: v for k, v in entry.items() if k != "entry_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def run_entry(task: Task, *, kind: str = "student", options: dict[str, Any] | None = None,
              builder: Callable[[dict, Any], Any] = impl_builder, name: str | None = None,
              code: Path | None = None, warmup: int | None = None, steps: int | None = None,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Gate, then time, ``task`` with ``options``; return the entry (not yet written). ``kind`` is ``student``,
    ``reference`` or ``naive``; ``code`` the folder whose ``.py`` files are hashed.

    Alone, the gate's and the timing's ranks are spawned here. Under a launcher this process is one of the ranks
    (:func:`_launched_rank`, one process group for both); every rank returns the entry, with rank 0's verdict,
    and only rank 0 logs (and, in :func:`main`, writes it)."""
    from kit.flops import peak_flops, transformer_flops
    from kit.launch import describe, is_main, launched, on_ranks
    from kit.results import environment
    from kit.spawn import RankFailedError, RankTimeoutError, run_on_ranks

    launch = launched()
    if launch is not None and not is_main():
        log = _silent

    options = dict(options or {})
    if warmup is not None or steps is not None:
        task = Task(**{**task.__dict__, "warmup": task.warmup if warmup is None else warmup,
                       "steps": task.steps if steps is None else steps})
    start = time.perf_counter()
    entry: dict[str, Any] = {"format": FORMAT, "task": task.name, "kind": kind, "name": name or kind,
                             "options": options, "config": step_config(task, options, gate=False),
                             "ranks": task.world, "global_batch": task.batch,
                             "threads_per_rank": 1 if task.device == "cpu" else None}
    with _empty_compile_caches():
        log(f"gate: {task.gate_steps} steps of the small instance on {task.world} rank(s), against the naive step")
        if launch is None:
            result = gate(task, options, builder, timeout=task.budget_s)
        else:
            ranks = on_ranks(_launched_rank, task.world, args=(task, options, builder, log),
                             backend="nccl" if task.device == "cuda" else "gloo", what=f"leaderboard task {task.name}")
            result = ranks[0][0]
        entry["gate"] = result.as_dict()
        if not result.passed:
            log("gate FAILED — no timing:\n  " + "\n  ".join(result.failures))
        elif launch is not None:  # timed already, in the same process group
            timings = [timing for _, timing in ranks]
            timing = next((t for t in timings if "error" in t), timings[0])
        else:
            log(f"gate passed in {result.seconds:.1f} s; timing {task.warmup} warm-up + {task.steps} steps")
            left = task.budget_s - (time.perf_counter() - start)
            try:
                timing = run_on_ranks(_time_rank, task.world, args=(builder, entry["config"], task),
                                      timeout=max(left, 1.0), backend="nccl" if task.device == "cuda" else "gloo")[0]
            except RankTimeoutError as exc:
                timing = {"error": f"over the {task.budget_s:.0f} s budget: {str(exc)[:1500]}"}
            except RankFailedError as exc:
                timing = {"error": str(exc)[:3000]}
        if result.passed:
            if "error" in timing:
                entry["timing"] = timing
                log(f"timing failed: {timing['error'][:500]}")
            else:
                spread = _spread(timing["times"])
                flops = transformer_flops(task.model, task.batch, task.model.context_length, "train_step")
                dtype = "bf16" if options.get("dtype", "fp32") != "fp32" else "fp32"
                peak = peak_flops(timing["device_name"], dtype) if task.device == "cuda" else None
                entry["timing"] = {"warmup": task.warmup, "steps": task.steps, "times_s": timing["times"], **spread,
                                   "tokens_per_s": task.tokens / spread["median_s"],
                                   "model_tflop_per_step": flops / 1e12,
                                   "mfu": (flops / spread["median_s"] / (peak * task.world)) if peak else None,
                                   "peak_memory_mib": timing["peak_mib"], "memory_kind": timing["memory_kind"]}
    wall = time.perf_counter() - start
    entry["wall_s"] = round(wall, 1)
    entry["budget_s"] = task.budget_s
    entry["within_budget"] = wall <= task.budget_s and "error" not in entry.get("timing", {})
    # Under torchrun the command line alone does not say how many processes, on how many machines, ran it.
    entry["environment"] = environment(impl=kind, **({} if launch is None else {"launcher": describe(launch)}))
    if code is not None:
        entry["files"] = {"root": code.name, **files_hash(code)}
    entry["entry_sha256"] = entry_hash(entry)
    return entry


def _silent(_: str) -> None:
    """The log of a rank other than 0 under a launcher: rank 0 speaks for the job."""


@contextlib.contextmanager
def _empty_compile_caches():
    """Fresh, empty Triton and Inductor caches for the run (inherited by the ranks): compilation counts against
    the budget, as it would on a fresh machine."""
    keys = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
    saved = {k: os.environ.get(k) for k in keys}
    with tempfile.TemporaryDirectory(prefix="leaderboard-caches-") as tmp:
        for k in keys:
            os.environ[k] = str(Path(tmp) / k.lower())
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def write_entry(entry: dict[str, Any], out: Path) -> Path:
    """Write ``entry`` as ``<task>-<name>-<UTC time>.json`` into ``out``; returns the path."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    path = out / f"{entry['task']}-{_slug(entry['name'])}-{stamp}.json"
    path.write_text(json.dumps(entry, indent=2, default=str) + "\n")
    return path


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in str(text))[:40] or "entry"


# ----------------------------------------------------------------------------------------------------
# --collect: a folder of entries → a ranked table and a plot
# ----------------------------------------------------------------------------------------------------


def entry_status(entry: dict[str, Any], path: Path) -> str:
    """``ok``, or why the entry is not ranked: ``edited`` (its own hash does not match), ``failed gate``,
    ``no timing``, ``over budget``, ``hash mismatch`` (the code next to it, ``<folder>/<entry stem>/``, hashes
    differently); ``ok (code not checked)`` when there is no code next to it."""
    if entry.get("entry_sha256") != entry_hash(entry):
        return "edited"
    if not entry.get("gate", {}).get("passed"):
        return "failed gate"
    timing = entry.get("timing", {})
    if "median_s" not in timing:
        return "no timing"
    if not entry.get("within_budget"):
        return "over budget"
    code = path.with_suffix("")
    if code.is_dir():
        root = code / entry.get("files", {}).get("root", "student")
        found = files_hash(root if root.is_dir() else code)
        return "ok" if found["sha256"] == entry.get("files", {}).get("sha256") else "hash mismatch"
    return "ok (code not checked)" if entry.get("kind") == "student" else "ok"


def collect(folder: Path, *, baselines: Path | None = BASELINES, out: Path | None = None) -> dict[str, Path]:
    """Rank the entries in ``folder`` (and the baselines) per task; write ``leaderboard.md`` and ``leaderboard.png``
    into ``out`` (default ``folder``) and return their paths."""
    rows: list[dict[str, Any]] = []
    sources = [(p, False) for p in sorted(Path(folder).glob("*.json"))]
    if baselines is not None and Path(baselines).is_dir() and Path(baselines).resolve() != Path(folder).resolve():
        sources += [(p, True) for p in sorted(Path(baselines).glob("*.json"))]
    for path, baseline in sources:
        try:
            entry = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            rows.append({"task": "?", "name": path.name, "status": f"unreadable ({exc.__class__.__name__})"})
            continue
        if not isinstance(entry, dict) or entry.get("format") != FORMAT:
            rows.append({"task": "?", "name": path.name, "status": "not an entry"})
            continue
        timing = entry.get("timing", {})
        rows.append({
            "task": entry.get("task", "?"), "name": entry.get("name", path.stem), "path": path,
            "kind": ("baseline: " if baseline else "") + str(entry.get("kind", "?")),
            "status": entry_status(entry, path), "median_s": timing.get("median_s"), "iqr_s": timing.get("iqr_s"),
            "tokens_per_s": timing.get("tokens_per_s"), "mfu": timing.get("mfu"),
            "peak_memory_mib": timing.get("peak_memory_mib"),
            "options": ", ".join(f"{k}={v}" for k, v in sorted(entry.get("options", {}).items())),
            "device": entry.get("environment", {}).get("device", "?"), "date": entry.get("environment", {}).get("date"),
        })
    out = Path(out or folder)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Leaderboard — {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M UTC}", ""]
    for task in sorted({r["task"] for r in rows}):
        mine = [r for r in rows if r["task"] == task]
        ranked = sorted((r for r in mine if str(r["status"]).startswith("ok")), key=lambda r: r["median_s"])
        others = [r for r in mine if not str(r["status"]).startswith("ok")]
        title = TASKS[task].title if task in TASKS else task
        lines += [f"## {task}: {title}", "",
                  "| rank | name | kind | median step (s) | IQR (s) | tokens/s | MFU | peak MiB | options | device "
                  "| status |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for i, r in enumerate(ranked, 1):
            lines.append(f"| {i} | {r['name']} | {r['kind']} | {r['median_s']:.4g} | {_fmt(r['iqr_s'])} | "
                         f"{_fmt(r['tokens_per_s'], '.4g')} | {_fmt(r['mfu'], '.1%')} | "
                         f"{_fmt(r['peak_memory_mib'], '.0f')} | {r['options']} | {r['device']} | {r['status']} |")
        for r in others:
            lines.append(f"| — | {r['name']} | {r.get('kind', '?')} | {_fmt(r.get('median_s'))} | | | | | "
                         f"{r.get('options', '')} | {r.get('device', '')} | **{r['status']}** |")
        lines.append("")
    table = out / "leaderboard.md"
    table.write_text("\n".join(lines) + "\n")
    plot = out / "leaderboard.png"
    _plot(rows, plot)
    return {"md": table, "png": plot}


def _fmt(value: Any, spec: str = ".3g") -> str:
    return "" if value is None else format(value, spec)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Median step time (bar) with the interquartile range (error bar) of each ranked entry, one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows if str(r["status"]).startswith("ok")}) or ["(no ranked entries)"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        ranked = sorted((r for r in rows if r["task"] == task and str(r["status"]).startswith("ok")),
                        key=lambda r: r["median_s"])
        names = [r["name"] for r in ranked]
        colors = ["tab:gray" if r["kind"].startswith("baseline") else "tab:blue" for r in ranked]
        ax.barh(names, [r["median_s"] for r in ranked], xerr=[(r["iqr_s"] or 0) / 2 for r in ranked],
                color=colors)
        ax.invert_yaxis()
        ax.set_xlabel("median step time (s); grey: baselines")
        ax.set_title(task)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------


def _parse_sets(pairs: list[str]) -> dict[str, Any]:
    """``["loss=fused", "micro_batches=2"]`` → ``{"loss": "fused", "micro_batches": 2}`` (JSON values where they
    parse, strings otherwise)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--set takes key=value, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    from kit.launch import exit_on_launch_error

    with exit_on_launch_error("leaderboard"):  # a wrong launch: a message and exit status 2 on every rank
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(prog="python -m kit leaderboard", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="cpu", help=f"one of {sorted(TASKS)} (default cpu)")
    p.add_argument("--step", choices=("impl", "naive"), default="impl",
                   help="impl: the implementation's build_train_step (default); naive: the kit's naive step")
    p.add_argument("--impl", choices=("student", "reference"), default=None,
                   help="which implementation (default: $LLMSYS_IMPL, else student)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override one of your leaderboard_options ({', '.join(CHOICES)})")
    p.add_argument("--name", default=None, help="the entry's name in the table (default: the implementation's)")
    p.add_argument("--out", type=Path, default=None, help=f"folder for the entry (default {OUTPUT.name}/)")
    p.add_argument("--warmup", type=int, default=None, help="override the task's warm-up steps (not for entries "
                   "you submit)")
    p.add_argument("--steps", type=int, default=None, help="override the task's timed steps (idem)")
    p.add_argument("--collect", type=Path, default=None, metavar="DIR", help="rank the entries in DIR instead")
    p.add_argument("--baselines", type=Path, default=BASELINES, help="baseline entries added to --collect's table")
    args = p.parse_args(argv)
    if args.collect is not None:
        if not args.collect.is_dir():
            p.error(f"--collect {args.collect}: not a folder")
        paths = collect(args.collect, baselines=args.baselines, out=args.out)
        print(paths["md"].read_text())
        print(f"wrote {paths['md']} and {paths['png']}")
        return 0
    from kit.impl import ENV_VAR, selected
    from kit.launch import is_main, launched
    from kit.spawn import run_on_ranks

    try:
        task = get_task(args.task)
        sets = _parse_sets(args.set)
    except ValueError as exc:
        p.error(str(exc))
    launch = launched()  # under torchrun: this process is one rank; checked before any rank waits for a peer
    check_launch(task, launch)
    problem = hardware_problem(task, launch)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    impl = selected(args.impl)
    os.environ[ENV_VAR] = impl  # the ranks load the same implementation
    if args.step == "naive":
        kind, builder, options, code = "naive", naive_builder, {}, None
    else:
        kind = "reference" if impl == "reference" else "student"
        builder = impl_builder
        # Your leaderboard_options, read in a worker rank: this process never runs the implementation. Under a
        # launcher it is one of the ranks, which run the implementation anyway (see the module's docstring).
        mine = (_options_rank(task.name, task.device) if launch is not None else
                run_on_ranks(_options_rank, 1, args=(task.name, task.device), timeout=120)[0])
        options = {**mine, **sets}
        code = ROOT / impl
    try:
        step_config(task, options, gate=False)
    except ValueError as exc:
        p.error(str(exc))
    log_name = args.name or ("naive" if kind == "naive" else impl)
    main_rank = is_main()  # alone, or rank 0 under torchrun: the one that prints and writes the entry
    if main_rank:
        print(f"leaderboard task {task.name}: {task.title}\n{kind} step, options {options}")
    entry = run_entry(task, kind=kind, options=options, builder=builder, name=log_name, code=code,
                      warmup=args.warmup, steps=args.steps)
    passed = entry["gate"]["passed"] and entry["within_budget"]
    if not main_rank:
        return 0 if passed else 1
    path = write_entry(entry, args.out or OUTPUT)
    timing = entry.get("timing", {})
    if "median_s" in timing:
        mfu = f", MFU {timing['mfu']:.1%}" if timing.get("mfu") else ""
        print(f"median step {timing['median_s']:.4g} s (IQR {timing['iqr_s']:.3g} s, {timing['steps']} steps), "
              f"{timing['tokens_per_s']:.4g} tokens/s{mfu}, peak {timing['peak_memory_mib']:.0f} MiB "
              f"({timing['memory_kind']}); wall {entry['wall_s']} s of {task.budget_s:.0f}")
    print(f"wrote {path}")
    return 0 if entry["gate"]["passed"] and entry["within_budget"] else 1
