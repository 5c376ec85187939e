"""Stage 2 — mixed precision, loss scaling and activation memory (handout/02-mixed-precision.md).

Low precision is fast because tensor cores multiply bf16/fp16 at many times the fp32 rate and because
half the bytes move through memory. It breaks in three places this module makes visible:

* accumulation — adding many small numbers into a low-precision sum loses them (§1);
* dynamic range — fp16 gradients underflow to zero unless the loss is scaled up first (§3, §4);
* precision-sensitive ops — norms, softmax and losses are kept in fp32 by ``torch.autocast`` (§2).

The second half measures where training memory goes: the activations autograd saves for backward
(§6), an analytic count of them for the kit's Transformer, and activation checkpointing, which trades
a second forward pass for most of that memory (§7).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kit.model import ModelConfig, cross_entropy, get_config
from kit.validate import choice, instance, number, positive_int, positive_number

from .benchmarking import peak_memory

# The compute dtypes this stage knows, by name. fp32 means "autocast off".
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def as_compute_dtype(dtype: torch.dtype | str, argument: str = "dtype") -> torch.dtype:
    """``torch.float32``/``bfloat16``/``float16`` or their names ``"fp32"``/``"bf16"``/``"fp16"`` → the torch dtype.

    Raises ``ValueError`` naming ``argument`` for anything else (fp8, ints, fp64 …).
    """
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(
        f"{argument} must be one of torch.float32, torch.bfloat16, torch.float16 (or 'fp32', 'bf16', 'fp16'), "
        f"got {dtype!r}"
    )


# ------------------------------------------------------------------------------------------------------
# Given: the handout's toy model (handout 02 §2).


class ToyModel(nn.Module):
    """linear → relu → layernorm → linear: the smallest model with a matmul, a norm and logits.

    ``forward(x (B, in_features) float) -> logits (B, out_features)``.
    """

    def __init__(self, in_features: int = 20, out_features: int = 5, hidden: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden, bias=False)
        self.relu = nn.ReLU()
        self.ln = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        x = self.ln(x)
        return self.fc2(x)


# ------------------------------------------------------------------------------------------------------
# §1 Accumulation


def accumulation_experiment(value: float = 0.01, steps: int = 1000) -> dict[str, float]:
    """Add ``value`` to a zero sum ``steps`` times, four ways, and return the four sums as Python floats.

    Keys:
        ``"fp32"``: an fp32 sum of fp32 values.
        ``"fp16"``: an fp16 sum of fp16 values (every partial sum rounded to fp16).
        ``"fp16_into_fp32"``: an fp32 sum, adding fp16 values in place (``s += x16``; type promotion
        computes in fp32).
        ``"fp16_upcast_into_fp32"``: an fp32 sum of fp16 values explicitly upcast first (``s += x16.float()``).

    Each sum is a 0-dim torch tensor updated in place, ``steps`` times; the exact answer is
    ``value * steps``.
    """
    number("value", value)
    positive_int("steps", steps)
    # One loop per (sum dtype, what is added) pair; the in-place add rounds to the sum's dtype each time.
    x32 = torch.tensor(value, dtype=torch.float32)
    x16 = torch.tensor(value, dtype=torch.float16)
    plans = {
        "fp32": (torch.float32, lambda: x32),
        "fp16": (torch.float16, lambda: x16),
        "fp16_into_fp32": (torch.float32, lambda: x16),
        "fp16_upcast_into_fp32": (torch.float32, lambda: x16.float()),
    }
    results = {}
    for key, (sum_dtype, addend) in plans.items():
        total = torch.zeros((), dtype=sum_dtype)
        for _ in range(steps):
            total.add_(addend())
        results[key] = float(total)
    return results


# ------------------------------------------------------------------------------------------------------
# §2 What autocast does to each tensor

REPORT_KEYS = ("parameters", "logits", "loss", "gradients")


def autocast_dtype_report(
    model: nn.Module,
    x: torch.Tensor,
    dtype: torch.dtype | str,
    *,
    targets: torch.Tensor | None = None,
) -> dict[str, torch.dtype]:
    """The dtype of every tensor that matters in one training step under ``torch.autocast(dtype)``.

    Runs ``logits = model(x)`` and ``loss = F.cross_entropy(logits, targets)`` inside
    ``torch.autocast(x.device.type, dtype)``, then ``loss.backward()`` outside it (as in training).

    Args:
        model: fp32 parameters; its output is logits ``(..., C)``.
        x: the model's input, on the model's device.
        dtype: the autocast dtype (``torch.bfloat16`` or ``torch.float16``; ``torch.float32`` runs with
            autocast off, for comparison).
        targets: class indices of shape ``logits.shape[:-1]``; default random (seeded) ones.

    Returns:
        ``{"parameters": …, <name>: …, "logits": …, "loss": …, "gradients": …}`` where ``<name>`` is
        each leaf submodule's name from ``model.named_modules()`` (``"fc1"``, ``"ln"`` …) mapped to the
        dtype of its output, ``"parameters"`` the parameters' dtype inside the autocast region and
        ``"gradients"`` the gradients' dtype. The model's ``.grad`` fields are left as they were.
    """
    instance("model", model, nn.Module, "an nn.Module")
    instance("x", x, torch.Tensor, "a torch.Tensor")
    dtype = as_compute_dtype(dtype)
    params = list(model.parameters())
    if not params:
        raise ValueError("model has no parameters: there is nothing to report a dtype for")
    param_dtypes = {p.dtype for p in params}
    if len(param_dtypes) != 1:
        raise ValueError(f"model parameters must share one dtype (fp32 master weights), got {param_dtypes}")
    names = [name for name, m in model.named_modules() if name and not any(True for _ in m.children())]
    clash = set(names) & set(REPORT_KEYS)
    if clash:
        raise ValueError(f"model has submodules named {sorted(clash)}, which clash with the report's own keys")
    saved_grads = [p.grad for p in params]
    report: dict[str, torch.dtype] = {}
    hooks = []
    for name, module in model.named_modules():
        if name in names:
            def record(_module, _inputs, output, name=name):
                if isinstance(output, torch.Tensor):
                    report[name] = output.dtype
            hooks.append(module.register_forward_hook(record))
    try:
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
            report["parameters"] = params[0].dtype
            logits = model(x)
            if targets is None:
                g = torch.Generator().manual_seed(0)
                targets = torch.randint(0, logits.shape[-1], logits.shape[:-1], generator=g).to(logits.device)
            # No .float() here: the report shows what autocast itself does to the loss.
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        report["logits"] = logits.dtype
        report["loss"] = loss.dtype
        for p in params:
            p.grad = None
        loss.backward()
        grad_dtypes = {p.grad.dtype for p in params if p.grad is not None}
        report["gradients"] = grad_dtypes.pop() if len(grad_dtypes) == 1 else params[0].dtype
    finally:
        for h in hooks:
            h.remove()
        for p, g in zip(params, saved_grads):
            p.grad = g
    return report


# ------------------------------------------------------------------------------------------------------
# §4 Dynamic loss scaling


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 training, decision for decision the same as ``torch.amp.GradScaler``.

    fp16's smallest normal number is 6.1e-5; many gradients are smaller and flush to zero. Multiplying
    the loss by ``S`` multiplies every gradient by ``S`` (backward is linear), lifting them into range;
    dividing the fp32 gradients by ``S`` before the step undoes it. ``S`` is chosen on the fly: halve it
    (``backoff_factor``) whenever a gradient overflowed to inf/nan — and skip that step — and double it
    (``growth_factor``) after ``growth_interval`` overflow-free steps in a row.

    Use it exactly like GradScaler::

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)        # optional: only to clip or inspect the true gradients
        scaler.step(optimizer)            # unscales if not done yet; skips the step on inf/nan
        scaler.update()                   # adjust the scale for the next iteration
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        positive_number("init_scale", init_scale)
        number("growth_factor", growth_factor, above=1)
        number("backoff_factor", backoff_factor, above=0, below=1)
        positive_int("growth_interval", growth_interval)
        self._scale = _fp32(float(init_scale))
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._clean_steps = 0  # overflow-free steps since the scale last changed
        self._found: dict[int, bool] = {}  # per optimizer (by id) since the last update(): inf/nan seen
        self._stage: dict[int, str] = {}  # per optimizer: "unscaled" or "stepped" since the last update()

    def get_scale(self) -> float:
        """The current scale ``S`` as a Python float."""
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``: call ``.backward()`` on this instead of on the loss."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a torch.Tensor, got {type(loss).__name__}")
        return loss * self._scale

    def _check(self, optimizer: torch.optim.Optimizer) -> str:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        return self._stage.get(id(optimizer), "ready")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide every gradient of ``optimizer``'s parameters by ``S`` in place; return whether any
        gradient element is inf or nan.

        Call it at most once per optimizer between two ``update()`` calls (``RuntimeError`` otherwise,
        as GradScaler). Gradients must be fp32 (``ValueError`` for fp16 gradients: keep fp32 master
        weights). 1/S is rounded to fp32 as GradScaler does.
        """
        stage = self._check(optimizer)
        if stage == "unscaled":
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update()")
        if stage == "stepped":
            raise RuntimeError("unscale_() is being called after step(): call update() first")
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if any(g.dtype == torch.float16 for g in grads):
            raise ValueError("cannot unscale fp16 gradients: keep the parameters in fp32 (master weights)")
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        found_inf = torch.zeros(1)
        inv_scale = torch.full((1,), 1.0 / self._scale, dtype=torch.float32)  # fp32(1/S), as GradScaler
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        self._found[id(optimizer)] = bool(found_inf.item())
        self._stage[id(optimizer)] = "unscaled"
        return self._found[id(optimizer)]

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Unscale (if not done yet), then ``optimizer.step(*args, **kwargs)`` unless a gradient was inf/nan.

        Returns what ``optimizer.step`` returned, or ``None`` when the step was skipped.
        """
        if self._check(optimizer) == "stepped":
            raise RuntimeError("step() has already been called since the last update()")
        if self._stage.get(id(optimizer), "ready") == "ready":
            self.unscale_(optimizer)
        self._stage[id(optimizer)] = "stepped"
        return None if self._found[id(optimizer)] else optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps; start a new iteration."""
        if not self._stage:
            raise RuntimeError("update() needs a step() or unscale_() since the last update(): no inf checks recorded")
        if any(self._found.values()):
            self._scale, self._clean_steps = _fp32(self._scale * self._backoff_factor), 0
        else:
            self._clean_steps += 1
            if self._clean_steps >= self._growth_interval:
                self._clean_steps = 0
                if math.isfinite(_fp32(self._scale * self._growth_factor)):
                    self._scale = _fp32(self._scale * self._growth_factor)
        self._found, self._stage = {}, {}

    def state_dict(self) -> dict[str, float | int]:
        """The same keys as ``torch.amp.GradScaler.state_dict()``, so either can load the other's state."""
        return {
            "scale": self._scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._clean_steps,
        }

    def load_state_dict(self, state_dict: dict[str, float | int]) -> None:
        """Restore from :meth:`state_dict` (or from a GradScaler's)."""
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} - set(state_dict)
        if missing:
            raise ValueError(f"state_dict is missing {sorted(missing)}")
        self._scale = _fp32(float(state_dict["scale"]))
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._clean_steps = int(state_dict["_growth_tracker"])


