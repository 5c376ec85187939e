import torch


class FusedAdamW(torch.optim.Optimizer):
    def _update_group(self, group, params):
        lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        targets = [s.get("master", p) for s, p in zip(states, params)]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        grads = [p.grad for p in params]
        upcast = [i for i, (g, m) in enumerate(zip(grads, exp_avgs)) if g.dtype != m.dtype]
        if upcast:  # 16-bit gradients of master-weighted parameters, into fp32 buffers by one foreach copy
            buffers = [torch.empty_like(exp_avgs[i]) for i in upcast]
            torch._foreach_copy_(buffers, [grads[i] for i in upcast])
            for i, g in zip(upcast, buffers):
                grads[i] = g
        groups_by_step = {}
        for i, s in enumerate(steps):
            groups_by_step.setdefault(float(s), []).append(i)
        for t, idx in groups_by_step.items():
            p_, g_, m_, v_ = ([xs[i] for i in idx] for xs in (targets, grads, exp_avgs, exp_avg_sqs))
            # the moments, as the paper writes them
            torch._foreach_mul_(m_, beta1)
            torch._foreach_add_(m_, g_, alpha=1 - beta1)
            torch._foreach_mul_(v_, beta2)
            torch._foreach_addcmul_(v_, g_, g_, 1 - beta2)
            # bias-corrected copies, then the step
            m_hat = torch._foreach_div(m_, 1 - beta1**t)
            v_hat = torch._foreach_div(v_, 1 - beta2**t)
            denom = torch._foreach_sqrt(v_hat)
            torch._foreach_add_(denom, eps)
            update = torch._foreach_div(m_hat, denom)
            if weight_decay != 0:
                torch._foreach_mul_(p_, 1 - lr * weight_decay)
            torch._foreach_add_(p_, update, alpha=-lr)
        mastered = [i for i, (x, p) in enumerate(zip(targets, params)) if x is not p]
        if mastered:
            torch._foreach_copy_([params[i] for i in mastered], [targets[i] for i in mastered])
