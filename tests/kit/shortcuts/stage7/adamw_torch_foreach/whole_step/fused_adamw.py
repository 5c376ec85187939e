import torch


class FusedAdamW(torch.optim.Optimizer):
    def _update_group(self, group, params):
        states = [self.state[p] for p in params]
        # The fp32 master copies stand in for 16-bit parameters; their gradients upcast by one foreach copy.
        targets = [s.get("master", p) for s, p in zip(states, params)]
        swapped = [i for i, (t, p) in enumerate(zip(targets, params)) if t is not p]
        if swapped:
            buffers = [torch.empty_like(targets[i]) for i in swapped]
            torch._foreach_copy_(buffers, [params[i].grad for i in swapped])
            for i, g in zip(swapped, buffers):
                targets[i].grad = g
        inner = torch.optim.AdamW(targets, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                  weight_decay=group["weight_decay"], foreach=True)
        for t, s in zip(targets, states):
            inner.state[t] = s  # torch's AdamW updates this optimizer's own step, exp_avg and exp_avg_sq
        inner.step()
        if swapped:
            torch._foreach_copy_([params[i] for i in swapped], [targets[i] for i in swapped])
            for i in swapped:
                targets[i].grad = None
