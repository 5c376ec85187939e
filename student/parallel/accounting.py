# Your work goes in this file. Generated from the kit's reference by `make student`.
"""Memory per device and communication per step, on paper (handout 06 §6; context parallelism: 06b §6).

Two questions decide a 4D layout before any code runs: *does the training state fit?* and *how many
bytes does each axis move per step?* This module answers both with closed forms, and the tests check the
communication counts against the bytes a real training step hands to each collective.

Conventions. Mixed-precision Adam as in the ZeRO paper (Rajbhandari et al., 2019): per parameter 2 bytes
of 16-bit weights, 2 of 16-bit gradients, 12 of fp32 optimizer state (master weights, momentum, variance)
— 16Ψ bytes for Ψ parameters. Communication volumes are **payload bytes per rank**: the size of the
tensors this rank passes to each collective (what a wrapped ``dist.all_reduce`` sees), not the bytes on
the wire (a ring all-reduce of ``n`` bytes over ``g`` ranks sends ``2n(g−1)/g`` from each rank).
"""

from __future__ import annotations

import math

from kit.validate import choice, index, instance, positive_int, positive_number

from .expert_parallel import expert_capacity
from .pipeline_parallel import split_layers
from .train_4d import Train4DConfig

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv")
ZERO_STAGES = (0, 1, 2, 3)  # 0 is plain data parallelism


def training_state_bytes(num_params: float, *, zero_stage: int = 0, dp: int = 1, param_bytes: int = 2,
                         grad_bytes: int = 2, optimizer_bytes: int = 12) -> dict[str, float]:
    """Bytes per device of weights, gradients and optimizer state for ``num_params`` parameters.

    ZeRO stage 0 replicates all three on each of the ``dp`` ranks; stage 1 shards the optimizer state,
    stage 2 also the gradients, stage 3 also the weights (each sharded part is ⌈Ψ/dp⌉ parameters, Ψ =
    ⌈num_params⌉). The same formula as Stage 5's ``zero_memory_accounting``: written again here, so this
    stage does not depend on Stage 5 being done. Returns ``{"weights", "gradients", "optimizer", "total"}``
    in bytes.

    Raises:
        TypeError: ``dp`` or a byte count that is not an int, ``num_params`` not a number.
        ValueError: a value that is not positive, or ``zero_stage`` not in 0–3.
    """
    positive_number("num_params", num_params)
    positive_int("dp", dp)
    choice("zero_stage", zero_stage, ZERO_STAGES)
    raise NotImplementedError("training_state_bytes: each of weights, gradients, optimizer state: Ψ, or ⌈Ψ/dp⌉ from stage 3, 2, 1 on (handout 06 §6.1)")


def devices_needed(num_params: float, device_bytes: float, *, zero_stage: int, model_parallel: int = 1) -> int | None:
    """Fewest devices whose memory holds the training state (activations ignored), or ``None`` if no data-
    parallel degree is enough.

    The model is first split ``model_parallel`` ways (tp × pp: each device holds ``num_params /
    model_parallel``), then replicated or ZeRO-sharded over ``dp`` copies; returns ``dp × model_parallel``
    for the smallest ``dp`` that fits, with 16 bytes per parameter as in :func:`training_state_bytes`.

    Raises:
        TypeError: a value that is not a number.
        ValueError: a value that is not positive, or ``zero_stage`` not in 0–3.
    """
    _positive(num_params=num_params, device_bytes=device_bytes, model_parallel=model_parallel)
    raise NotImplementedError("devices_needed: replicated bytes R + sharded bytes S/dp must fit: find the smallest dp (handout 06 §6.1)")


