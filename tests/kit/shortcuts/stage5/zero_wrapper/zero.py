import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

ADDS = ("ShardedOptimizer.zero_grad",)


class ShardedOptimizer(Optimizer):
    def __init__(self, params, optimizer_cls, *, process_group=None, **kwargs):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors or of param-group dicts, got a single tensor")
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        tensors = [t for g in groups for t in _tensors_in(g)]
        if not tensors:
            raise ValueError("params is empty: ShardedOptimizer needs at least one parameter to optimize")
        _reject_repeats(tensors)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ShardedOptimizer needs an initialised process group")
        self._zero = ZeroRedundancyOptimizer(params, optimizer_cls, process_group=process_group, **kwargs)
        self.defaults = self._zero.defaults
        self.param_groups = self._zero.param_groups
        self.rank = self._zero.rank
        self.local_optimizer = self._zero.optim
        self.state = self.local_optimizer.state

    def owner_of(self, param):
        try:
            return self._zero._param_to_rank[param]
        except KeyError:
            raise ValueError("owner_of: this tensor is not a parameter of the optimizer") from None

    def add_param_group(self, param_group):
        already = [p for g in self.param_groups for p in g["params"]]
        _reject_repeats(_tensors_in(param_group), already=already)
        self._zero.add_param_group(param_group)

    def step(self, closure=None):
        return self._zero.step(closure)

    def zero_grad(self, set_to_none=True):
        self._zero.zero_grad(set_to_none)

    def state_dict(self):
        self._zero.consolidate_state_dict(to=0)
        return self._zero.state_dict() if self.rank == 0 else None

    def load_state_dict(self, state_dict):
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError("state_dict has another number of param groups")
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("state_dict param group has another number of parameters")
        self.local_optimizer.state.clear()
        self._zero.load_state_dict({"state": dict(state_dict["state"]), "param_groups": state_dict["param_groups"]})
        self.param_groups = self._zero.param_groups
        self.state = self.local_optimizer.state
