"""Stage 7 mistakes (handout/07-fused-loss.md, handout/07b-whole-step.md).

Each must fail a public test with a message that points at it.
"""

from instructor.mutants import Mutant

# ------------------------------------------------------------------------------------ the fused loss (07 §1–§3)
_LOSS = "whole_step/fused_cross_entropy.py"
_FORWARD_LAUNCH = """    fused_ce_forward_kernel[(triton.cdiv(n_tokens, config["BLOCK_T"]),)](
        h2, weight, targets, lse, losses,
        n_tokens, vocab, d, h2.stride(0), weight.stride(0), ignore_index,
        UPCAST=upcast_in_kernel(h2.dtype), DOT_PRECISION=dot_precision(h2.dtype), **config,
    )
"""
_FORWARD_IN_PYTORCH = """    logits = (h2 @ weight.T).float()  # all (N, V) logits at once: what the kernel avoids
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, targets.clamp(0, vocab - 1)[:, None])[:, 0]
    losses = torch.where(targets != ignore_index, lse - picked, 0.0)
"""
_ONLINE_LSE = """        m_new = tl.maximum(m_i, tl.max(z, 1))
        s_i = s_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(z - m_new[:, None]), 1)
        m_i = m_new
"""
FUSED_LOSS: list[Mutant] = [
    # ---------------------------------------------------------------- the forward (§1–§2)
    Mutant("loss-logits-materialised", _LOSS,
           find=_FORWARD_LAUNCH, replace=_FORWARD_IN_PYTORCH,
           mistake="the forward computes the whole (N, V) logits with a matmul and torch.logsumexp instead of tiles "
                   "inside a kernel — the memory the fused loss exists to save (§1–§2). The rule that PyTorch's "
                   "matmuls and log-sum-exp must not compute the loss (handout 07, What is graded) stops it before "
                   "the memory test does; either message points at it",
           expect=r"materialised|PyTorch matmuls, softmax, log-sum-exp"),
    Mutant("loss-max-not-subtracted", _LOSS,
           find=_ONLINE_LSE,
           replace="""        s_i = s_i + tl.sum(tl.exp(z), 1)
        m_i = tl.zeros_like(m_i)
""",
           mistake="log Σ exp(z) computed without subtracting the (running) maximum: exp overflows fp32 past "
                   "z ≈ 88.7 (§2)",
           expect="overflow"),
    Mutant("loss-running-max-starts-at-zero", _LOSS,
           find='m_i = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)',
           replace="m_i = tl.zeros([BLOCK_T], dtype=tl.float32)",
           mistake="the running maximum starts at 0 instead of −inf: when every logit is far below 0, Σ exp(z − m) "
                   "underflows to 0 and lse = −inf (§2)",
           expect="start at −inf"),
    Mutant("loss-online-sum-not-rescaled", _LOSS,
           find="s_i = s_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(z - m_new[:, None]), 1)",
           replace="s_i = s_i + tl.sum(tl.exp(z - m_new[:, None]), 1)",
           mistake="the running sum is not rescaled by exp(m − m_new) when the running maximum grows (§2)",
           expect=r"\bloss \("),
    Mutant("loss-target-logit-from-wrong-tile", _LOSS,
           find="z_tgt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), 1)",
           replace="z_tgt += tl.sum(tl.where(tl.arange(0, BLOCK_V)[None, :] == tgt[:, None], z, 0.0), 1)",
           mistake="the target's logit is picked by the column's index within the tile, not its vocabulary index: "
                   "the wrong tile's logit (or none) is taken (§2)",
           expect=r"\bloss \("),
    Mutant("loss-vocabulary-padding-in-lse", _LOSS,
           find='        z = tl.where(cols[None, :] < V, z, float("-inf"))  # columns past the vocabulary do not '
                'exist\n',
           replace="",
           mistake="columns past V in the last vocabulary tile are not masked: their logits (0, from masked loads) add "
                   "exp(0 − m) to the sum, and lse is too large (§2)",
           expect=r"\bloss \("),
    Mutant("loss-mean-over-all-tokens", _LOSS,
           find="n_counted = (targets != ignore_index).sum()",
           replace="n_counted = torch.tensor(targets.numel(), device=targets.device)",
           mistake="the mean divides by all tokens instead of the counted ones (§2)",
           expect="ignored"),
    Mutant("loss-ignored-tokens-add-to-the-sum", _LOSS,
           find="    counted = row_ok & (tgt != ignore_index)\n    tl.store(LSE + rows, lse, mask=row_ok)",
           replace="    counted = row_ok\n    tl.store(LSE + rows, lse, mask=row_ok)",
           mistake="ignored tokens still add lse − 0 to the summed loss in the forward kernel (§2)",
           expect="ignored"),
    Mutant("loss-ignore-index-assumed-negative", _LOSS,
           find="tgt != ignore_index", replace="tgt >= 0", count=3,
           mistake="the kernels treat negative targets as ignored instead of comparing with ignore_index, which may be "
                   "any int — even a class id (§2)",
           expect="ignore_index = 5"),
    Mutant("loss-tf32-logits", _LOSS,
           find="acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PRECISION)",
           replace="acc = tl.dot(h, tl.trans(w), acc)",
           mistake="the logits' tl.dot ignores DOT_PRECISION: fp32 runs in TF32 on a GPU, invisible to the interpreter "
                   "(§3)",
           expect="TF32"),
    Mutant("loss-no-bf16-upcast", _LOSS,
           find="if UPCAST:", replace="if False:", count=3,
           mistake="the kernels ignore UPCAST: bf16 tl.dot is garbage in the 3.6 interpreter (§2, Stage 3 §5)",
           expect="bfloat16"),
    # ---------------------------------------------------------------- the backward (§3)
    Mutant("loss-grad-not-scaled-by-dloss", _LOSS,
           find="scale = (grad_loss.float() / n_counted.clamp(min=1)).reshape(1)",
           replace="scale = (1.0 / n_counted.clamp(min=1)).reshape(1).float()",
           mistake="the backward ignores the incoming gradient dloss (assumes loss.backward() with 1) (§3)",
           expect="dloss = 0.7"),
    Mutant("loss-grad-of-the-sum", _LOSS,
           find="scale = (grad_loss.float() / n_counted.clamp(min=1)).reshape(1)",
           replace="scale = grad_loss.float().reshape(1)",
           mistake="the backward forgets the 1/n of the mean: the gradient of the summed loss (§3)",
           expect=r"d[HW] = "),
    Mutant("loss-grad-without-one-hot", _LOSS,
           find="    p = p - tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0)\n", replace="",
           mistake="dZ = softmax without subtracting 1 at the target (the gradient of lse alone) (§3)",
           expect=r"d[HW] = "),
    Mutant("loss-dweight-stores-instead-of-accumulating", _LOSS,
           find="""            acc = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            acc = tl.dot(tl.trans(dz).to(h.dtype), h, acc, input_precision=DOT_PRECISION)""",
           replace="""            acc = tl.dot(tl.trans(dz).to(h.dtype), h, input_precision=DOT_PRECISION)""",
           mistake="the dW kernel overwrites its rows with each token tile's contribution instead of adding to them: "
                   "the LM-head gradient misses the sum over token tiles (§3)",
           expect="dW = "),
    Mutant("loss-dweight-drops-last-token-tile", _LOSS,
           find="for t0 in range(0, N, BLOCK_T):",
           replace="for t0 in range(0, (N // BLOCK_T) * BLOCK_T, BLOCK_T):",
           mistake="the dW kernel visits only the whole token tiles: the tokens of the partial last tile are missing "
                   "from the LM-head gradient (§3)",
           expect="dW = "),
    Mutant("loss-dhidden-grid-drops-last-token-tile", _LOSS,
           find='fused_ce_dhidden_kernel[(triton.cdiv(n_tokens, config["BLOCK_T"]),)](',
           replace='fused_ce_dhidden_kernel[(n_tokens // config["BLOCK_T"],)](',
           mistake="the dH grid launches ⌊N / BLOCK_T⌋ programs: the rows of the partial last token tile get no "
                   "gradient (§3)",
           expect="dH = "),
    Mutant("loss-bf16-dhidden-accumulator", _LOSS,
           find="dh = torch.zeros((n_tokens, d), dtype=torch.float32, device=h2.device)",
           replace="dh = torch.zeros((n_tokens, d), dtype=h2.dtype, device=h2.device)",
           mistake="dH is accumulated across vocabulary tiles in the input dtype (bf16): every partial sum is rounded "
                   "(§3)",
           expect="accumulate in fp32"),
    Mutant("loss-bf16-dweight-accumulator", _LOSS,
           find="dw = torch.zeros((vocab, d), dtype=torch.float32, device=h2.device)",
           replace="dw = torch.zeros((vocab, d), dtype=weight.dtype, device=h2.device)",
           mistake="dW is accumulated across token tiles in the input dtype (bf16): every partial sum is rounded (§3)",
           expect="accumulate in fp32"),
]


