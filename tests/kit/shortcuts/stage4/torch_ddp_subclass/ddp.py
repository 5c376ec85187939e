from torch.nn.parallel import DistributedDataParallel


class DataParallelBase(DistributedDataParallel):
    def __init__(self, module: nn.Module, *, process_group: Any = None):
        _check_module(module)
        if not dist.is_initialized():
            raise RuntimeError("DDP needs an initialised process group")
        verify_same_model(module, process_group)
        broadcast_module_states(module, process_group)  # buffers once, not at every forward
        super().__init__(module, process_group=process_group, bucket_cap_mb=self._bucket_cap_mb(),
                         find_unused_parameters=True, broadcast_buffers=False)
        self.world_size = dist.get_world_size(process_group)
        self._sync_this_step = True

    def _bucket_cap_mb(self) -> float:
        return 25.0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._sync_this_step = self.require_backward_grad_sync
        return super().forward(*args, **kwargs)

    def on_train_batch_start(self) -> None:
        pass

    def finish_gradient_synchronization(self) -> None:
        """DistributedDataParallel's reducer has averaged every gradient by the time backward returns."""


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
        return 1e-9  # every parameter in a bucket of its own

    def on_train_batch_start(self) -> None:
        pass

    def finish_gradient_synchronization(self) -> None:
        pass


class DDPBucketed(DataParallelBase):
    def __init__(self, module: nn.Module, bucket_size_mb: float | None = 25.0, *, process_group: Any = None):
        _check_module(module)
        assign_buckets([], bucket_size_mb)
        self._cap = 1e9 if bucket_size_mb is None else bucket_size_mb
        super().__init__(module, process_group=process_group)
        self.bucket_size_mb = bucket_size_mb
        named = trainable_parameters(self.module)
        index_buckets = assign_buckets([p for _, p in named], bucket_size_mb)
        self.bucket_names = [[named[i][0] for i in b] for b in index_buckets]
        self.bucket_numels = [sum(named[i][1].numel() for i in b) for b in index_buckets]

    def _bucket_cap_mb(self) -> float:
        return self._cap

    def on_train_batch_start(self) -> None:
        pass

    def finish_gradient_synchronization(self) -> None:
        pass


ADDS = ("DataParallelBase._bucket_cap_mb", "DDPIndividualParameters._bucket_cap_mb", "DDPBucketed._bucket_cap_mb")
