"""The steps a task runs: the implementation's (``build_train_step``) and the kit's naive one, and what a rank sends
back for the gate (module-level functions: ranks find them by name)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kit.model import ModelConfig

from .tasks import rows

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
