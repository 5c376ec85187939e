from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor


class FSDP(nn.Module):
    def __init__(self, module, *, compute_dtype=None, process_group=None, units=None, prefetch=1,
                 reshard_after_forward=True):
        _check_arguments(module, compute_dtype, prefetch, reshard_after_forward)
        is_unit = _unit_rule(units)
        super().__init__()
        self.module, self.process_group = module, process_group
        self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.compute_dtype, self.prefetch, self.reshard_after_forward = compute_dtype, prefetch, reshard_after_forward
        _broadcast_from_first_rank(module, process_group)
        unit_modules, inside = [], set()
        for name, mod in module.named_modules():
            if id(mod) in inside or not is_unit(mod) or not any(True for _ in mod.parameters()):
                continue
            inside.update(id(m) for m in mod.modules())
            unit_modules.append((name, mod))
        in_unit = {id(p) for _, m in unit_modules for p in m.parameters()}
        self.unit_names = [n for n, _ in unit_modules]
        self.unit_param_names = [[f"{n}.{pn}" if n else pn for pn, _ in m.named_parameters()] for n, m in unit_modules]
        self.unit_shapes = [[tuple(p.shape) for p in m.parameters()] for _, m in unit_modules]
        self.replicated_names = [n for n, p in module.named_parameters() if id(p) not in in_unit]
        self.replicated_shapes = [tuple(p.shape) for p in module.parameters() if id(p) not in in_unit]
        mesh = DeviceMesh.from_group(process_group or dist.group.WORLD, "cpu")
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        for _, mod in unit_modules:
            fully_shard(mod, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        pass

    def on_train_batch_start(self):
        pass

    @contextlib.contextmanager
    def no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    @torch.no_grad()
    def gather_full_params(self):
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in self.module.named_parameters()}

    def state_dict(self, *args, **kwargs):
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                for k, v in self.module.state_dict().items()}

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict=True):
        validate.instance("state_dict", state_dict, dict, "a dict of full tensors (from state_dict())")
        local = {}
        for k, v in self.module.state_dict().items():
            if k in state_dict:
                local[k] = distribute_tensor(state_dict[k], v.device_mesh, v.placements) if isinstance(v, DTensor) \
                    else state_dict[k]
        return self.module.load_state_dict(local, strict=strict)
