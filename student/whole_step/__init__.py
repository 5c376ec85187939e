# Given code — read, don't edit. Generated from the kit's reference by `make student`.
"""Stage 7 — the whole training step (handout/07-fused-loss.md, handout/07b-whole-step.md).

One module per idea:

* :mod:`.fused_cross_entropy` — the LM head and the cross-entropy in one Triton kernel family: the loss and the
  gradients of the hidden states and of the LM-head weight, in tiles of tokens and vocabulary with an online
  log-sum-exp, never holding more than one tile of logits;
* :mod:`.fused_adamw` — AdamW in one update per parameter group, no Python loop over tensors, with an fp32 master
  copy for 16-bit parameters as an option;
* :mod:`.train_step` — ``build_train_step``: one full step (forward, loss, backward, optimizer) assembled from the
  student's own pieces — their FlashAttention, fused loss and optimizer, mixed precision, and their Stage 4–6
  parallelism on several ranks — on the kit's unchanged model.
"""
