"""Stage 6 mistakes (handout/06-4d-parallelism.md): each must fail a public test with a message that points at it.

The pieces (tensor, pipeline, expert parallelism) are tested alone before the 4D composition runs
(``RUN_AFTER_UNITS`` in test_stage6_mesh_4d.py), so a mistake in a piece is named by that piece's test.
"""

from instructor.mutants import Mutant

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
    Mutant("pp-layers-remainder-to-last-stages", "parallel/pipeline_parallel.py",
           find="        end = start + base + (1 if s < extra else 0)",
           replace="        end = start + base + (1 if s >= pp - extra else 0)",
           mistake="the stages that get one extra layer are the last ones, not the first ones the handout names "
                   "(§3.1: earlier stages take the remainder)",
           expect=r"split_layers"),
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
           find="    return torch.arange(pp * dp * ep * cp * tp).view(pp, dp, ep, cp, tp)\n",
           replace="    return torch.arange(pp * dp * ep * cp * tp).view(tp, cp, ep, dp, pp).permute(4, 3, 2, 1, 0)\n",
           mistake="numbers the ranks with tp outermost instead of innermost (§1)",
           expect=r"format_mesh"),
    Mutant("mesh-dims-transposed", "parallel/mesh.py",
           find="init_device_mesh(device_type, (pp, dp, ep, cp, tp), mesh_dim_names=MESH_DIMS)",
           replace="init_device_mesh(device_type, (dp, tp, pp, ep, cp), mesh_dim_names=MESH_DIMS)",
           mistake="passes the axis sizes in dp, tp, pp, ep, cp order to a mesh whose dims are (pp, dp, ep, cp, tp) "
                   "(§1)",
           expect=r"\(pp, dp, ep, cp, tp\)|group"),
    Mutant("mesh-dense-group-wrong-axes", "parallel/mesh.py",
           find="grid[p, :, :, :, t].flatten().tolist() for p in range(grid.shape[0]) for t in range(grid.shape[4])",
           replace="grid[:, d, e, c, :].flatten().tolist() for d in range(grid.shape[1]) for e in range(grid.shape[2]) "
                   "for c in range(grid.shape[3])",
           mistake="groups the dense gradients over pp × tp instead of dp × ep × cp (§1)",
           expect=r"dense-gradient group"),
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
    # ------------------------------------------------------------------------------------ accounting (§6)
    Mutant("acc-tp-allreduce-forward-only", "parallel/accounting.py",
           find='volume[("tp", "all_reduce")] = 2 * layers * m * activation',
           replace='volume[("tp", "all_reduce")] = layers * m * activation',
           mistake="counts g's forward all-reduce but not f's backward one (§6.3)",
           expect=r"payload bytes per collective"),
    Mutant("acc-ep-all-to-all-forward-only", "parallel/accounting.py",
           find='volume[("ep", "all_to_all")] = 4 * layers',
           replace='volume[("ep", "all_to_all")] = 2 * layers',
           mistake="counts dispatch and combine in the forward only, not their backward exchanges (§6.3)",
           expect=r"tp2_pp2_ep2.*payload bytes per collective"),
    Mutant("acc-router-not-counted", "parallel/accounting.py",
           find="    dense = layers * (2 * d + 4 * d * d // cfg.tp + d * cfg.num_experts)\n",
           replace="    dense = layers * (2 * d + 4 * d * d // cfg.tp)\n",
           mistake="leaves the (replicated) router out of the dense parameters of a stage (§6.3)",
           expect=r"dense|router|parameter"),
]

