from torch.nn.parallel.distributed import _find_tensors


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
        broadcast_module_states(module, process_group)
        # torch's C++ Reducer: it hooks every gradient, fills buckets, all-reduces and averages them.
        params = [p for _, p in trainable_parameters(module)]
        cap = int(self._bucket_cap_mb() * MIB)
        buckets, limits = dist._compute_bucket_assignment_by_size(params, [cap])
        group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
        self._reducer = dist.Reducer(params, list(reversed(buckets)), list(reversed(limits)), group, [], cap, True,
                                     False, {}, cap)

    def _bucket_cap_mb(self) -> float:
        return 25.0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._sync_this_step = self.require_backward_grad_sync
        sync = torch.is_grad_enabled() and self._sync_this_step
        if sync:
            self._reducer.prepare_for_forward()
        out = self.module(*args, **kwargs)
        if sync:
            self._reducer.prepare_for_backward(list(_find_tensors(out)))
        return out

    def finish_gradient_synchronization(self) -> None:
        """The reducer has averaged every gradient by the time backward returns."""


class NaiveDDP(DataParallelBase):
    def finish_gradient_synchronization(self) -> None:
        pass


class FlatDDP(DataParallelBase):
    def _bucket_cap_mb(self) -> float:
        return 1e6

    def finish_gradient_synchronization(self) -> None:
        pass


class DDPIndividualParameters(DataParallelBase):
    def __init__(self, module: nn.Module, *, process_group: Any = None):
        super().__init__(module, process_group=process_group)

    def _bucket_cap_mb(self) -> float:
        return 1e-9

    def on_train_batch_start(self) -> None:
        pass

    def finish_gradient_synchronization(self) -> None:
        pass


class DDPBucketed(DataParallelBase):
    def __init__(self, module: nn.Module, bucket_size_mb: float | None = 25.0, *, process_group: Any = None):
        _check_module(module)
        assign_buckets([], bucket_size_mb)
        self._cap = 1e6 if bucket_size_mb is None else bucket_size_mb
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


ADDS = ("DataParallelBase._bucket_cap_mb", "FlatDDP._bucket_cap_mb", "DDPIndividualParameters._bucket_cap_mb",
        "DDPBucketed._bucket_cap_mb")