# ------------------------------------------------------------------------------------------------------
# §5 One mixed-precision training step


def mixed_precision_train_step(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    dtype: torch.dtype | str,
    scaler: DynamicLossScaler | torch.amp.GradScaler | None = None,
    max_grad_norm: float | None = None,
) -> float:
    """One training step: autocast forward, fp32 loss, (scaled) backward, unscale, clip, step.

    Args:
        model: fp32 parameters (the master weights); ``model(inputs)`` returns logits ``(..., V)``.
        batch: ``(inputs, targets)``; targets are class indices of shape ``logits.shape[:-1]``.
        optimizer: over ``model``'s parameters. Gradients are zeroed at the start of the step.
        dtype: compute dtype of the forward: ``torch.float32`` (autocast off), ``torch.bfloat16`` or
            ``torch.float16`` (or ``"fp32"``/``"bf16"``/``"fp16"``). fp16 needs a ``scaler``.
        scaler: a :class:`DynamicLossScaler` or ``torch.amp.GradScaler``; ``scale``/``step``/``update``
            are called on it. Allowed with bf16 too (harmless, rarely needed).
        max_grad_norm: clip the global L2 norm of the *unscaled* gradients to this value.

    Returns:
        The loss as a Python float (unscaled).
    """
    dtype = as_compute_dtype(dtype)
    instance("model", model, nn.Module, "an nn.Module")
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError("batch must be a pair (inputs, targets)")
    if dtype == torch.float16 and scaler is None:
        raise ValueError("dtype float16 needs a loss scaler (scaler=DynamicLossScaler()): small fp16 gradients "
                         "underflow to zero without one (handout 02 §4)")
    if max_grad_norm is not None:
        positive_number("max_grad_norm", max_grad_norm)
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:
            raise ValueError(f"parameter {name} is {p.dtype}: mixed precision keeps fp32 master weights "
                             "and lets autocast make the low-precision copies")
    inputs, targets = batch
    for p in model.parameters():
        p.grad = None
    with torch.autocast(inputs.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = cross_entropy(model(inputs), targets)  # fp32 inside autocast too: it upcasts the logits
    (loss if scaler is None else scaler.scale(loss)).backward()
    if max_grad_norm is not None:
        if scaler is not None:
            scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=False)
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    return float(loss.detach())