# ---------------------------------------------------------------------------------- context parallelism (part 2, 06b)
_CP = "parallel/context_parallel.py"
CP_MUTANTS = [
    Mutant("cp-merge-no-max-subtraction", _CP,
           find="    new_lse = torch.maximum(lse, lse_block) + torch.log1p(torch.exp(-(lse - lse_block).abs()))\n",
           replace="    new_lse = torch.log(torch.exp(lse) + torch.exp(lse_block))\n",
           mistake="merges the log-sum-exps as log(e^a + e^b): e^lse overflows fp32 once lse > 88.7 (06b §2)",
           expect=r"inf/NaN|overflows"),
    Mutant("cp-merge-wrong-block-lse", _CP,
           find="torch.exp(lse_block - new_lse)[..., None] * o_block",
           replace="torch.exp(lse - new_lse)[..., None] * o_block",
           mistake="weights the new block's output by the running lse instead of its own (06b §2)",
           expect=r": output"),
    Mutant("cp-dkv-kept-by-holder", _CP,
           find="        dk, dv = dkv_incoming[0], dkv_incoming[1]  # this rank's own block's, home after cp steps\n",
           replace="        dk, dv = dkv[0], dkv[1]\n",
           mistake="returns the dk/dv accumulator it holds after the last step — the previous rank's block's — without "
                   "the final send to the owner (06b §4)",
           expect=r"∂L/∂k of its own keys|∂L/∂v of its own values"),
    Mutant("cp-causal-future-blocks", _CP,
           find="            if not is_causal or k_id < q_id:\n",
           replace="            if not is_causal or k_id > q_id:\n",
           mistake="with a causal mask, attends the key chunks after the query chunk instead of those before (06b §5)",
           expect=r"causal.*: output"),
    Mutant("cp-causal-diagonal-unmasked", _CP,
           find="                pairs.append((qi, ki, True))\n",
           replace="                pairs.append((qi, ki, False))\n",
           mistake="computes the diagonal block (query and key chunk the same) without the causal mask (06b §5)",
           expect=r"causal.*: output"),
    Mutant("cp-backward-ring-reversed", _CP,
           find="                kv_pending = _ring_exchange(kv, incoming, group)\n"
                "            k_ids = _chunk_ids(cp, (rank - step) % cp, layout)\n",
           replace="                g = group if group is not None else dist.group.WORLD\n"
                   "                kv_pending = dist.batch_isend_irecv([\n"
                   "                    dist.P2POp(dist.isend, kv, dist.get_global_rank(g, (rank - 1) % cp), g),\n"
                   "                    dist.P2POp(dist.irecv, incoming, "
                   "dist.get_global_rank(g, (rank + 1) % cp), g)])\n"
                   "            k_ids = _chunk_ids(cp, (rank + step) % cp, layout)\n",
           mistake="the backward passes K/V around the ring the other way (to undo the forward) while the dk/dv "
                   "accumulators still travel forward: they no longer go with their block (06b §4)",
           expect=r"∂L/∂k of its own keys|∂L/∂v of its own values"),
    Mutant("cp-blocking-send", _CP,
           find="    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, to_next, group, tag),\n"
                "                                   dist.P2POp(dist.irecv, recv, from_prev, group, tag)])\n",
           replace="    dist.send(send, to_next, group=group, tag=tag)\n"
                   "    dist.recv(recv, from_prev, group=group, tag=tag)\n"
                   "    return []\n",
           mistake="blocking dist.send then dist.recv on every rank of the ring: each send waits for a receive its "
                   "peer has not posted, a deadlock (06b §3)",
           expect=r"deadlock"),
    Mutant("cp-wait-before-compute", _CP,
           find="                pending = _ring_exchange(kv, incoming, group)\n",
           replace="                for work in _ring_exchange(kv, incoming, group):\n"
                   "                    work.wait()\n"
                   "                pending = []\n",
           mistake="waits for the next block's transfer before attending the current block: correct, but the "
                   "communication no longer overlaps the compute (06b §3)",
           expect=r"does not overlap"),
    Mutant("cp-zigzag-not-mirrored", _CP,
           find="[cp_rank, 2 * cp - 1 - cp_rank]",
           replace="[cp_rank, cp + cp_rank]",
           mistake="the zig-zag layout's second chunk is cp + r instead of the mirrored 2cp − 1 − r: two chunks, "
                   "still unbalanced (06b §5)",
           expect=r"shard_positions|causal_work"),
    Mutant("cp-gather-not-reordered", _CP,
           find="    return full.index_copy_(dim, positions, torch.cat(shards, dim=dim))\n",
           replace="    return torch.cat(shards, dim=dim)\n",
           mistake="gather_sequence concatenates the shards in rank order: right for the contiguous layout, "
                   "scrambled for zig-zag (06b §1)",
           expect=r"gather_sequence"),
    Mutant("cp-dq-overwritten", _CP,
           find="                dq[qi] += dq_b.float()\n",
           replace="                dq[qi] = dq_b.float()\n",
           mistake="keeps only the last block's dq instead of summing every K/V block's share (06b §4)",
           expect=r"∂L/∂q"),
    Mutant("cp-work-counts-full-blocks", _CP,
           find="    return [int((shard_positions(seq_len, cp, r, layout) + 1).sum()) for r in range(cp)]\n",
           replace="    return [int(len(p) * (p.max() + 1)) for p in (shard_positions(seq_len, cp, r, layout) "
                   "for r in range(cp))]\n",
           mistake="counts every key up to the rank's last position for each of its queries, not j ≤ i (06b §5)",
           expect=r"causal_work"),
]
MUTANTS += CP_MUTANTS

