import torch


class FusedAdamW(torch.optim.AdamW):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, master_weights=False):
        _check_options(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, master_weights=master_weights)
        params = list(params)
        if params and isinstance(params[0], dict):
            params = [{"master_weights": master_weights, **g} for g in params]
        elif params:
            params = [{"params": params, "master_weights": master_weights}]
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=True)
        self.defaults["master_weights"] = master_weights

    @torch.no_grad()
    def step(self, closure=None):
        # Swap an fp32 copy in for each 16-bit parameter (its .data and .grad), let AdamW step, round back: the
        # upcasts and the rounding as foreach copies.
        swapped = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or not group.get("master_weights", False) or p.dtype == torch.float32:
                    continue
                swapped.append((p, p.data, p.grad, self.state[p].get("master")))
        fresh = [i for i, (_, _, _, master) in enumerate(swapped) if master is None]
        if fresh:
            copies = [torch.empty_like(swapped[i][1], dtype=torch.float32) for i in fresh]
            torch._foreach_copy_(copies, [swapped[i][1] for i in fresh])
            for i, c in zip(fresh, copies):
                swapped[i] = (*swapped[i][:3], c)
        grads32 = [torch.empty_like(master) for *_, master in swapped]
        if swapped:
            torch._foreach_copy_(grads32, [grad for _, _, grad, _ in swapped])
        for (p, _, _, master), g in zip(swapped, grads32):
            p.grad = None
            p.data = master
            p.grad = g
        try:
            loss = super().step(closure)
        finally:
            for p, _, _, master in swapped:
                self.state[p]["master"] = master
            if swapped:
                torch._foreach_copy_([low for _, low, _, _ in swapped], [master for *_, master in swapped])
            for p, low, grad, _ in swapped:
                p.grad = None
                p.data = low
                p.grad = grad
        return loss