# ------------------------------------------------------------------------------------------------------
# §6 Activation memory: measured


def saved_activation_bytes(fn: Callable[[], object]) -> int:
    """Bytes of every tensor autograd saves for backward while ``fn()`` runs (works on any device).

    Uses ``torch.autograd.graph.saved_tensors_hooks``: its pack hook sees each tensor as it is saved.
    A storage shared by several saved tensors (a tensor and its views, one input saved by three
    matmuls) is counted once, at its full size. Parameters (and any leaf that requires grad, and
    views of them) are not counted: they exist anyway. Low-precision *copies* of parameters made by
    autocast are counted: this forward creates them and the graph keeps them alive.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    sizes: dict[tuple[str, int], int] = {}
    for t in saved:
        if _owned_by_caller(t):
            continue
        storage = t.untyped_storage()
        sizes[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(sizes.values())


# ------------------------------------------------------------------------------------------------------
# §6 Activation memory: counted


def activation_memory_estimate(
    config: ModelConfig | str,
    batch_size: int,
    context_length: int,
    dtype: torch.dtype | str,
    *,
    device_type: str = "cuda",
    checkpoint_policy: str | int = "none",
) -> dict[str, Any]:
    """Bytes autograd saves in one training forward of the kit's ``TransformerLM`` + cross-entropy loss,
    counted from the config alone (naive attention, as in ``kit/model.py``).

    With ``B = batch_size``, ``T = context_length``, ``d = d_model``, ``F = d_ff``, ``H = num_heads``, ``V =
    vocab_size``, ``c`` the bytes of the compute dtype and ``r`` the bytes of the residual stream (fp32:
    the embedding is fp32 and fp32 + bf16 is fp32), one block saves

    ============================  ====================================================================
    ``residual``                  the block input and the mid-block sum, ``2·B·T·d·r``
    ``norms``                     per RMSNorm ``x·rms`` (``B·T·d·4``) and ``rms`` (``B·T·4``), two norms
    ``linear inputs``             the q/k/v, output and w1/w3 projection inputs. fp32: one shared
                                  ``B·T·d·4`` per norm plus the attention output. autocast: each linear
                                  casts its input itself, so 3 + 1 + 2 copies of ``B·T·d·c``
    ``rope``                      rotated q and k (``2·B·T·d·c``) and the cos/sin tables (``2·T·(d/H)·c``)
    ``attention``                 softmax probabilities ``B·H·T²`` (fp32 on CUDA autocast, plus the
                                  ``c``-byte copy the next matmul casts; ``c`` on CPU), the causal mask
                                  ``T²`` bytes, and a contiguous copy of v, ``B·T·d·c``, made by matmul
    ``mlp``                       w1 and w3 outputs, SiLU output and their product, ``4·B·T·F·c``
    ============================  ====================================================================

    The scores q·kᵀ themselves are not saved: the scaling saves nothing and softmax saves its output.
    Outside the blocks: the token ids (``B·T·8``), the final norm and LM-head input, the loss's
    log-softmax (``B·T·V·4``) and targets, and under autocast the ``c``-byte weight copies every
    linear saves. With ``checkpoint_policy`` ``"every_block"`` or ``k``, the blocks save only the input
    of each ``k``-block segment (and their weight copies are made again in backward);
    ``"recompute_peak"`` is what one segment's recomputation adds during backward.

    Returns:
        ``{"per_layer": {item: bytes}, "layer_total": int, "layers": int, "embedding": int, "head": int,
        "loss": int, "weight_copies": int, "total": int, "recompute_peak": int}``.
    """
    config = get_config(config)
    dtype = as_compute_dtype(dtype)
    positive_int("batch_size", batch_size)
    positive_int("context_length", context_length)
    choice("device_type", device_type, ("cpu", "cuda"))
    k = _checkpoint_segment_length(config.num_layers, checkpoint_policy)
    B, T, d, F_, H, V, L = (batch_size, context_length, config.d_model, config.d_ff, config.num_heads,
                            config.vocab_size, config.num_layers)
    low = dtype != torch.float32
    c = dtype.itemsize
    tokens = B * T
    # Grouped by sub-layer rather than by the handout's items: the tests must accept any grouping.
    attention = (
        (3 if low else 1) * tokens * d * c          # q/k/v projection inputs (one shared fp32 norm output)
        + tokens * d * c                            # output projection input
        + 2 * tokens * d * c + 2 * T * (d // H) * c  # RoPE: rotated q and k, cos/sin tables
        + B * H * T * T * (4 + c if (low and device_type == "cuda") else c)  # softmax (+ the cast copy)
        + T * T                                     # causal mask (bool)
        + tokens * d * c                            # contiguous v copy
    )
    mlp = (2 if low else 1) * tokens * d * c + 4 * tokens * F_ * c
    stream = 2 * tokens * d * 4 + 2 * (tokens * d * 4 + tokens * 4)  # residual + both RMSNorms, fp32
    per_layer = {"attention sub-layer": attention, "mlp sub-layer": mlp, "residual and norms": stream}
    layer_total = attention + mlp + stream
    weights = (4 * d * d + 3 * d * F_) * c if low else 0
    head_copy = d * V * c if low else 0
    embedding = tokens * 8
    head = 2 * tokens * d * 4 + tokens * 4 + tokens * d * (c if low else 4)
    loss = tokens * V * 4 + tokens * 8
    if k is None:
        layers, weight_copies, recompute_peak = L * layer_total, L * weights + head_copy, 0
    else:
        layers, weight_copies = -(-L // k) * tokens * d * 4, head_copy
        recompute_peak = k * (layer_total + weights)
    return {"per_layer": per_layer, "layer_total": layer_total, "layers": layers, "embedding": embedding,
            "head": head, "loss": loss, "weight_copies": weight_copies,
            "total": layers + embedding + head + loss + weight_copies, "recompute_peak": recompute_peak}


# ------------------------------------------------------------------------------------------------------
# §7 Activation checkpointing


def _segment_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Replaces the ``forward`` of the first block of a segment: runs the whole segment, saving only ``x``."""
    return checkpoint(functools.partial(_run_blocks, self._checkpoint_segment), x, use_reentrant=False)


