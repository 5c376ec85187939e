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
                   "inside a kernel — the memory the fused loss exists to save (§1–§2)",
           expect="materialised"),
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
STEP: list[Mutant] = [
]


MUTANTS = FUSED_LOSS + STEP
