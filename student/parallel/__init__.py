# Given code — read, don't edit. Generated from the kit's reference by `make student`.
"""Stage 6 — a 4D device mesh: data × tensor × pipeline × expert parallelism (handout/06-4d-parallelism.md).

One module per idea:

* :mod:`.mesh` — the ``(pp, dp, ep, tp)`` device mesh and its process groups.
* :mod:`.tensor_parallel` — Megatron column/row-parallel linears and the f/g operators.
* :mod:`.pipeline_parallel` — stages, GPipe and 1F1B schedules with point-to-point send/recv.
* :mod:`.expert_parallel` — a mixture-of-experts feed-forward whose experts are sharded over ``ep``.
* :mod:`.train_4d` — composes all four (plus Stage 4's bucketed DDP over ``dp``) and trains.
* :mod:`.accounting` — memory per device and communication volume per step, on paper.
* :mod:`.context_parallel` — part 2 (handout/06b-context-parallel.md): the sequence split over ``cp`` ranks,
  ring attention on the Stage 3 FlashAttention, zig-zag load balance for causal masks.
"""

from . import context_parallel, expert_parallel, mesh, pipeline_parallel, tensor_parallel

__all__ = ["accounting", "context_parallel", "expert_parallel", "mesh", "pipeline_parallel", "tensor_parallel",
           "train_4d"]


def __getattr__(name: str):
    # train_4d (and accounting, which imports it) are imported on first use, not here: `python -m
    # <package>.parallel.train_4d` (torchrun, SLURM) then runs it once, as __main__, instead of importing a second
    # copy first (runpy's RuntimeWarning on every rank).
    if name in ("accounting", "train_4d"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
