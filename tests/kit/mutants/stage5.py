"""Stage 5 mistakes (handout/05-zero.md, handout/05b-fsdp.md): each must fail a public test with a message that
points at it. ZeRO-1 (zero.py) first, then FSDP (fsdp.py)."""

from instructor.mutants import Mutant

# Two mistakes move a line of one hook into the next hook: the text from the first to the second.
_PREFETCH_FORWARD = "            self._prefetch(unit, reverse=False)\n"
_PRE_TO_POST_FORWARD = (
    "            self._wait_unshard(unit)\n            _install(unit)\n            # END SOLUTION\n"
    "            return _cast_floats(args, self.compute_dtype)\n\n        return hook\n\n"
    "    def _post_forward_hook(self, unit: _Unit) -> Callable:\n"
    "        def hook(module: nn.Module, args: tuple, output: Any) -> None:\n"
    "            # BEGIN SOLUTION uninstall, free if resharding, hook the pre-backward on the outputs "
    "(handout 05b §3)\n"
    "            _uninstall(unit)\n")
_PREFETCH_BACKWARD = "            self._prefetch(unit, reverse=True)\n"
_PRE_BACKWARD_TO_GRAD_HOOK = (
    "            self._wait_unshard(unit)\n            # END SOLUTION\n\n        return hook\n\n"
    "    def _grad_hook(self, unit: _Unit, p: _Param) -> Callable:\n"
    "        def hook(full: torch.Tensor) -> None:\n"
    "            # BEGIN SOLUTION full.grad into grad_input; unit complete: reduce-scatter, free (handout 05b §5)\n"
    "            _add_grad(unit, p, full.grad, self.world_size)\n            full.grad = None\n"
    "            unit.grads_ready += 1\n            if unit.grads_ready == unit.trainable:\n"
    "                unit.grads_ready = 0\n")

