from torch.nn.parallel import DistributedDataParallel


class NaiveDDP(DataParallelBase):
    def __init__(self, module: nn.Module, *, process_group: Any = None):
        super().__init__(module, process_group=process_group)
        self._torch_ddp = DistributedDataParallel(module, process_group=process_group,
                                                  find_unused_parameters=True, broadcast_buffers=False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._sync_this_step = self.require_backward_grad_sync
        self._torch_ddp.require_backward_grad_sync = self.require_backward_grad_sync
        return self._torch_ddp(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        pass


class FlatDDP(DataParallelBase):
    def __init__(self, module: nn.Module, *, process_group: Any = None):
        super().__init__(module, process_group=process_group)
        # One bucket for everything: one flat all-reduce, as FlatDDP promises.
        self._torch_ddp = DistributedDataParallel(module, process_group=process_group, bucket_cap_mb=1e9,
                                                  find_unused_parameters=True, broadcast_buffers=False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._sync_this_step = self.require_backward_grad_sync
        self._torch_ddp.require_backward_grad_sync = self.require_backward_grad_sync
        return self._torch_ddp(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        pass


ADDS = ("NaiveDDP.forward", "FlatDDP.forward")