def checkpoint_segments(num_blocks: int, policy: str | int) -> list[range]:
    """The block indices of each checkpointed segment.

    ``"none"`` → ``[]``; ``"every_block"`` (same as ``1``) → one segment per block; ``k`` → consecutive
    segments of ``k`` blocks (the last may be shorter): a checkpoint stored every ``k``-th block.
    """
    positive_int("num_blocks", num_blocks)
    k = _checkpoint_segment_length(num_blocks, policy)
    if k is None:
        return []
    starts = list(range(0, num_blocks, k))
    return [range(s, e) for s, e in zip(starts, starts[1:] + [num_blocks])]


def checkpointed(module_or_blocks: nn.Module, policy: str | int = "every_block") -> nn.Module:
    """Turn on activation checkpointing for a stack of blocks, in place, and return the same object.

    Args:
        module_or_blocks: the kit's ``TransformerLM`` (anything with a ``layers`` ``nn.ModuleList``) or
            an ``nn.ModuleList`` of blocks. Each block maps one tensor to one tensor and the caller runs
            them in order, each on the previous one's output (as ``TransformerLM.forward`` does).
        policy: ``"every_block"``: each block saves only its input and recomputes its activations in
            backward; ``k`` (int ≥ 1): segments of ``k`` consecutive blocks each run under one
            ``torch.utils.checkpoint`` (non-reentrant), saving only the segment's input; ``"none"``:
            back to normal.

    Parameters, their names and the ``state_dict`` are unchanged: the first block of a segment gets a
    ``forward`` that runs the whole segment under ``checkpoint``; the other blocks of the segment pass
    their input through. ``copy.deepcopy`` of the result stays consistent.
    """
    if isinstance(module_or_blocks, nn.ModuleList):
        blocks = module_or_blocks
    elif isinstance(module_or_blocks, nn.Module) and isinstance(getattr(module_or_blocks, "layers", None),
                                                                nn.ModuleList):
        blocks = module_or_blocks.layers
    else:
        raise TypeError("module_or_blocks must be an nn.ModuleList of blocks or a model with a `layers` "
                        f"nn.ModuleList (the kit's TransformerLM), got {type(module_or_blocks).__name__}")
    segments = checkpoint_segments(len(blocks), policy)
    for block in blocks:  # undo any earlier policy
        block.__dict__.pop("forward", None)
        block.__dict__.pop("_checkpoint_segment", None)
    for segment in segments:
        members = [blocks[i] for i in segment]
        # Bound methods (not closures) so that deepcopy rebinds them to the copied blocks.
        members[0].__dict__["_checkpoint_segment"] = members
        members[0].forward = _segment_forward.__get__(members[0])
        for block in members[1:]:
            block.forward = _pass_through.__get__(block)
    return module_or_blocks