MUTANTS = [
    # ------------------------------------------------------------------------------------------------ ZeRO-1
    Mutant("zero-owner-global-rank", "zero.py",
           find="        self.rank = dist.get_rank(process_group)\n",
           replace="        self.rank = dist.get_rank()\n",
           mistake="compares owners (group ranks) with the global rank: on a subgroup not starting at 0 the wrong "
                   "rank updates and broadcasts each parameter (§2)",
           expect=r"process_group=\[1, 2\]|subgroup"),
    Mutant("zero-broadcast-src-group-rank", "zero.py",
           find="src = _global_rank(self.process_group, self._owner[p])",
           replace="src = self._owner[p]",
           mistake="passes the owner's group rank as broadcast's src, which is a global rank (§3)",
           expect=r"process_group=\[1, 2\]|subgroup|src"),
    Mutant("zero-gather-dst-group-rank", "zero.py",
           find="dst=_global_rank(self.process_group, 0)",
           replace="dst=0",
           mistake="consolidates the state dict on global rank 0 instead of the group's rank 0 (§4)",
           expect=r"process_group=\[1, 2\]|subgroup|dst"),
    Mutant("zero-stale-state-after-load", "zero.py",
           find="        # Optimizer.load_state_dict builds a *new* state dict: point `state` at it again, or it stays "
                "stale.\n        self.state = self.local_optimizer.state\n",
           replace="",
           mistake="after local_optimizer.load_state_dict, self.state still points at the old (pre-load) state dict "
                   "(§4)",
           expect=r"stale|right after load_state_dict"),
    Mutant("zero-load-keeps-every-state", "zero.py",
           find="                if self._owner[p] != self.rank:\n                    continue\n",
           replace="",
           mistake="load_state_dict keeps the state of every parameter, not only the owned ones (§4)",
           expect=r"load_state_dict|resume|saved at step|param group"),
    Mutant("zero-no-sharding", "zero.py",
           find="self.local_optimizer = optimizer_cls([self._local_group(g) for g in self.param_groups], **kwargs)",
           replace="self.local_optimizer = optimizer_cls([{k: v for k, v in g.items() if k != 'param_names'} "
                   "for g in self.param_groups], **kwargs)",
           mistake="every rank keeps optimizer state for, and updates, every parameter: correct numbers, no "
                   "memory saved (§2)",
           expect=r"both hold optimizer state|optimizer state"),
    Mutant("zero-no-broadcast", "zero.py",
           find="                handles.append(dist.broadcast(p.data, src=src, group=self.process_group, "
                "async_op=True))\n",
           replace="                pass\n",
           mistake="updates the owned parameters but never sends them: the other ranks keep stale weights (§3)",
           expect=r"AdamW steps vs single-process AdamW"),
    Mutant("zero-partition-smallest-first", "zero.py",
           find="key=lambda i: -numels[i])",
           replace="key=lambda i: numels[i])",
           mistake="assigns the smallest parameter first, so the big ones unbalance the loads (§2)",
           expect=r"owners"),
    Mutant("zero-state-dict-local-indices", "zero.py",
           find="index[local_params[i]]: _to_cpu(state)",
           replace="i: _to_cpu(state)",
           mistake="state_dict keys the states by the local optimizer's indices, not the unsharded numbering (§4)",
           expect=r"indices with state|state\["),
    Mutant("zero-step-ignores-scheduler", "zero.py",
           find="        self._copy_options(self.param_groups, self.local_optimizer.param_groups)\n        if closure",
           replace="        if closure",
           mistake="step does not pass the options of param_groups (an LR scheduler's lr) to the local optimizer "
                   "(§3)",
           survives="no public test changes an option between steps (the public runs use constant options; the "
                    "scheduler run is the hidden subgroup test)",
           hidden_test="test_hidden_subgroup_with_lr_scheduler"),
    Mutant("zero-accounting-stage2-full-grads", "zero.py",
           find="grads = (shard if stage >= 2 else full) * grad_bytes",
           replace="grads = (shard if stage >= 3 else full) * grad_bytes",
           mistake="ZeRO-2 keeps the full gradients: only stage 3 shards them in this mistake (§5)",
           expect=r"ZeRO-2"),
    Mutant("zero-accounting-allreduce-once", "zero.py",
           find="comm = 2 * (n - 1) * shard * grad_bytes",
           replace="comm = (n - 1) * shard * grad_bytes",
           mistake="counts plain DP's all-reduce as one pass, not a reduce-scatter plus an all-gather (§5)",
           expect=r"ZeRO-0 comm"),
    # ------------------------------------------------------------------------------------------------ FSDP
    Mutant("fsdp-take-shard-floor", "fsdp.py",
           find="    per_rank = math.ceil(rows / world_size)\n    shard = full.new_zeros",
           replace="    per_rank = rows // world_size\n    shard = full.new_zeros",
           mistake="⌊rows/N⌋ rows per shard: the last rows are lost instead of padded (§1)",
           expect=r"take_shard"),
    Mutant("fsdp-buffers-not-broadcast", "fsdp.py",
           find="for t in [*module.parameters(), *module.buffers()]:",
           replace="for t in [*module.parameters()]:",
           mistake="construction broadcasts the parameters but not the buffers, which stay different by rank (§2)",
           expect=r"calib"),
    Mutant("fsdp-broadcast-src-zero", "fsdp.py",
           find="src = dist.get_global_rank(group, 0) if group is not None else 0",
           replace="src = 0",
           mistake="broadcasts from global rank 0, which is not the group's first rank on a subgroup (§2)",
           expect=r"group|subgroup|src|\[1, 2\]"),
    Mutant("fsdp-reduce-scatter-not-averaged", "fsdp.py",
           find="        output.div_(self.world_size)\n",
           replace="",
           mistake="reduce-scatter sums the gradients and nobody divides by N: the update is N times too big (§5)",
           expect=r"gather_full_params|single-process"),
    Mutant("fsdp-replicated-not-averaged", "fsdp.py",
           find="                param.grad.div_(self.world_size)\n",
           replace="",
           mistake="the replicated parameters' gradients are all-reduced (summed) but not averaged (§5)",
           expect=r"averaging the ranks' gradients"),
    Mutant("fsdp-grads-reduced-in-compute-dtype", "fsdp.py",
           find="        output = torch.empty(unit.shard_numel, dtype=torch.float32, device=unit.grad_input.device)\n"
                "        work = _reduce_scatter_tensor(output, unit.grad_input.view(-1), op=dist.ReduceOp.SUM,",
           replace="        low = self.compute_dtype or torch.float32\n"
                   "        output = torch.empty(unit.shard_numel, dtype=low, device=unit.grad_input.device)\n"
                   "        work = _reduce_scatter_tensor(output, unit.grad_input.view(-1).to(low), "
                   "op=dist.ReduceOp.SUM,",
           mistake="reduces the gradients in the 16-bit compute dtype; the handout says in fp32 (§5, §8)",
           expect=r"bfloat16|float16|bf16|fp16"),
    Mutant("fsdp-compute-dtype-after-gather", "fsdp.py",
           find="        dtype = self.compute_dtype or unit.params[0].param.dtype\n",
           replace="        dtype = unit.params[0].param.dtype\n",
           mistake="all-gathers the fp32 shards and casts afterwards: the wire carries 4 bytes per element (§3, §8)",
           expect=r"bytes|all.gather"),
    Mutant("fsdp-no-reshard-after-forward", "fsdp.py",
           find="            if self.reshard_after_forward:\n                self._reshard(unit)\n",
           replace="",
           mistake="keeps every unit's full weights from its forward to its backward, whatever the option says "
                   "(§3)",
           expect=r"gathered|units|prefetch"),
    Mutant("fsdp-no-reshard-after-backward", "fsdp.py",
           find="                    self._reduce_scatter(unit)\n                self._reshard(unit)\n",
           replace="                    self._reduce_scatter(unit)\n",
           mistake="does not free a unit's full weights once its gradients are out: they pile up until the end "
                   "of the backward (§3)",
           expect=r"gathered|units|prefetch"),
    Mutant("fsdp-no-prefetch", "fsdp.py",
           find="        for nxt in order[i + 1 : i + 1 + self.prefetch]:\n            self._unshard(nxt)\n",
           replace="        pass\n",
           mistake="ignores prefetch: every all-gather is issued only when its unit is about to compute (§4)",
           expect=r"prefetch"),
    Mutant("fsdp-prefetch-wrong-unit", "fsdp.py",
           find="order[i + 1 : i + 1 + self.prefetch]",
           replace="order[i + 2 : i + 2 + self.prefetch]",
           mistake="prefetches one unit too far ahead, so the next unit is gathered only when it is needed (§4)",
           expect=r"prefetch|gather"),
    Mutant("fsdp-backward-prefetch-forward-order", "fsdp.py",
           find="            self._prefetch(unit, reverse=True)\n",
           replace="            self._prefetch(unit, reverse=False)\n",
           mistake="in the backward, prefetches the units that follow in the forward order, not the ones the "
                   "backward needs next (§4)",
           expect=r"prefetch|gathered|backward"),
    Mutant("fsdp-padding-not-stripped", "fsdp.py",
           find="                out[p.name] = padded[: p.rows].clone()\n",
           replace="                out[p.name] = padded.clone()\n",
           mistake="gather_full_params returns the padded full weights, zero rows included (§1, §6)",
           expect=r"gather_full_params"),
    # -- issue 27: wrong FSDPs that passed every public test
    Mutant("fsdp-forward-prefetch-after-compute", "fsdp.py",
           find=_PREFETCH_FORWARD + _PRE_TO_POST_FORWARD,
           replace=_PRE_TO_POST_FORWARD + "            self._prefetch(unit, reverse=False)\n",
           mistake="issues the forward prefetch from the post-forward hook, once the unit has computed: the next "
                   "gather overlaps nothing (§4)",
           expect=r"issued after unit .* started computing"),
    Mutant("fsdp-backward-prefetch-in-grad-hook", "fsdp.py",
           find=_PREFETCH_BACKWARD + _PRE_BACKWARD_TO_GRAD_HOOK,
           replace=_PRE_BACKWARD_TO_GRAD_HOOK + "                self._prefetch(unit, reverse=True)\n",
           mistake="issues the backward prefetch from the gradient hook, just before the reduce-scatter: the unit's "
                   "backward has computed, so the next gather overlaps nothing (§4)",
           expect=r"backward started computing"),
    Mutant("fsdp-accounting-peak-window-off-by-one", "fsdp.py",
           find="else min(prefetch + 1, len(shard))",
           replace="else min(prefetch, len(shard))",
           mistake="fsdp_accounting's peak window holds prefetch units instead of prefetch + 1 (the one computing "
                   "and the ones in flight) (§4, §7)",
           expect=r"peak_gathered_bytes"),
    Mutant("fsdp-reduce-scatters-never-capped", "fsdp.py",
           find="        while len(self._reduce_scatters) > 2:  # bounds the fp32 full gradients alive during the "
                "backward\n            self._finish_reduce_scatter(*self._reduce_scatters.pop(0))\n",
           replace="",
           mistake="never finishes a reduce-scatter before the end of the backward: every unit's full fp32 gradient "
                   "stays alive until finish_gradient_synchronization (§5)",
           expect=r"never capped"),
    Mutant("fsdp-load-state-dict-shard-zero", "fsdp.py",
           find="local[key] = take_shard(state_dict[key], self.world_size, self.rank)",
           replace="local[key] = take_shard(state_dict[key], self.world_size, 0)",
           mistake="load_state_dict keeps shard 0 of every full tensor on every rank (§6)",
           expect=r"load_state_dict holds the rows"),
    # -- tried as a student would, from the release (issue 27)
    Mutant("fsdp-gather-buffer-param-dtype", "fsdp.py",
           find="        unit.gather_output = torch.empty(self.world_size * unit.shard_numel, dtype=dtype, "
                "device=flat.device)\n",
           replace="        unit.gather_output = torch.empty(self.world_size * unit.shard_numel, "
                   "dtype=unit.params[0].param.dtype, device=flat.device)\n",
           mistake="allocates the all-gather's output in the parameters' dtype: with a 16-bit compute dtype the "
                   "collective gets tensors of two dtypes and fails (bf16 and fp16 only) (§3, §8)",
           expect=r"bf16|bfloat16|float16|dtype"),
    Mutant("fsdp-full-grad-not-cleared", "fsdp.py",
           find="            _add_grad(unit, p, full.grad, self.world_size)\n            full.grad = None\n",
           replace="            _add_grad(unit, p, full.grad, self.world_size)\n",
           mistake="never clears full.grad after copying it out: autograd adds every later step's gradient to it, "
                   "so from step 2 on the reduce-scatter carries the sum of all steps (§5)",
           expect=r"single-process|single process"),
    Mutant("fsdp-grad-input-kept", "fsdp.py",
           find="        work.wait()\n        unit.grad_input = None\n",
           replace="        work.wait()\n        unit.grad_input.zero_()\n",
           mistake="keeps each unit's full fp32 gradient buffer between steps (zeroed instead of dropped): the "
                   "numbers are right, the memory FSDP exists to save is not (§5)",
           expect=r"still alive after finish_gradient_synchronization"),
    Mutant("fsdp-gather-full-params-compute-dtype", "fsdp.py",
           find="            flat = torch.cat([p.param.detach().reshape(-1) for p in unit.params])\n",
           replace="            flat = torch.cat([p.param.detach().reshape(-1) for p in unit.params])"
                   ".to(self.compute_dtype or torch.float32)\n",
           mistake="gather_full_params gathers in the compute dtype: with bf16 the full parameters come back rounded "
                   "to bf16 (§6)",
           expect=r"bfloat16|float16|gather_full_params"),
    Mutant("fsdp-accounting-peak-shard-bytes", "fsdp.py",
           find="for i in range(len(shard) - window + 1)), default=0) * n",
           replace="for i in range(len(shard) - window + 1)), default=0)",
           mistake="fsdp_accounting's peak counts the units' shards, not their gathered (N times larger, padded) "
                   "full weights (§7)",
           expect=r"peak_gathered_bytes"),
    Mutant("fsdp-prefetch-before-own-gather", "fsdp.py",
           find="            self._unshard(unit)  # first, so it is issued before the prefetches\n"
                "            self._prefetch(unit, reverse=False)\n",
           replace="            self._prefetch(unit, reverse=False)\n            self._unshard(unit)\n",
           mistake="issues the prefetches before the unit's own all-gather: on the first unit the gathers go out of "
                   "order (the next unit first) (§4)",
           expect=r"all-gather of the forward, in order|gathered j-th"),
    Mutant("fsdp-prefetch-waits-at-once", "fsdp.py",
           find="        for nxt in order[i + 1 : i + 1 + self.prefetch]:\n            self._unshard(nxt)\n",
           replace="        for nxt in order[i + 1 : i + 1 + self.prefetch]:\n            self._wait_unshard(nxt)\n",
           mistake="prefetches by gathering the next unit and waiting for it at once: the gather is on the critical "
                   "path again (§4)",
           expect=r"waited on before .* started computing"),
    Mutant("fsdp-gather-buffer-kept", "fsdp.py",
           find="        unit.gather_work, unit.gather_output = None, None\n",
           replace="        unit.gather_work = None\n",
           mistake="keeps each unit's all-gather buffer after copying it into the full weights: every unit's "
                   "gathered weights stay alive (§3)",
           expect=r"units' gathered weights were alive at once"),
    Mutant("fsdp-load-state-dict-global-rank", "fsdp.py",
           find="local[key] = take_shard(state_dict[key], self.world_size, self.rank)",
           replace="local[key] = take_shard(state_dict[key], self.world_size, dist.get_rank())",
           mistake="load_state_dict cuts the shard of the global rank, not the rank in the process group (§2, §6)",
           expect=r"holds the rows|load_state_dict raised"),
    Mutant("fsdp-no-sync-not-restored-on-exception", "fsdp.py",
           find="        try:\n            yield\n        finally:\n"
                "            self.require_backward_grad_sync = previous\n",
           replace="        yield\n        self.require_backward_grad_sync = previous\n",
           mistake="no_sync restores the setting only on a normal exit: a micro-batch that fails inside leaves "
                   "gradient synchronisation off for good (§6)",
           expect=r"try/finally"),
    Mutant("fsdp-divide-before-wait", "fsdp.py",
           find="        work.wait()\n        unit.grad_input = None\n        output.div_(self.world_size)\n",
           replace="        output.div_(self.world_size)\n        work.wait()\n        unit.grad_input = None\n",
           mistake="divides the reduce-scatter's output by N before waiting for it: the collective then overwrites "
                   "it with the sum (§5)",
           expect=r"single-process|single process"),
]
