"""Stage 3 mistakes (handout/03-flash-attention.md): each must fail a public test with a message that points at it."""

from instructor.mutants import Mutant

# The PyTorch forward's tile loop, and the same loop kept in the input dtype (no .float(), fp16 m/l/acc).
_FP32_FORWARD = '''            q_tile = q[..., i0:i1, :].float()
            m = torch.full((*lead, i1 - i0), float("-inf"), device=q.device)  # running row maximum
            l = torch.zeros((*lead, i1 - i0), device=q.device)  # running Σ exp(s − m)
            acc = torch.zeros((*lead, i1 - i0, d), device=q.device)  # running Σ exp(s − m) v
            # Causal: query rows i0 … i1−1 see keys j ≤ i1−1 only, so key tiles from i1 on are skipped.
            k_end = min(nk, i1) if is_causal else nk
            for j0 in range(0, k_end, Bk):
                j1 = min(j0 + Bk, nk)
                s = (q_tile @ k[..., j0:j1, :].float().transpose(-2, -1)) * scale  # (..., Bq, Bk) — one tile
                if is_causal and j1 - 1 > i0:  # the tile reaches above the diagonal: mask exactly
                    rows = torch.arange(i0, i1, device=q.device)[:, None]
                    cols = torch.arange(j0, j1, device=q.device)[None, :]
                    s = s.masked_fill(cols > rows, float("-inf"))
                # Key 0 is in the first tile and every row sees it, so m is finite from the first step on
                # and exp(-inf - m) = 0 excludes masked scores exactly.
                m_new = torch.maximum(m, s.amax(dim=-1))
                p = torch.exp(s - m_new[..., None])
                alpha = torch.exp(m - m_new)  # rescales what was accumulated under the old maximum
                l = alpha * l + p.sum(dim=-1)
                acc = alpha[..., None] * acc + p @ v[..., j0:j1, :].float()
'''
_FP16_FORWARD = (_FP32_FORWARD.replace(".float()", "")
                 .replace("device=q.device)", "device=q.device, dtype=q.dtype)"))
# Only the output accumulator kept in the input dtype (m, l and L stay fp32, so L is right).
_ACC16_FORWARD = (_FP32_FORWARD.replace("acc = torch.zeros((*lead, i1 - i0, d), device=q.device)",
                                        "acc = torch.zeros((*lead, i1 - i0, d), device=q.device, dtype=q.dtype)")
                  .replace("acc = alpha[..., None] * acc + p @ v[..., j0:j1, :].float()",
                           "acc = (alpha[..., None] * acc + p @ v[..., j0:j1, :].float()).to(q.dtype)"))