def activation_bytes_per_layer(seq_len: int, micro_batch: int, d_model: int, num_heads: int, *, tp: int = 1,
                               sequence_parallel: bool = False) -> float:
    """Activation bytes one Transformer layer keeps for its backward, per micro-batch (16-bit activations,
    no recomputation), after Korthikanti et al. 2022, "Reducing Activation Recomputation":

    ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` with tensor parallelism ``t`` (the 10 is the norms and dropouts
    that stay replicated), and ``s·b·h·(34 + 5·a·s/h)/t`` with sequence parallelism as well.

    Raises:
        TypeError: a size that is not a number.
        ValueError: a size that is not positive.
    """
    _positive(seq_len=seq_len, micro_batch=micro_batch, d_model=d_model, num_heads=num_heads, tp=tp)
    s, b, h, a, t = seq_len, micro_batch, d_model, num_heads, tp
    raise NotImplementedError("activation_bytes_per_layer: the Korthikanti formula, with and without sequence parallelism (handout 06 §6.2)")


def memory_per_device(num_params: float, *, num_layers: int, seq_len: int, micro_batch: int, d_model: int,
                      num_heads: int, dp: int = 1, tp: int = 1, pp: int = 1, zero_stage: int = 0,
                      sequence_parallel: bool = False, cp: int = 1) -> dict[str, float]:
    """Bytes on the most loaded device (pipeline stage 0 under 1F1B) for a dense model.

    Training state of ``num_params / (tp·pp)`` parameters, ZeRO over ``dp``; activations of
    ``num_layers / pp`` layers for ``pp`` micro-batches in flight (1F1B's first stage). With context
    parallelism ``cp`` each device holds ``seq_len / cp`` tokens of each sequence, and its activations are
    those of a ``seq_len / cp`` sequence (handout 06b §6): every term of the formula divides by cp, and the
    attention-score term by cp² — the scores of one ring step, local queries × one block of keys, which a
    FlashAttention ring does not even keep. The training state is replicated over cp. Returns
    ``{"weights", "gradients", "optimizer", "activations", "total"}``.

    Raises:
        TypeError: a size that is not a number.
        ValueError: a size that is not positive, or ``zero_stage`` not in 0–3.
    """
    _positive(num_layers=num_layers, pp=pp, tp=tp, cp=cp)
    state = training_state_bytes(num_params / (tp * pp), zero_stage=zero_stage, dp=dp)
    raise NotImplementedError("memory_per_device: add the activations of this stage's layers for pp micro-batches in flight (handout 06 §6.2)")


def stage_parameter_counts(cfg: Train4DConfig, stage: int) -> dict[str, int]:
    """Parameters one rank of pipeline stage ``stage`` holds in :mod:`.train_4d`: ``{"dense", "expert"}``.

    Dense: embedding (first stage), per layer two norms, q/k/v/output projections split over tp, the
    router; final norm and LM head (last stage). Expert: per layer ``num_experts / ep`` experts of three
    ``d_model × d_ff`` matrices.
    """
    m = cfg.model
    d, v, f = m.d_model, m.vocab_size, m.d_ff
    start, end = split_layers(m.num_layers, cfg.pp)[stage]
    layers = end - start
    raise NotImplementedError("stage_parameter_counts: count what the stage, tp and ep splits leave on this rank (handout 06 §6.3)")


