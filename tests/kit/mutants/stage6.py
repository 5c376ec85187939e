"""Stage 6 mistakes (handout/06-4d-parallelism.md): each must fail a public test with a message that points at it.

The pieces (tensor, pipeline, expert parallelism) are tested alone before the 4D composition runs
(``RUN_AFTER_UNITS`` in test_stage6_mesh_4d.py), so a mistake in a piece is named by that piece's test.
"""

from kit.mutants import Mutant

MUTANTS = [
    # ------------------------------------------------------------------------------------ tensor parallel (§2)
    Mutant("tp-f-backward-identity", "parallel/tensor_parallel.py",
           find="        grad = grad.contiguous().clone()\n        dist.all_reduce(grad, group=ctx.group)\n"
                "        return grad, None\n",
           replace="        return grad, None\n",
           mistake="f's backward passes the gradient through instead of all-reducing it: ∂L/∂x misses the other "
                   "ranks' slices (§2.1)",
           expect=r"f backward"),
    Mutant("tp-f-g-swapped", "parallel/tensor_parallel.py",
           find="        out = x.contiguous().clone()\n        dist.all_reduce(out, group=group)\n        return out\n",
           replace="        return x.view_as(x)\n",
           mistake="g's forward is the identity (f and g confused): the row-parallel partial sums are never added "
                   "(§2.1)",
           expect=r"g forward"),
    Mutant("tp-row-no-reduce", "parallel/tensor_parallel.py",
           find="        return reduce_from_tensor_parallel(F.linear(x, self.weight), self.group)\n",
           replace="        return F.linear(x, self.weight)\n",
           mistake="RowParallelLinear returns its partial sum without g's all-reduce (§2.2)",
           expect=r"RowParallelLinear output"),
    Mutant("tp-row-shard-wrong-dim", "parallel/tensor_parallel.py",
           find='_shard(weight, 1, group, "RowParallelLinear weight")',
           replace='_shard(weight, 0, group, "RowParallelLinear weight")',
           mistake="shards the row-parallel weight by output rows (dim 0) instead of input columns (dim 1) (§2.2)",
           expect=r"tp_linear"),
    Mutant("tp-shard-global-rank", "parallel/tensor_parallel.py",
           find="    size, rank = dist.get_world_size(group), dist.get_rank(group)\n    if weight.shape[dim] % size:",
           replace="    size, rank = dist.get_world_size(group), dist.get_rank()\n    if weight.shape[dim] % size:",
           mistake="picks the weight shard by the global rank, not the rank in the tp group: right on 2 ranks, wrong "
                   "on every tp group but the first (§2.2)",
           expect=r"tp group|group rank|subgroup"),
    Mutant("tp-block-f-twice", "parallel/tensor_parallel.py",
           find="ColumnParallelLinear.from_linear(getattr(attn, name), group, copy_input=False)",
           replace="ColumnParallelLinear.from_linear(getattr(attn, name), group)",
           mistake="applies f in each of q, k, v as well as once at the attention input: the input gradient is "
                   "all-reduced twice (§2.3)",
           expect=r"block ∂L/∂x"),
    Mutant("tp-block-no-f", "parallel/tensor_parallel.py",
           find="    attn.register_forward_pre_hook(apply_f)\n",
           replace="",
           mistake="builds q, k, v without f and forgets f at the attention input: ∂L/∂x lacks the other ranks' heads "
                   "(§2.3)",
           expect=r"block ∂L/∂x"),
    # ------------------------------------------------------------------------------------ pipeline parallel (§3)
    Mutant("pp-loss-not-averaged", "parallel/pipeline_parallel.py",
           find="            y = loss / len(step.microbatches)\n",
           replace="            y = loss\n",
           mistake="backpropagates each micro-batch's loss unscaled: the gradients are m times those of the mean "
                   "loss (§3.2)",
           expect=r"gradient of .* micro-batches"),
    Mutant("pp-loss-not-broadcast", "parallel/pipeline_parallel.py",
           find="    dist.broadcast(step.total_loss, src=dist.get_global_rank(group, p - 1), group=group)\n",
           replace="",
           mistake="the loss stays on the last stage: the other stages report 0 (§3.2)",
           expect=r"reported loss"),
    Mutant("pp-broadcast-src-group-rank", "parallel/pipeline_parallel.py",
           find="src=dist.get_global_rank(group, p - 1)",
           replace="src=p - 1",
           mistake="broadcasts the loss from global rank p−1, not the pipeline group's last stage (§3.2)",
           expect=r"pp group|group rank|subgroup|not part of group"),
    Mutant("pp-1f1b-warmup-off-by-one", "parallel/pipeline_parallel.py",
           find="    warmup = min(p - s - 1, m)\n    order: list[Op]",
           replace="    warmup = min(p - s, m)\n    order: list[Op]",
           mistake="one warm-up forward too many: stage s holds p − s + 1 micro-batches (§3.3)",
           expect=r"alive at once|warm-up|first backward"),
    Mutant("pp-1f1b-cooldown-reversed", "parallel/pipeline_parallel.py",
           find='    order += [("B", i) for i in range(m - warmup, m)]\n',
           replace='    order += [("B", i) for i in reversed(range(m - warmup, m))]\n',
           mistake="drains the cool-down backwards last-in-first-out: the gradients received from the next stage "
                   "no longer match their micro-batches (§3.3)",
           expect=r"micro-batch order"),
    Mutant("pp-bubble-wrong", "parallel/pipeline_parallel.py",
           find="    return (p - 1) / (m + p - 1)\n",
           replace="    return (p - 1) / m\n",
           mistake="bubble fraction as idle slots over busy slots instead of over the whole step (§3.2)",
           expect=r"bubble_fraction"),
    # ------------------------------------------------------------------------------------ expert parallel (§4)
    Mutant("ep-gates-not-renormalised", "parallel/expert_parallel.py",
           find="    gates = top_p / top_p.sum(dim=-1, keepdim=True)\n",
           replace="    gates = top_p\n",
           mistake="weights the top-k experts by their raw probabilities, not renormalised over the k chosen (§4.1)",
           expect=r"MoE output"),
    Mutant("ep-capacity-off-by-one", "parallel/expert_parallel.py",
           find="        keep = position < capacity\n",
           replace="        keep = position <= capacity\n",
           mistake="lets each expert take capacity + 1 tokens (§4.1)",
           expect=r"dropped token assignments"),
    Mutant("ep-token-major-priority", "parallel/expert_parallel.py",
           find="        flat_e = top_e.t().reshape(-1)  # (k·N,)\n        flat_gate = gates.t().reshape(-1)\n"
                "        token = torch.arange(n, device=x.device).repeat(k)\n",
           replace="        flat_e = top_e.reshape(-1)  # (N·k,)\n        flat_gate = gates.reshape(-1)\n"
                   "        token = torch.arange(n, device=x.device).repeat_interleave(k)\n",
           mistake="serves assignments token by token (a token's second choice before the next token's first), so "
                   "capacity drops different assignments (§4.1)",
           expect=r"MoE output"),
    Mutant("ep-aux-after-drop", "parallel/expert_parallel.py",
           find="        fraction = onehot.float().mean(dim=0)\n",
           replace="        fraction = onehot[keep].float().sum(dim=0) / onehot.shape[0]\n",
           mistake="counts only the kept assignments in the balancing loss's f_e (before dropping is the rule) "
                   "(§4.1)",
           expect=r"load-balancing loss"),
    Mutant("ep-a2a-backward-identity", "parallel/expert_parallel.py",
           find="        out = torch.empty_like(grad)\n        dist.all_to_all_single(out, grad.contiguous(), "
                "group=ctx.group)\n        return out, None\n",
           replace="        return grad, None\n",
           mistake="the all-to-all's backward returns the gradient where it is instead of sending it back to the "
                   "rank whose tokens produced it (§4.2)",
           expect=r"∂L/∂x|gradient of"),
    Mutant("ep-dispatch-no-transpose", "parallel/expert_parallel.py",
           find="            h = received.transpose(0, 1).reshape(e_local, self.ep_size * capacity, self.d_model)\n",
           replace="            h = received.reshape(e_local, self.ep_size * capacity, self.d_model)\n",
           mistake="reshapes the received (ep, E_local, C, d) chunks to (E_local, ep·C, d) without the transpose: "
                   "tokens reach the wrong local expert (§4.2)",
           expect=r"MoE output"),
    Mutant("ep-experts-strided", "parallel/expert_parallel.py",
           find="full.detach()[rank * local:(rank + 1) * local].clone()",
           replace="full.detach()[rank::ep].clone()",
           mistake="keeps experts r, r+ep, … instead of the contiguous block the all-to-all's chunks address (§4.2)",
           expect=r"MoE output"),
    # ------------------------------------------------------------------------------------ mesh (§1)
    Mutant("mesh-grid-tp-outermost", "parallel/mesh.py",
           find="    return torch.arange(pp * dp * ep * tp).view(pp, dp, ep, tp)\n",
           replace="    return torch.arange(pp * dp * ep * tp).view(tp, ep, dp, pp).permute(3, 2, 1, 0)\n",
           mistake="numbers the ranks with tp outermost instead of innermost (§1)",
           expect=r"format_mesh"),
    Mutant("mesh-dims-transposed", "parallel/mesh.py",
           find="init_device_mesh(device_type, (pp, dp, ep, tp), mesh_dim_names=MESH_DIMS)",
           replace="init_device_mesh(device_type, (dp, tp, pp, ep), mesh_dim_names=MESH_DIMS)",
           mistake="passes the axis sizes in dp, tp, pp, ep order to a mesh whose dims are (pp, dp, ep, tp) (§1)",
           expect=r"\(pp, dp, ep, tp\)|group"),
    Mutant("mesh-dense-group-wrong-axes", "parallel/mesh.py",
           find="grid[p, :, :, t].flatten().tolist() for p in range(grid.shape[0]) for t in range(grid.shape[3])",
           replace="grid[:, d, e, :].flatten().tolist() for d in range(grid.shape[1]) for e in range(grid.shape[2])",
           mistake="groups the dense gradients over pp × tp instead of dp × ep (§1)",
           expect=r"dense group"),
    # ------------------------------------------------------------------------------------ composition (§5)
    Mutant("dp-dense-over-dp-only", "parallel/train_4d.py",
           find="process_group=dense_grad_group(mesh))",
           replace='process_group=mesh.get_group("dp"))',
           mistake="averages the dense gradients over dp only: ep ranks, which read different data, drift apart "
                   "(§1, §5.2)",
           expect=r"tp2_pp2_ep2.*gradient synchronisation"),
    Mutant("dp-expert-not-divided-by-ep", "parallel/train_4d.py",
           find="                p.grad.div_(cfg.ep)\n",
           replace="                pass\n",
           mistake="forgets that expert gradients already sum the tokens of every ep rank (§5.2 trap 2)",
           expect=r"tp2_pp2_ep2.*gradient synchronisation"),
    Mutant("dp-loss-summed", "parallel/train_4d.py",
           find="        loss /= dist.get_world_size(group)\n",
           replace="",
           mistake="reports the sum, not the mean, of the data shards' losses (§5.2)",
           expect=r"step-0 loss .*differs"),
    Mutant("microbatches-strided", "parallel/train_4d.py",
           find="    return [(inputs[start + i * b:start + (i + 1) * b], targets[start + i * b:start + (i + 1) * b]) "
                "for i in range(ga)]\n",
           replace="    start = shard * b\n    step_rows = b * cfg.dp * cfg.ep\n"
                   "    return [(inputs[start + i * step_rows:start + i * step_rows + b], "
                   "targets[start + i * step_rows:start + i * step_rows + b]) for i in range(ga)]\n",
           mistake="interleaves the shards' micro-batches instead of giving each shard consecutive rows (§5.2)",
           expect=r"micro-batch"),
]
