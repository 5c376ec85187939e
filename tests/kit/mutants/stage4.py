"""Stage 4 mistakes (handout/04-ddp.md): each must fail a public test with a message that points at it."""

from instructor.mutants import Mutant

MUTANTS = [
    Mutant("sum-not-average", "ddp.py",
           find="                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.process_group)\n"
                "                p.grad.div_(self.world_size)",
           replace="                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.process_group)",
           mistake="NaiveDDP sums the gradients and forgets to divide by the group size (§1–§2)",
           expect="naive.*parameter"),
    Mutant("divide-by-world-not-group", "ddp.py",
           find="        flat.div_(self.world_size)",
           replace="        flat.div_(dist.get_world_size())",
           mistake="FlatDDP divides by the default group's size instead of the process group's (§1)",
           expect="flat over the process_group of ranks"),
    Mutant("broadcast-src-group-rank", "ddp.py",
           find="    src = _group_source_rank(process_group)",
           replace="    src = 0  # the group's first rank",
           mistake="broadcasts from src=0, a group rank, where dist.broadcast wants the global rank of the group's "
                   "first member (§1)",
           expect="global rank|not part of|src"),
    Mutant("skip-buffers", "ddp.py",
           find="        for tensor in list(module.parameters()) + list(module.buffers()):",
           replace="        for tensor in list(module.parameters()):",
           mistake="broadcasts the parameters but not the buffers, so replicas compute different functions (§1)",
           expect="shift"),
    Mutant("skip-verify", "ddp.py",
           find="    mine = [(n, tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for n, p in "
                "module.named_parameters()]",
           replace="    return\n    mine = [(n, tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for n, p in "
                   "module.named_parameters()]",
           mistake="skips the same-model check: mismatched replicas fail later in the broadcast with an opaque "
                   "error, or hang on NCCL (§1)",
           expect="verify_same_model|ValueError naming 'fc2'"),
    Mutant("flat-no-copy-back", "ddp.py",
           find="            g.copy_(flat[offset : offset + g.numel()].view_as(g))\n",
           replace="            pass\n",
           mistake="FlatDDP reduces a concatenated copy but never copies the averaged slices back into .grad (§2)",
           expect="flat.*parameter"),
    Mutant("individual-immediate-wait", "ddp.py",
           find="        handle = dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.process_group, "
                "async_op=True)\n",
           replace="        handle = dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.process_group, "
                   "async_op=True)\n        handle.wait()\n",
           mistake="the hook launches the async all-reduce and waits on it at once: backward blocks, nothing "
                   "overlaps (§3)",
           expect="waited immediately, no overlap"),
    Mutant("individual-missing-wait", "ddp.py",
           find="        for grad, handle in self._pending:\n            handle.wait()\n",
           replace="        for grad, handle in self._pending:\n",
           mistake="finish_gradient_synchronization divides without waiting on the handles: the reduction may "
                   "land after the optimizer read the gradient (§3)",
           expect="never waited"),
    Mutant("individual-syncs-in-no-sync", "ddp.py",
           find="        if not self._sync_this_step:\n            return\n        handle = dist.all_reduce(",
           replace="        handle = dist.all_reduce(",
           mistake="the per-parameter hook ignores no_sync and communicates every micro-batch (§5)",
           expect="no_sync"),
    Mutant("bucketed-immediate-wait", "ddp.py",
           find="            buffer, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True\n        )\n",
           replace="            buffer, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True\n        )\n"
                   "        self._handles[k].wait()\n",
           mistake="each bucket's all-reduce is waited on right after launch, inside the hook: no overlap (§4)",
           expect="waited immediately, no overlap"),
    Mutant("bucket-cap-off-by-one", "ddp.py",
           find="if current and (current_bytes + nbytes > cap or not same_kind):",
           replace="if current and (current_bytes + nbytes >= cap or not same_kind):",
           mistake="closes a bucket when it would reach the cap instead of exceed it: a bucket exactly at the cap "
                   "is split (§4)",
           expect="assign_buckets.*full bucket"),
    Mutant("bucket-order-forward", "ddp.py",
           find="    for i in reversed(range(len(params))):",
           replace="    for i in range(len(params)):",
           mistake="buckets in registration order: bucket 0 (sent first) holds the first layer, whose gradient "
                   "is ready last, so nothing is sent until backward ends (§4)",
           expect="assign_buckets"),
    Mutant("bucketed-no-copy-back", "ddp.py",
           find="                    p.grad.copy_(buffer[offset : offset + p.numel()].view_as(p.grad))\n",
           replace="                    pass\n",
           mistake="DDPBucketed reduces the bucket buffer but never copies the averaged slices back into .grad (§4)",
           expect="bucketed.*parameter"),
    Mutant("bucketed-zero-grad-for-unused", "ddp.py",
           find="                if p.grad is not None:\n                    p.grad.copy_(",
           replace="                if p.grad is None:\n                    p.grad = torch.zeros_like(p)\n"
                   "                if True:\n                    p.grad.copy_(",
           mistake="gives a parameter that got no gradient a zero .grad, so weight decay and momentum move it (§7)",
           expect="never_used"),
    Mutant("bucket-buffer-default-dtype", "ddp.py",
           find="            torch.zeros(n, dtype=b[0].dtype, device=b[0].device)\n",
           replace="            torch.zeros(n, device=b[0].device)\n",
           mistake="allocates every bucket's flat buffer in the default dtype (float32): a float64 bucket's gradients "
                   "are rounded to float32 on their way through the all-reduce (§4)",
           expect="MixedDtypes.*float64 parameter"),
    Mutant("bucket-state-not-reset", "ddp.py",
           find="        self._ready_count = [0] * len(self._bucket_params)\n"
                "        self._handles = [None] * len(self._bucket_params)\n        # END SOLUTION",
           replace="        pass\n        # END SOLUTION",
           mistake="never resets the ready counts and handles between steps: from step 2 on buckets launch late "
                   "or complain they were already sent (§4)",
           expect="step 2|already|after the bucket was sent"),
    Mutant("no-sync-not-restored-on-exception", "ddp.py",
           find="        try:\n            yield\n        finally:\n"
                "            self.require_backward_grad_sync = previous",
           replace="        yield\n        self.require_backward_grad_sync = previous",
           mistake="no_sync restores the setting only on a normal exit: an exception inside leaves "
                   "synchronisation off for the rest of training (§5)",
           expect="no_sync must restore"),
    Mutant("time-no-barrier", "collectives.py",
           find="        dist.barrier()\n",
           replace="",
           mistake="times all-reduces without a barrier first: early ranks start the clock while others are busy "
                   "(§6)",
           expect="barrier"),
    Mutant("time-no-max", "collectives.py",
           find="    dist.all_reduce(mean, op=dist.ReduceOp.MAX)\n",
           replace="",
           mistake="reports this rank's time instead of the slowest rank's (§6)",
           expect="MAX"),
    Mutant("time-constant", "collectives.py",
           find="    return float(mean.item())",
           replace="    return 1e-3",
           mistake="returns a made-up constant instead of the measured time (§6)",
           expect="reported 0.0010"),
    Mutant("bucketed-never-launches", "ddp.py",
           find="        if self._ready_count[k] == len(self._bucket_params[k]):\n            self._launch_bucket(k)\n",
           replace="        if self._ready_count[k] == self.bucket_numels[k]:\n            self._launch_bucket(k)\n",
           mistake="the hook compares the ready count with the bucket's element count, so a bucket is never "
                   "complete; with the reference's finish_gradient_synchronization the leftovers are launched there, "
                   "after the backward: nothing overlaps (§4)",
           expect="waited|overlap|launched"),
    Mutant("bucketed-never-launches-nor-finishes", "ddp.py",
           find="        if self._ready_count[k] == len(self._bucket_params[k]):\n            self._launch_bucket(k)\n"
                "        # END SOLUTION\n\n    def on_train_batch_start(self) -> None:\n"
                "        \"\"\"Reset the per-step state: no bucket launched, no gradient counted.\"\"\"\n"
                "        # BEGIN SOLUTION reset the ready counts and the handles (handout 04 §4)\n"
                "        self._ready_count = [0] * len(self._bucket_params)\n"
                "        self._handles = [None] * len(self._bucket_params)\n        # END SOLUTION\n\n"
                "    def finish_gradient_synchronization(self) -> None:\n        if not self._sync_this_step:\n"
                "            return\n"
                "        # BEGIN SOLUTION launch leftovers, wait, average, copy back, reset (handout 04 §4)\n"
                "        # Buckets whose parameters did not all get a gradient never launched: launch them now, in "
                "bucket\n        # order, which is the same on every rank because every rank runs the same graph.\n"
                "        for k, handle in enumerate(self._handles):\n            if handle is None:\n"
                "                self._launch_bucket(k)\n        for k, handle in enumerate(self._handles):\n"
                "            handle.wait()\n",
           replace="        if self._ready_count[k] == self.bucket_numels[k]:\n            self._launch_bucket(k)\n"
                   "        # END SOLUTION\n\n    def on_train_batch_start(self) -> None:\n"
                   "        self._ready_count = [0] * len(self._bucket_params)\n"
                   "        self._handles = [None] * len(self._bucket_params)\n\n"
                   "    def finish_gradient_synchronization(self) -> None:\n        if not self._sync_this_step:\n"
                   "            return\n        for k, handle in enumerate(self._handles):\n"
                   "            if handle is None:\n                continue\n            handle.wait()\n",
           mistake="no bucket is ever launched: the hook compares the ready count with the bucket's element count, "
                   "and finish_gradient_synchronization waits only on the buckets the hooks launched, so nothing is "
                   "reduced; the no_sync test must not blame no_sync for it (§4)",
           expect="no bucket was launched"),
]
