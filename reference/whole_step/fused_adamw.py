"""AdamW, fused: one update per parameter group, no Python loop over its tensors (handout 07b §4).

Public API (the tests call exactly this):

    FusedAdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, master_weights=False)

a ``torch.optim.Optimizer`` whose ``step()`` updates each parameter group without a Python loop over its
tensors, equal to ``torch.optim.AdamW`` (decoupled weight decay, bias correction) up to rounding; with
``master_weights=True`` 16-bit parameters are updated through an fp32 copy kept in the optimizer state.

The update, for one parameter p with gradient g at step t (counted from 1, *after* this step's increment):

    p ← p · (1 − lr·λ)                       decoupled weight decay: on the weights, never in the gradient
    m ← β₁·m + (1 − β₁)·g                     first moment   (a lerp of m towards g)
    v ← β₂·v + (1 − β₂)·g²                    second moment
    p ← p − lr/(1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)    bias-corrected, ε outside the square root

**Why ``torch._foreach_*`` is "fused".** Each line above is one ``torch._foreach_*`` call over *all* the
tensors of the group: on CUDA it is one multi-tensor-apply kernel launch per operation (the tensors' pointers
are packed into the kernel's arguments, a few dozen tensors per launch), so a step costs ~8 launches per group
instead of ~8 per parameter, and no Python runs per parameter; on a CPU the loop over tensors runs in C++. It
is not one kernel for the whole update (``torch.optim.AdamW(fused=True)`` is: it reads p, g, m, v once and
writes p, m, v once); each ``_foreach`` operation reads and writes its operands through memory. Handout 07b §4
counts the bytes of both.

**How close to torch.** The operations are those of ``torch.optim.AdamW``'s multi-tensor path
(``torch/optim/adam.py``, ``_multi_tensor_adam``, which its single-tensor path repeats op for op), in the same
order, with the same Python-float scalars: the result is equal **bit for bit** (``tests/kit`` checks it). A
different but equally correct order (say ``m̂ = m / (1 − β₁ᵗ)`` formed first) differs by a few fp32 roundings
per step; the graded tests allow that (tests/test_stage7_adamw.py derives the tolerance).

**Master weights.** With ``master_weights=True`` a parameter whose dtype is not fp32 gets
``state["master"]``, an fp32 copy; the moments ``exp_avg``/``exp_avg_sq`` are fp32; the gradient is upcast,
the update is applied to the master, and the parameter is rounded from the master after each step (round to
nearest even). Without it a bf16 update ``lr·…`` smaller than half a bf16 unit in the last place of ``p`` is
lost entirely (handout 07b §4). fp32 parameters are updated in place either way.

State per parameter (the keys of ``torch.optim.AdamW``, so a state dict moves between the two): ``step``
(a 0-dim fp32 tensor on the CPU), ``exp_avg``, ``exp_avg_sq``, and ``master`` with master weights.
``load_state_dict`` keeps fp32 state in fp32 (``torch.optim.Optimizer``'s would cast it to the parameter's
dtype).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from kit.validate import instance, number

__all__ = ["FusedAdamW"]


class FusedAdamW(torch.optim.Optimizer):
    """AdamW with one ``torch._foreach_*`` call per operation per parameter group (see the module docstring).

    Args:
        params: tensors, or param-group dicts with per-group options (``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``master_weights``).
        lr: learning rate, ≥ 0.
        betas: ``(β₁, β₂)``, each in ``[0, 1)``.
        eps: added to the bias-corrected √v, ≥ 0.
        weight_decay: decoupled weight decay λ (the weights shrink by ``lr·λ`` per step), ≥ 0.
        master_weights: keep an fp32 copy of every non-fp32 parameter and fp32 moments (keyword only).

    Raises:
        TypeError: an option of the wrong type (``betas`` not a pair of numbers, ``master_weights`` not a bool).
        ValueError: an option out of range, no parameters, or (at ``step``) a sparse gradient.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 master_weights: bool = False):
        _check_options(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, master_weights=master_weights)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      master_weights=master_weights))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer``'s, with the group's own options checked like the constructor's."""
        options = {k: param_group[k] for k in ("lr", "betas", "eps", "weight_decay", "master_weights")
                   if k in param_group}
        _check_options(**options)
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW update of every parameter that has a gradient; returns ``closure()``'s loss if given.

        Parameters whose ``.grad`` is None are skipped (their state and step count do not change), as
        ``torch.optim.AdamW`` skips them.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # BEGIN SCAFFOLD per group: the parameters with a gradient, their state created once, one fused update (07b §4)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise ValueError("FusedAdamW does not support sparse gradients (as torch.optim.AdamW)")
            for p in params:
                if not self.state[p]:
                    self._init_state(p, group)
            self._update_group(group, params)
        return loss
        # END SCAFFOLD

    # -------------------------------------------------------------------------------------------- your part

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        """Create ``self.state[p]`` before p's first update: ``step`` (a 0-dim fp32 CPU tensor, 0), ``exp_avg``
        and ``exp_avg_sq`` (zeros of p's shape), and with master weights for a non-fp32 p: ``master`` (an fp32
        copy of p) and fp32 moments."""
        # BEGIN SOLUTION step, exp_avg, exp_avg_sq; an fp32 master copy and fp32 moments for 16-bit p (handout 07b §4)
        state = self.state[p]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        master = group["master_weights"] and p.dtype != torch.float32
        moment_dtype = torch.float32 if master else p.dtype
        state["exp_avg"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)
        if master:
            state["master"] = p.detach().to(torch.float32, copy=True)
        # END SOLUTION

    def _update_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """One AdamW update of ``params`` (the group's parameters that have a gradient, state initialised),
        one ``torch._foreach_*`` call per operation: no Python loop that launches work per tensor."""
        lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        states = [self.state[p] for p in params]
        # BEGIN SOLUTION one foreach call per operation: step, decay, m, v, update, master copy (handout 07b §4)
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        # Where the update happens: the fp32 master copy if there is one, else the parameter itself.
        targets = [s.get("master", p) for s, p in zip(states, params)]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        # The gradient in the moments' dtype: 16-bit gradients of master-weighted parameters are upcast into fresh
        # fp32 buffers (allocations, no kernels) by one foreach copy.
        grads = [p.grad for p in params]
        upcast = [i for i, (g, m) in enumerate(zip(grads, exp_avgs)) if g.dtype != m.dtype]
        if upcast:
            buffers = [torch.empty_like(exp_avgs[i]) for i in upcast]
            torch._foreach_copy_(buffers, [grads[i] for i in upcast])
            for i, g in zip(upcast, buffers):
                grads[i] = g
        # Parameters that missed earlier steps have a smaller step count: one bias correction per distinct count
        # (normally one).
        by_step: dict[float, list[int]] = {}
        for i, s in enumerate(steps):
            by_step.setdefault(float(s), []).append(i)
        for t, idx in by_step.items():
            p_, g_, m_, v_ = ([xs[i] for i in idx] for xs in (targets, grads, exp_avgs, exp_avg_sqs))
            if weight_decay != 0:
                torch._foreach_mul_(p_, 1 - lr * weight_decay)
            torch._foreach_lerp_(m_, g_, 1 - beta1)
            torch._foreach_mul_(v_, beta2)
            torch._foreach_addcmul_(v_, g_, g_, 1 - beta2)
            bias_correction1 = 1 - beta1**t
            bias_correction2_sqrt = (1 - beta2**t) ** 0.5
            denom = torch._foreach_sqrt(v_)
            torch._foreach_div_(denom, bias_correction2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(p_, m_, denom, -(lr / bias_correction1))
        mastered = [i for i, (x, p) in enumerate(zip(targets, params)) if x is not p]
        if mastered:  # round each parameter from its master copy (to nearest even), all in one foreach copy
            torch._foreach_copy_([params[i] for i in mastered], [targets[i] for i in mastered])
        # END SOLUTION

    # ----------------------------------------------------------------------------------------------- given

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but state saved in fp32 (master copies, fp32 moments of
        16-bit parameters) stays fp32 instead of being cast to the parameter's dtype."""
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for param_id, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(param_id, {}).items():
                if key != "step" and isinstance(value, torch.Tensor) and value.dtype != p.dtype:
                    self.state[p][key] = value.detach().to(p.device, copy=True)


def _check_options(**options: Any) -> None:
    """The constructor's (and ``add_param_group``'s) argument checks, for the options given."""
    for name in ("lr", "eps", "weight_decay"):
        if name in options:
            number(name, options[name], at_least=0)
    if "betas" in options:
        betas = instance("betas", options["betas"], (tuple, list), "a pair (beta1, beta2)")
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {len(betas)} values")
        for name, beta in zip(("betas[0]", "betas[1]"), betas):
            number(name, beta, at_least=0, below=1)
    if "master_weights" in options:
        instance("master_weights", options["master_weights"], bool, "a bool")