def comm_volume_per_step(cfg: Train4DConfig, stage: int) -> dict[tuple[str, str], int]:
    """Payload bytes a rank of pipeline stage ``stage`` hands to collectives in one :func:`.train_4d.train_step`.

    Keys are ``(axis, collective)``, e.g. ``("tp", "all_reduce")``; only groups of more than one rank
    count (a one-rank collective moves nothing). fp32 (4 bytes) everywhere. With ``b`` = micro-batch,
    ``T`` = the tokens of a sequence this rank holds (``seq_len / cp``), ``d`` = d_model, ``m`` =
    grad_accum_steps, ``L`` = layers on this stage:

    * ``tp``: per layer and micro-batch, g's all-reduce of the attention output (forward) and f's of its
      input gradient (backward) — the MoE feed-forward is replicated across tp: ``2·L·m·bTd``.
    * ``pp``: each micro-batch's activation sent forward and gradient sent back, ``bTd`` each; and the
      loss (one float) broadcast from the last stage.
    * ``ep``: per MoE layer and micro-batch, dispatch and combine in the forward and again in the
      backward, each all-to-all moving the ``E × capacity × d`` buffer: ``4·L·m·E·C·d``.
    * ``dp_ep``: the dense gradients all-reduced once per step over dp × ep × cp, plus the reported loss
      (one float); ``dp``: the expert gradients, over dp × cp.
    * ``cp`` (handout 06b §6): the ring. Per layer and micro-batch, in the forward each of K and V — a
      ``b × T × d/tp`` block, this rank's tokens of its tp heads — is sent on ``cp − 1`` times; the backward
      sends K and V round again and each dK, dV block ``cp`` times (back to its owner):
      ``L·m·bT(d/tp)·(2(cp−1) + 2(cp−1) + 2cp)`` sent, as much received.

    Raises:
        TypeError: ``cfg`` is not a ``Train4DConfig``, or ``stage`` not an int.
        ValueError: ``stage`` outside ``[0, cfg.pp)``.
    """
    instance("cfg", cfg, Train4DConfig, "a Train4DConfig")
    index("stage", stage, cfg.pp)  # a pipeline stage
    fp32 = 4
    b, t, d, m = cfg.micro_batch_size, cfg.seq_len // cfg.cp, cfg.model.d_model, cfg.grad_accum_steps
    start, end = split_layers(cfg.model.num_layers, cfg.pp)[stage]
    layers = end - start
    activation = b * t * d * fp32
    volume: dict[tuple[str, str], int] = {}
    raise NotImplementedError("comm_volume_per_step: add up each axis's collectives as the docstring lists them (handout 06 §6.3)")


def fsdp_tp_compute_bound(*, peak_flops: float, fsdp_bandwidth: float, tp_bandwidth: float, d_ff: int, fsdp: int
                          ) -> dict[str, float]:
    """When is one FSDP × TP matmul layer compute-bound? (A roofline argument, handout 06 §6.4.)

    A ``d × d_ff`` weight, 16-bit, FSDP-sharded over ``fsdp`` devices and split ``tp`` ways along ``d_ff``.
    For ``B`` tokens per step, each FSDP group processes ``B/fsdp`` tokens. Per device and layer:

    * compute ``2 · (B/fsdp) · d · d_ff / tp`` FLOPs at ``peak_flops``;
    * FSDP gathers its weight slice: ``2 · d · d_ff / tp`` bytes at ``fsdp_bandwidth``;
    * TP moves the activations: ``2 · (B/fsdp) · d`` bytes at ``tp_bandwidth``.

    The thresholds are the forward's with communication overlapped and no ring factors; derive them
    (handout 06 Problem 6.8). Returns ``min_tokens_per_fsdp_shard`` (the fewest tokens ``B/fsdp`` for
    which compute hides the FSDP all-gather), ``min_global_tokens`` (× fsdp) and ``max_tp`` (the largest
    tp, as a float, for which compute hides the TP traffic; < 1 means never).

    Raises:
        ValueError: a bandwidth, peak, ``d_ff`` or ``fsdp`` that is not positive (``TypeError`` for a
            value that is not a number).
    """
    _positive(peak_flops=peak_flops, fsdp_bandwidth=fsdp_bandwidth, tp_bandwidth=tp_bandwidth, d_ff=d_ff, fsdp=fsdp)
    raise NotImplementedError("fsdp_tp_compute_bound: compare compute time with each axis's communication time (handout 06 §6.4)")


# ------------------------------------------------------------------------------------------------------
# Given helpers: used by the code above and by the tests; read them, no need to change them.


def _positive(**values: float) -> None:
    for name, value in values.items():
        positive_number(name, value)


def by_collective(volume: dict[tuple[str, str], int]) -> dict[str, int]:
    """Sum a :func:`comm_volume_per_step` result over axes: ``{collective: bytes}`` (non-zero entries)."""
    out: dict[str, int] = {}
    for (_, collective), nbytes in volume.items():
        out[collective] = out.get(collective, 0) + nbytes
    return {k: v for k, v in out.items() if v}