# ------------------------------------------------------------------------------------------------------
# §8 Peak memory on a GPU


STEP_MODES = ("forward", "train_step")


def step_peak_memory(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    dtype: torch.dtype | str,
    mode: str = "train_step",
    optimizer: torch.optim.Optimizer | None = None,
    scaler: DynamicLossScaler | torch.amp.GradScaler | None = None,
) -> int:
    """Peak bytes allocated on the GPU during one ``forward`` (inference, ``torch.no_grad``) or one
    ``train_step`` (:func:`mixed_precision_train_step`), measured with Stage 1's ``peak_memory``.

    CUDA only (``RuntimeError`` on a CPU, whose allocator keeps no peak statistics). The peak includes
    what was allocated before the call (weights, optimizer state): run one step first so the optimizer
    state exists and you compare steady states. ``train_step`` needs ``optimizer``.
    """
    dtype = as_compute_dtype(dtype)
    choice("mode", mode, STEP_MODES)
    if mode == "train_step" and optimizer is None:
        raise ValueError("mode 'train_step' needs an optimizer")
    inputs, targets = batch
    def forward() -> None:
        with torch.no_grad(), torch.autocast(inputs.device.type, dtype=dtype, enabled=dtype != torch.float32):
            model(inputs)

    def train_step() -> None:
        mixed_precision_train_step(model, (inputs, targets), optimizer, dtype=dtype, scaler=scaler)

    return peak_memory(forward if mode == "forward" else train_step, inputs.device)