MUTANTS = [
    # ---------------------------------------------------------------- PyTorch (§1–§4)
    Mutant("pytorch-no-causal-skip", "flash_attention/pytorch_impl.py",
           find="k_end = min(nk, i1) if is_causal else nk",
           replace="k_end = nk",
           mistake="the causal forward visits every key tile, masking the hidden ones instead of skipping them "
                   "(§4: skip tiles the mask hides entirely)",
           expect="causal forward.*Skip the key tiles"),
    Mutant("pytorch-fp16-accumulator", "flash_attention/pytorch_impl.py",
           find=_FP32_FORWARD,
           replace=_FP16_FORWARD,
           mistake="the forward keeps q, m, l and acc in the input dtype: fp16 running sums overflow and round (§2)",
           expect="overflow|accumulate l and acc in fp32|FlashAttentionPytorch torch.(float16|bfloat16)"),
    Mutant("pytorch-fp16-output-accumulator", "flash_attention/pytorch_impl.py",
           find=_FP32_FORWARD,
           replace=_ACC16_FORWARD,
           mistake="the forward keeps acc = Σ p·v in the input dtype between key tiles: fp16 overflows past "
                   "65,504 and rounds each step (§2)",
           expect="overflow|accumulate l and acc in fp32"),
    Mutant("pytorch-no-softmax-scale", "flash_attention/pytorch_impl.py",
           find="s = (q_tile @ k[..., j0:j1, :].float().transpose(-2, -1)) * scale",
           replace="s = q_tile @ k[..., j0:j1, :].float().transpose(-2, -1)",
           mistake="the forward scores are q·k without the 1/√D scale (§1)",
           expect="FlashAttentionPytorch.*(O|L)"),
    Mutant("pytorch-delta-rowsum-do", "flash_attention/pytorch_impl.py",
           find="delta = (do * o.float()).sum(dim=-1)",
           replace="delta = do.sum(dim=-1)",
           mistake="D computed as rowsum(dO) instead of rowsum(dO ∘ O) (§3)",
           expect=r"d[QK] \(FlashAttentionPytorch"),
    # ---------------------------------------------------------------- Triton forward (§5)
    Mutant("triton-ignores-dot-precision", "flash_attention/triton_forward.py",
           find="qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)",
           replace="qk = tl.dot(q, tl.trans(k))",
           mistake="the forward's score tl.dot ignores DOT_PRECISION: fp32 runs in TF32 on a GPU, invisible to the "
                   "interpreter (§5)",
           expect="TF32"),
    Mutant("triton-bh-offset-32-bit", "flash_attention/triton_forward.py",
           find="bh = tl.program_id(0).to(tl.int64)  # 64-bit",
           replace="bh = tl.program_id(0)  # 64-bit",
           mistake="the forward multiplies the 32-bit batch·head id by the batch stride: overflows past 2³¹ "
                   "elements on a GPU, invisible at test sizes (§5)",
           expect="32 bits.*int64"),
    Mutant("triton-no-log2e", "flash_attention/triton_forward.py",
           find="qk_scale = LOG2E / math.sqrt(d)",
           replace="qk_scale = 1.0 / math.sqrt(d)",
           mistake="the forward uses exp2 but forgets to scale the scores by log2(e) (§5)",
           expect="FlashAttentionTriton.*(O|L)"),
    Mutant("triton-forgets-alpha", "flash_attention/triton_forward.py",
           find="        acc = acc * alpha[:, None]\n",
           replace="",
           mistake="the online softmax does not rescale the accumulator when the running maximum grows (§1, §5)",
           expect="FlashAttentionTriton.*O"),
    Mutant("triton-L-without-log", "flash_attention/triton_forward.py",
           find="(m_i + tl.math.log2(l_i)) * 0.6931471805599453",
           replace="(m_i + l_i) * 0.6931471805599453",
           mistake="L stored as m + l instead of m + log l (§2)",
           expect="L = logsumexp"),
    Mutant("triton-causal-mask-strict", "flash_attention/triton_forward.py",
           find="keep = keep & (offs_m[:, None] >= offs_n[None, :])",
           replace="keep = keep & (offs_m[:, None] > offs_n[None, :])",
           mistake="causal mask off by one: query i does not see key i (§4)",
           expect="FlashAttentionTriton.*causal=True"),
    Mutant("triton-no-bf16-upcast", "flash_attention/triton_forward.py",
           find="if UPCAST:",
           replace="if False:",
           count=2,
           mistake="the forward kernel ignores UPCAST: bf16 tl.dot is garbage in the 3.6 interpreter (§5)",
           expect="bfloat16"),
    Mutant("triton-peeled-forward-drops-last-tile", "flash_attention/triton_forward.py",
           find="qk_scale, nk_full, Nk, BLOCK_N, False, True, UPCAST, DOT_PRECISION)",
           replace="qk_scale, nk_full, nk_full, BLOCK_N, False, True, UPCAST, DOT_PRECISION)",
           mistake="the forward runs the unmasked loop over the whole key tiles and forgets the partial last tile "
                   "(keys nk_full … Nk−1) that boundary peeling leaves over (§5)",
           expect="FlashAttentionTriton.*causal=False"),
    Mutant("triton-heavy-first-off-by-one", "flash_attention/triton_forward.py",
           find="start_m = (tl.cdiv(Nq, BLOCK_M) - 1 - tl.program_id(1)) * BLOCK_M",
           replace="start_m = (tl.cdiv(Nq, BLOCK_M) - tl.program_id(1)) * BLOCK_M",
           mistake="reversing the causal tile order (heavy tiles first) off by one: query tile 0 is never "
                   "computed and one program runs past Nq (§5)",
           expect="FlashAttentionTriton.*causal=True"),
    # ---------------------------------------------------------------- Triton backward (§6)
    Mutant("triton-delta-rowsum-do", "flash_attention/triton_backward.py",
           find="delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)",
           replace="delta = tl.sum(do.to(tl.float32), axis=1)",
           mistake="Delta computed as rowsum(dO) instead of rowsum(dO ∘ O) (§3, §6)",
           expect=r"d[QK] \(FlashAttentionTriton"),
    Mutant("triton-dk-unscaled", "flash_attention/triton_backward.py",
           find="dk = dk * sm_scale  # s = q·k/√D",
           replace="dk = dk  # s = q·k/√D",
           mistake="dK misses the 1/√D of ∂s/∂k (§3)",
           expect="dK"),
    Mutant("triton-dq-fma-without-scale", "flash_attention/triton_backward.py",
           find="p = tl.math.exp2(qk * qk_scale - lse2[:, None])  # one FMA per element",
           replace="p = tl.math.exp2(qk - lse2[:, None])  # one FMA per element",
           mistake="the dQ kernel's unmasked tiles recompute P from unscaled scores: the scale folded into the "
                   "FMA is dropped where no mask applies (§5, §6)",
           expect=r"dQ \(FlashAttentionTriton"),
    Mutant("triton-dkdv-drops-last-query-tile", "flash_attention/triton_backward.py",
           find="Nq, qk_scale, nq_full, Nq, BLOCK_M, False, True, UPCAST, DOT_PRECISION)",
           replace="Nq, qk_scale, nq_full, nq_full, BLOCK_M, False, True, UPCAST, DOT_PRECISION)",
           mistake="the non-causal dK/dV kernel streams only the whole query tiles and forgets the partial last "
                   "one (rows nq_full … Nq−1) that boundary peeling leaves over (§6)",
           expect=r"d[KV] \(FlashAttentionTriton .*causal=False"),
    Mutant("triton-dkdv-grid-skips-unreached-keys", "flash_attention/triton_backward.py",
           find='return (bh, triton.cdiv(nk, meta["BLOCK_N"]))',
           replace='return (bh, triton.cdiv(min(nk, nq) if is_causal else nk, meta["BLOCK_N"]))',
           mistake="causal with Nq < Nk: no program for key tiles no query reaches, so their dK/dV stay "
                   "uninitialised (§4, §6)",
           expect=r"exactly 0|d[KV] \(FlashAttentionTriton .*causal=True"),
    Mutant("triton-strides-assume-contiguous", "flash_attention/triton_forward.py",
           find="q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1),",
           replace="nq * d, d, nk * d, d, nk * d, d,",
           mistake="the launcher assumes contiguous (BH, N, D) inputs instead of passing the real strides (§5)",
           expect="strides|permute"),
    # ---------------------------------------------------------------- Triton fused backward (§6, optional)
    Mutant("fused-dq-unscaled", "flash_attention/triton_backward_fused.py",
           find="dq = tl.dot(tl.trans(dsT), k, input_precision=DOT_PRECISION) * sm_scale",
           replace="dq = tl.dot(tl.trans(dsT), k, input_precision=DOT_PRECISION)",
           mistake="the fused backward adds dS k to dQ without the 1/√D of ∂s/∂q (§3, §6)",
           expect=r"dQ \(FlashAttentionTriton .*backward design 'fused'"),
    Mutant("fused-delta-forgotten", "flash_attention/triton_backward_fused.py",
           find="dsT = (pT * (dpT - delta[None, :])).to(q.dtype)",
           replace="dsT = (pT * dpT).to(q.dtype)",
           mistake="the fused backward forms dS = P ∘ dP, forgetting to subtract D = rowsum(dO ∘ O) (§3)",
           expect=r"d[QK] \(FlashAttentionTriton .*backward design 'fused'"),
    Mutant("fused-float-atomic-dq", "flash_attention/triton_backward_fused.py",
           find='''    done = tl.atomic_add(counter, 0, sem="acquire")  # read with acquire semantics
    if WAIT_FOR_TURN:
        while done < turn:
            done = tl.atomic_add(counter, 0, sem="acquire")
    else:
        # The interpreter runs one program at a time, to completion, so a wait could never end. It visits
        # batch·heads in the outer loop and key tiles in ascending order inside it — the order waited for —
        # so the turn has always come; should it not have, the sum is poisoned (NaN) instead of hanging.
        dq = tl.where(done == turn, dq, float("nan"))
    if CHECK_ROWS:
        old = tl.load(acc_ptrs, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        tl.store(acc_ptrs, old + dq, mask=row_ok[:, None])
    else:
        old = tl.load(acc_ptrs, cache_modifier=".cg")
        tl.store(acc_ptrs, old + dq)
    tl.debug_barrier()  # every thread's store is done before the counter says so
    tl.atomic_xchg(counter, turn + 1, sem="release")
''',
           replace="    tl.atomic_add(acc_ptrs, dq, mask=row_ok[:, None])\n",
           mistake="the fused backward adds dQ with tl.atomic_add: correct sums, but in whatever order the GPU "
                   "runs the programs, so two runs differ in the last bits (§6)",
           expect="floating-point atomic"),
    Mutant("fused-turn-not-passed-on", "flash_attention/triton_backward_fused.py",
           find='    tl.atomic_xchg(counter, turn + 1, sem="release")\n',
           replace="",
           mistake="the fused backward adds its dQ but never advances the counter, so the next key tile's turn "
                   "never comes (on a GPU it would wait for ever) (§6)",
           expect=r"dQ \(FlashAttentionTriton .*backward design 'fused'"),
    Mutant("fused-accumulator-uninitialised", "flash_attention/triton_backward_fused.py",
           find="dq_acc = torch.zeros((bh, nq, d), dtype=torch.float32, device=q.device)",
           replace="dq_acc = torch.empty((bh, nq, d), dtype=torch.float32, device=q.device)",
           mistake="the dQ accumulator comes from torch.empty: the first key tile adds to garbage (§6)",
           expect="dQ has non-finite values|dQ \\(FlashAttentionTriton"),
    Mutant("triton-backward-swaps-dk-dv", "flash_attention/triton_impl.py",
           find="        return dq, dk, dv, None\n",
           replace="        return dq, dv, dk, None\n",
           mistake="the autograd wrapper hands back its gradients in the wrong order: dV as k's gradient and dK as "
                   "v's (backward returns one gradient per forward input, in order; §6)",
           expect=r"d[KV] \(FlashAttentionTriton"),
]