# ---------------------------------------------------------------------------------- the fifth mesh axis (06b §6)
_MESH, _T4, _ACC = "parallel/mesh.py", "parallel/train_4d.py", "parallel/accounting.py"
MESH_CP_MUTANTS = [
    Mutant("cp-grid-cp-outside-dp", _MESH,
           find="    return torch.arange(pp * dp * ep * cp * tp).view(pp, dp, ep, cp, tp)\n",
           replace="    return torch.arange(pp * dp * ep * cp * tp).view(pp, cp, dp, ep, tp).permute(0, 2, 3, 1, 4)\n",
           mistake="numbers the ranks with cp outside dp and ep instead of just outside tp: the ring leaves the node "
                   "(06b §6)",
           expect=r"rank_grid|cp\)"),
    Mutant("cp-dense-grads-not-over-cp", _MESH,
           find="grid[p, :, :, :, t].flatten().tolist() for p in range(grid.shape[0]) for t in range(grid.shape[4])",
           replace="grid[p, :, :, c, t].flatten().tolist() for p in range(grid.shape[0]) for c in range(grid.shape[3]) "
                   "for t in range(grid.shape[4])",
           mistake="averages the dense gradients over dp × ep only: each cp rank keeps the gradient of its own "
                   "shard of the sequence (06b §6)",
           expect=r"dense-gradient group"),
    Mutant("cp-expert-grads-over-dp-only", _T4,
           find="process_group=expert_grad_group(mesh))",
           replace='process_group=mesh.get_group("dp"))',
           mistake="averages the expert gradients over dp only: the cp ranks, whose experts saw different tokens, "
                   "drift apart (06b §6)",
           expect=r"cp2?_dp2.*gradient of layers\.\d+\.ffn\.w|cp.*gradient synchronisation"),
    Mutant("cp-rotary-local-positions", _T4,
           find="    model.set_positions(positions.to(model.lm_head.weight.device))\n",
           replace="",
           mistake="keeps rotary positions 0 … T/cp − 1 on every cp rank instead of the tokens' global positions "
                   "(06b §6)",
           expect=r"step-0 loss .*differs.*global rotary"),
    Mutant("cp-targets-not-sharded-like-inputs", _T4,
           find="        local_targets = shard_sequence(targets, cp=cfg.cp, cp_rank=cp_rank, layout=cfg.cp_layout, "
                "dim=-1)\n",
           replace="        local_targets = shard_sequence(targets, cp=cfg.cp, cp_rank=cp_rank, layout=\"contiguous\", "
                   "dim=-1)\n",
           mistake="cuts the targets contiguously while the inputs are zig-zag: a token's target is no longer the "
                   "next token (06b §6)",
           expect=r"step-0 loss .*differs.*sequence shards"),
    Mutant("cp-pipeline-activation-full-sequence", _T4,
           find="activation_shape=(cfg.micro_batch_size, cfg.seq_len // cfg.cp, cfg.model.d_model)",
           replace="activation_shape=(cfg.micro_batch_size, cfg.seq_len, cfg.model.d_model)",
           mistake="sizes the activations sent between pipeline stages for the whole sequence, not the rank's "
                   "seq_len / cp tokens (06b §6)",
           expect=r"cp2_dp2_pp2"),
    Mutant("cp-accounting-full-sequence", _ACC,
           find="b, t, d, m = cfg.micro_batch_size, cfg.seq_len // cfg.cp, cfg.model.d_model",
           replace="b, t, d, m = cfg.micro_batch_size, cfg.seq_len, cfg.model.d_model",
           mistake="counts the tp all-reduces and pp sends of the whole sequence, not the rank's seq_len / cp tokens "
                   "(06b §6)",
           expect=r"the cp group's left out"),
    Mutant("cp-accounting-dkdv-not-home", _ACC,
           find="        hops = 2 * (cfg.cp - 1) + 2 * (cfg.cp - 1) + 2 * cfg.cp",
           replace="        hops = 2 * (cfg.cp - 1) + 2 * (cfg.cp - 1) + 2 * (cfg.cp - 1)",
           mistake="counts cp − 1 hops for dK and dV, forgetting the last send that takes them home (06b §4, §6)",
           expect=r"the ring's bytes"),
    Mutant("cp-memory-activations-not-divided", _ACC,
           find="    per_layer = activation_bytes_per_layer(seq_len / cp, micro_batch,",
           replace="    per_layer = activation_bytes_per_layer(seq_len, micro_batch,",
           mistake="leaves each cp rank the activations of the whole sequence (06b §6)",
           expect=r"memory_per_device\(cp=4\)"),
]
MUTANTS += MESH_CP_MUTANTS
