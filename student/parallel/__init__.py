# Given code — read, don't edit. Generated from the kit's reference by `make student`.
"""Stage 6 — a 4D device mesh: data × tensor × pipeline × expert parallelism (handout/06-4d-parallelism.md).

One module per idea:

* :mod:`.mesh` — the ``(pp, dp, ep, tp)`` device mesh and its process groups.
* :mod:`.tensor_parallel` — Megatron column/row-parallel linears and the f/g operators.
* :mod:`.pipeline_parallel` — stages, GPipe and 1F1B schedules with point-to-point send/recv.
* :mod:`.expert_parallel` — a mixture-of-experts feed-forward whose experts are sharded over ``ep``.
* :mod:`.train_4d` — composes all four (plus Stage 4's bucketed DDP over ``dp``) and trains.
* :mod:`.accounting` — memory per device and communication volume per step, on paper.
"""

from . import accounting, expert_parallel, mesh, pipeline_parallel, tensor_parallel, train_4d

__all__ = ["accounting", "expert_parallel", "mesh", "pipeline_parallel", "tensor_parallel", "train_4d"]
