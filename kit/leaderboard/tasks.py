"""The leaderboard's tasks: what each fixes (model, global batch, ranks, optimizer, timing protocol), what a student
may choose, and the data every rank and the naive reference share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kit.model import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
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
