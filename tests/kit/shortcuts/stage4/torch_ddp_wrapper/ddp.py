from torch.nn.parallel import DistributedDataParallel


class DataParallelBase(nn.Module, abc.ABC):
    def __init__(self, module: nn.Module, *, process_group: Any = None):
        _check_module(module)
        if not dist.is_initialized():
            raise RuntimeError("DDP needs an initialised process group")
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.require_backward_grad_sync = True
        self._sync_this_step = True
        verify_same_model(module, process_group)
        broadcast_module_states(module, process_group)  # buffers once, not at every forward
        # torch's DDP broadcasts the group's first rank's state and then does all the gradient work itself.
        self._torch_ddp = DistributedDataParallel(
            module, process_group=process_group, bucket_cap_mb=self._bucket_cap_mb(),
            find_unused_parameters=True, broadcast_buffers=False)

    def _bucket_cap_mb(self) -> float:
        return 25.0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._sync_this_step = self.require_backward_grad_sync
        self._torch_ddp.require_backward_grad_sync = self.require_backward_grad_sync
        return self._torch_ddp(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """torch's reducer has averaged every gradient by the time backward returns."""


class NaiveDDP(DataParallelBase):
    def finish_gradient_synchronization(self) -> None:
        pass


class FlatDDP(DataParallelBase):
    def finish_gradient_synchronization(self) -> None:
        pass


class DDPIndividualParameters(DataParallelBase):
    def __init__(self, module: nn.Module, *, process_group: Any = None):
        super().__init__(module, process_group=process_group)

    def _bucket_cap_mb(self) -> float:
        return 1e-9  # every parameter in a bucket of its own: one all-reduce per parameter

    def on_train_batch_start(self) -> None:
        pass

    def finish_gradient_synchronization(self) -> None:
        pass


class DDPBucketed(DataParallelBase):
    def __init__(self, module: nn.Module, bucket_size_mb: float | None = 25.0, *, process_group: Any = None):
        _check_module(module)
        assign_buckets([], bucket_size_mb)
        self.bucket_size_mb = bucket_size_mb
        super().__init__(module, process_group=process_group)
        named = trainable_parameters(self.module)
        index_buckets = assign_buckets([p for _, p in named], bucket_size_mb)
        self.bucket_names = [[named[i][0] for i in b] for b in index_buckets]
        self.bucket_numels = [sum(named[i][1].numel() for i in b) for b in index_buckets]

    def _bucket_cap_mb(self) -> float:
        return 1e9 if self.bucket_size_mb is None else self.bucket_size_mb

    def on_train_batch_start(self) -> None:
        pass

    def finish_gradient_synchronization(self) -> None:
        pass


ADDS = ("DataParallelBase._bucket_cap_mb", "DDPIndividualParameters._bucket_cap_mb", "DDPBucketed._bucket_cap_mb")
