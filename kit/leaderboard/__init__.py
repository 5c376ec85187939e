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

from .cli import main
from .entries import collect, entry_hash, entry_status, files_hash, write_entry
from .gate import UNIT_ROUNDOFF, UPDATE_ROUNDINGS, GateResult, Tolerances, compare, gate, naive_reference, tolerances
from .steps import NaiveStep, impl_builder, naive_builder, record_steps
from .tasks import (
    BASELINES,
    CHOICES,
    FIXED,
    FORMAT,
    OPTIMIZER,
    OUTPUT,
    ROOT,
    SECTION,
    TASKS,
    Task,
    batches,
    check_launch,
    get_task,
    hardware_problem,
    rows,
    step_config,
)
from .timing import run_entry

__all__ = [
    "BASELINES", "CHOICES", "FIXED", "FORMAT", "OPTIMIZER", "OUTPUT", "ROOT", "SECTION", "TASKS", "UNIT_ROUNDOFF",
    "UPDATE_ROUNDINGS", "GateResult", "NaiveStep", "Task", "Tolerances", "batches", "check_launch", "collect",
    "compare", "entry_hash", "entry_status", "files_hash", "gate", "get_task", "hardware_problem", "impl_builder",
    "main", "naive_builder", "naive_reference", "record_steps", "rows", "run_entry", "step_config", "tolerances",
    "write_entry",
]
