"""Stage 7 mistakes (handout/07-fused-loss.md, handout/07b-whole-step.md).

Each must fail a public test with a message that points at it.
"""

from instructor.mutants import Mutant

# ------------------------------------------------------------------------------------ the fused loss (07 §1–§3)
FUSED_LOSS: list[Mutant] = [
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


MUTANTS = FUSED_LOSS + STEP