# ------------------------------------------------------------------------ the optimizer and the step (07b §4–§7)
_BIAS_CORRECTION = ("            bias_correction1 = 1 - beta1**t\n"
                    "            bias_correction2_sqrt = (1 - beta2**t) ** 0.5\n")

STEP: list[Mutant] = [
    # §4 the fused AdamW
    Mutant("adamw-bias-correction-off-by-one", "whole_step/fused_adamw.py",
           find=_BIAS_CORRECTION,
           replace="            bias_correction1 = 1 - beta1 ** (t + 1)\n"
                   "            bias_correction2_sqrt = (1 - beta2 ** (t + 1)) ** 0.5\n",
           mistake="bias correction with t + 1: the step count after its increment is t (§4)",
           expect=r"off by one"),
    Mutant("adamw-no-bias-correction", "whole_step/fused_adamw.py",
           find=_BIAS_CORRECTION,
           replace="            bias_correction1 = 1.0\n            bias_correction2_sqrt = 1.0\n",
           mistake="no bias correction: the first steps are (1 − β₁)/√(1 − β₂) times too large (§4)",
           expect=r"no bias correction"),
    Mutant("adamw-weight-decay-coupled", "whole_step/fused_adamw.py",
           find="                torch._foreach_mul_(p_, 1 - lr * weight_decay)\n",
           replace="                g_ = torch._foreach_add(g_, p_, alpha=weight_decay)\n",
           mistake="weight decay added to the gradient (Adam with L2), not applied to the weights (§4)",
           expect=r"coupled"),
    Mutant("adamw-eps-inside-sqrt", "whole_step/fused_adamw.py",
           find="            denom = torch._foreach_sqrt(v_)\n"
                "            torch._foreach_div_(denom, bias_correction2_sqrt)\n"
                "            torch._foreach_add_(denom, eps)\n",
           replace="            denom = torch._foreach_div(v_, bias_correction2_sqrt**2)\n"
                   "            torch._foreach_add_(denom, eps)\n            torch._foreach_sqrt_(denom)\n",
           mistake="ε inside the square root: √(v̂ + ε) instead of √v̂ + ε (§4)",
           expect=r"inside the square root"),
    Mutant("adamw-master-weights-not-kept", "whole_step/fused_adamw.py",
           find="        master = group[\"master_weights\"] and p.dtype != torch.float32\n",
           replace="        master = False\n",
           mistake="no fp32 master copy: the update is applied to the bf16 parameter and small steps vanish (§4)",
           expect=r"master"),
    Mutant("adamw-moments-in-param-dtype", "whole_step/fused_adamw.py",
           find="        moment_dtype = torch.float32 if master else p.dtype\n",
           replace="        moment_dtype = p.dtype\n",
           mistake="the moments m, v of a master-weighted bf16 parameter are kept in bf16, not fp32 (§4)",
           expect=r"exp_avg"),
    Mutant("adamw-param-not-rounded-from-master", "whole_step/fused_adamw.py",
           find="            torch._foreach_copy_([params[i] for i in mastered], [targets[i] for i in mastered])\n",
           replace="            pass\n",
           mistake="the master copy is updated but the bf16 parameter is never rounded from it (§4)",
           expect=r"bf16 parameter|ulp"),
    Mutant("adamw-python-loop", "whole_step/fused_adamw.py",
           find="            torch._foreach_lerp_(m_, g_, 1 - beta1)\n",
           replace="            for m, g in zip(m_, g_):\n                m.lerp_(g, 1 - beta1)\n",
           mistake="a Python loop over the tensors (one launch per tensor) for the first moment (§4)",
           expect=r"Python loop"),
    # §5 the whole step
    Mutant("step-gradients-not-averaged", "whole_step/train_step.py",
           find="        if ddp is not None:\n            ddp.finish_gradient_synchronization()\n",
           replace="",
           mistake="never calls finish_gradient_synchronization: each rank steps on its own rows' gradient (§5)",
           expect=r"not averaged across the ranks"),
    Mutant("step-loss-not-divided-by-micro-batches", "whole_step/train_step.py",
           find="                loss = self._loss(x, y) / k\n",
           replace="                loss = self._loss(x, y)\n",
           mistake="sums the micro-batches' mean losses instead of averaging them: k× the loss and gradients (§5)",
           expect=r"2× the expected gradient"),
    Mutant("step-optimizer-step-per-micro-batch", "whole_step/train_step.py",
           find="            total += loss.detach()\n        if ddp is not None:\n"
                "            ddp.finish_gradient_synchronization()\n        self.optimizer.step()\n",
           replace="            if ddp is not None and i == k - 1:\n"
                   "                ddp.finish_gradient_synchronization()\n"
                   "            self.optimizer.step()\n            total += loss.detach()\n",
           mistake="steps the optimizer after every micro-batch, before the last one's backward (§5)",
           expect=r"parameter .* after the first step"),
    Mutant("step-no-zero-grad", "whole_step/train_step.py",
           find="        self.optimizer.zero_grad(set_to_none=True)\n",
           replace="",
           mistake="gradients are never zeroed: each step adds the previous steps' gradients (§5)",
           expect=r"loss of step 3"),
    Mutant("step-every-micro-batch-communicates", "whole_step/train_step.py",
           find="            quiet = ddp.no_sync() if ddp is not None and i < k - 1 else contextlib.nullcontext()\n",
           replace="            quiet = contextlib.nullcontext()\n",
           mistake="no no_sync(): every micro-batch's backward launches the all-reduces (§5; handout 04 §5)",
           expect=r"no_sync|became ready after the bucket was sent"),
    Mutant("step-rank-local-loss", "whole_step/train_step.py",
           find="            dist.all_reduce(total, group=self.world)\n",
           replace="",
           mistake="returns this rank's loss (divided by the world size), not the global batch's mean (§5)",
           expect=r"loss of step 1"),
    Mutant("step-seed-after-model", "whole_step/train_step.py",
           find="    torch.manual_seed(config.seed)\n    model = TransformerLM(config.model).to(device)\n",
           replace="    model = TransformerLM(config.model).to(device)\n    torch.manual_seed(config.seed)\n",
           mistake="seeds after building the model: its weights are not the seeded ones (§5)",
           expect=r"seeded"),
]


