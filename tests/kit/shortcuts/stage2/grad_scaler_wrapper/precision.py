import torch


class DynamicLossScaler:
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        positive_number("init_scale", init_scale)
        number("growth_factor", growth_factor, above=1)
        number("backoff_factor", backoff_factor, above=0, below=1)
        positive_int("growth_interval", growth_interval)
        self._inner = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                                           backoff_factor=backoff_factor, growth_interval=growth_interval)

    def get_scale(self):
        return float(self._inner.get_scale())

    def scale(self, loss):
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a torch.Tensor, got {type(loss).__name__}")
        return self._inner.scale(loss)

    def unscale_(self, optimizer):
        if any(p.grad is not None and p.grad.dtype == torch.float16 for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("cannot unscale fp16 gradients: keep the parameters in fp32 (master weights)")
        self._inner.unscale_(optimizer)
        states = self._inner._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        return bool(sum(v.item() for v in states.values()))

    def step(self, optimizer, *args, **kwargs):
        return self._inner.step(optimizer, *args, **kwargs)

    def update(self):
        self._inner.update()

    def state_dict(self):
        return self._inner.state_dict()

    def load_state_dict(self, state_dict):
        self._inner.load_state_dict(state_dict)