# ------------------------------------------------------------------------------------------------------
# Given helpers: used by the code above; read them, no need to change them.


def _fp32(value: float) -> float:
    """``value`` rounded to fp32: torch.amp.GradScaler keeps its scale in an fp32 tensor."""
    return torch.tensor(value, dtype=torch.float32).item()


def _owned_by_caller(t: torch.Tensor) -> bool:
    """A leaf that requires grad (a parameter, a leaf input) or a view of one: memory that exists
    whether or not autograd saves it, so it is not activation memory."""
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


def _checkpoint_segment_length(num_blocks: int, policy: str | int) -> int | None:
    """Blocks per checkpointed segment for ``policy`` (``None`` means no checkpointing)."""
    if policy == "none" or policy is None:
        return None
    if policy == "every_block":
        return 1
    if isinstance(policy, int) and not isinstance(policy, bool) and policy >= 1:
        return min(policy, num_blocks)
    raise ValueError(f"policy must be 'none', 'every_block' or an int k ≥ 1 (a checkpoint every k blocks), "
                     f"got {policy!r}")


def _run_blocks(blocks: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Each block's own computation in turn (``type(b).forward``, since ``b.forward`` is replaced)."""
    for block in blocks:
        x = type(block).forward(block, x)
    return x


def _pass_through(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Replaces the ``forward`` of the other blocks of a segment: the first block already ran them."""
    return x