# Issue 40: mistakes written by students who had not seen this catalogue, each one a public test now catches.
ISSUE_40_LOSS_AND_ADAMW = [
    Mutant("issue40-adamw-master-copy-only-for-bf16", "whole_step/fused_adamw.py",
           find="        master = group[\"master_weights\"] and p.dtype != torch.float32\n",
           replace="        master = group[\"master_weights\"] and p.dtype == torch.bfloat16\n",
           mistake="master weights only for bf16: fp16 parameters are updated in fp16, and updates below half an fp16 "
                   "ulp (lr 1e-4 at |p| ≥ 0.5) are lost (07b §4)",
           expect=r"fp16 parameter"),
    Mutant("issue40-loss-row-stride-assumed-d", _LOSS,
           find="h2.stride(0), weight.stride(0)", replace="d, d", count=3,
           mistake="the kernels take d as the row stride of hidden and weight: wrong for valid views whose rows are "
                   "farther apart, such as big[:, :d] (§2)",
           expect=r"row stride"),
    Mutant("issue40-loss-dweight-from-hidden-needs-grad", _LOSS,
           find="need_weight_grad=ctx.needs_input_grad[1]", replace="need_weight_grad=ctx.needs_input_grad[0]",
           mistake="whether dW is computed is read from needs_input_grad[0] (hidden) instead of [1] (weight): detached "
                   "hidden states leave the LM head without a gradient (§3)",
           expect=r"frozen"),
    Mutant("issue40-adamw-decay-factor-cached-per-group", "whole_step/fused_adamw.py",
           find="                torch._foreach_mul_(p_, 1 - lr * weight_decay)\n",
           replace="                torch._foreach_mul_(p_, group.setdefault(\"decay\", 1 - lr * weight_decay))\n",
           mistake="the decay factor 1 − lr·λ is computed once per group and cached: a learning-rate schedule (or a "
                   "new weight decay) no longer reaches it (07b §4)",
           expect=r"schedule"),
    Mutant("issue40-loss-dhidden-reads-past-the-vocabulary", _LOSS,
           find="mask=(cols < V)[:, None] & d_ok[None, :]", replace="mask=d_ok[None, :]",
           mistake="the dH kernel loads W's tile without the vocabulary mask: rows past V are read (0·garbage, NaN "
                   "when the memory after W holds NaN) (§3)",
           expect=r"past the end of W"),
    Mutant("issue40-loss-gpu-bf16-tiles-too-large", _LOSS,
           find='torch.bfloat16: {"BLOCK_T": 64, "BLOCK_V": 128, "BLOCK_D": 32, "num_warps": 8, "num_stages": 3}',
           replace='torch.bfloat16: {"BLOCK_T": 128, "BLOCK_V": 256, "BLOCK_D": 128, "num_warps": 8, "num_stages": 4}',
           mistake="bf16 GPU tiles of 128 × 256 × 128 with 4 stages need 393,216 B of shared memory, more than an H100 "
                   "block has (232,448): every bf16 launch on a GPU fails (§3)",
           expect=r"shared memory"),
    Mutant("issue40-loss-tiles-shrunk-below-16", _LOSS,
           find="    config = launch_config(h2.dtype)\n", count=2,
           replace="    config = launch_config(h2.dtype)\n"
                   "    config[\"BLOCK_T\"] = min(config[\"BLOCK_T\"], triton.next_power_of_2(n_tokens))\n"
                   "    config[\"BLOCK_D\"] = min(config[\"BLOCK_D\"], triton.next_power_of_2(d))\n",
           mistake="tiles shrunk to the input for small inputs: below 16, tl.dot does not compile for a GPU (K ≥ 16), "
                   "though the interpreter runs it (§3)",
           expect=r"K ≥ 16"),
]

ISSUE_40_STEP = [
    # (entries for the step go here)
    Mutant("step-lm-head-detached-under-autocast", "whole_step/train_step.py",
           find="            out, weight = out.to(torch.bfloat16), weight.to(torch.bfloat16)\n",
           replace="            out, weight = out.to(torch.bfloat16), weight.detach().to(torch.bfloat16)\n",
           mistake="under bf16_autocast the fused loss gets a detached bf16 copy of lm_head.weight: the LM head "
                   "never gets a gradient and never trains (§5 point 5)",
           expect=r"no gradient after the first step for \['lm_head\.weight'\]"),
    Mutant("step-bf16-weights-without-master", "whole_step/train_step.py",
           find='master_weights=config.dtype == "bf16")', replace="master_weights=False)",
           mistake="bf16 weights updated by FusedAdamW without master weights: an update of lr = 1e-3 is below "
                   "half a bf16 spacing at |p| = 1, so the RMSNorm gains never move (§4, §5)",
           expect=r"moved 0 of"),
    Mutant("step-autocast-never-enabled", "whole_step/train_step.py",
           find='enabled=self.config.dtype == "bf16_autocast")', replace='enabled=self.config.dtype == "bf16")',
           mistake="autocast enabled for the wrong dtype choice: bf16_autocast silently runs every matmul in fp32 "
                   "(§5)",
           expect=r"bf16 matmul"),
    Mutant("step-autocast-device-hard-coded-cpu", "whole_step/train_step.py",
           find="autocast = torch.autocast(x.device.type, dtype=torch.bfloat16,",
           replace='autocast = torch.autocast("cpu", dtype=torch.bfloat16,',
           mistake="autocast's device_type hard-coded to \"cpu\": on a GPU the CUDA matmuls stay fp32, silently "
                   "(§5)",
           expect=r"bf16 matmul",
           needs_gpu="on a CPU autocast('cpu') is the right call; on a GPU "
                     "test_step_bf16_autocast_multiplies_in_bf16 runs the step on CUDA and counts fp32 matmuls"),
    Mutant("step-naive-loss-in-bf16", "whole_step/train_step.py",
           find="            return cross_entropy(out, y)\n",
           replace="            return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())\n",
           mistake="the naive loss taken straight on the bf16 logits under bf16_autocast: log-softmax and the mean "
                   "over tokens run in bf16 and the loss is rounded to bf16, up to 0.4 % off (§5)",
           expect=r"rounded to bf16"),
    Mutant("step-checkpointing-loop-variable-rebound", "whole_step/train_step.py",
           find="            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)\n",
           replace="            block = functools.partial(checkpoint, block, use_reentrant=False)\n",
           mistake="activation checkpointing rebinds the loop variable instead of the block's forward: nothing is "
                   "checkpointed, every block keeps its activations (§5, §7)",
           expect=r"bytes of tensors for backward"),
    Mutant("step-all-reduce-every-micro-batch", "whole_step/train_step.py",
           find="""            quiet = ddp.no_sync() if ddp is not None and i < k - 1 else contextlib.nullcontext()
            with quiet:
                loss = self._loss(x, y) / k
                loss.backward()
            total += loss.detach()
        if ddp is not None:
            ddp.finish_gradient_synchronization()
""",
           replace="""            loss = self._loss(x, y) / k
            loss.backward()
            if ddp is not None:
                ddp.finish_gradient_synchronization()  # each micro-batch's gradients averaged at once
            total += loss.detach()
""",
           mistake="every micro-batch's gradients are all-reduced as soon as its backward ends instead of once per "
                   "step under no_sync: right numbers, k times the communication (§5 point 3; handout 04 §5)",
           expect=r"all-reduced .* bytes"),
    Mutant("step-flash-triton-runs-pytorch", "whole_step/train_step.py",
           find='    if name == "flash_triton":\n        return flash_attention_fn\n',
           replace='    if name == "flash_triton":\n'
                   '        return functools.partial(_flash_pytorch, flash_attention)\n',
           mistake="attention='flash_triton' runs the PyTorch FlashAttention: right numbers, no Triton kernel (§5)",
           expect=r"Triton"),
]


MUTANTS = FUSED_LOSS + STEP + ISSUE_40_LOSS_AND_ADAMW + ISSUE_40_STEP
