# Your work goes in this file. Generated from the kit's reference by `make student`.
"""One full training step from the student's own pieces (handout 07b §5).

Public API (the tests and ``python -m kit leaderboard`` call exactly this):

    build_train_step(config: StepConfig, *, world=None) -> TrainStep

``TrainStep(inputs, targets) -> float`` runs forward, loss, backward and the optimizer step once and returns
the step's loss; ``world`` is ``None`` (one process) or the process group to train data-parallel over.

What a step promises (the tests check each):

* the model is the kit's ``TransformerLM(config.model)`` built after ``torch.manual_seed(config.seed)``, so
  every rank and the judge's naive reference start from the same weights; ``step.model`` is that model
  (unwrapped: its parameter names are the kit's) and ``step.optimizer`` its optimizer;
* ``inputs``/``targets`` are this rank's rows of the global batch, ``(b, T)`` int64, every rank the same ``b``;
  the value returned is the mean loss over the **global** batch (every rank returns the same float);
* after a call each parameter's ``.grad`` holds that step's gradient of the global mean loss (averaged over
  the ranks, summed over micro-batches) and the parameters hold the updated weights;
* the loss is a mean over tokens whichever pieces are chosen: ``micro_batches = k`` splits this rank's rows
  into k equal micro-batches whose losses are scaled by 1/k, and only the last one's backward communicates.

The choices (:class:`StepConfig`): attention ``"naive"`` (the kit's), ``"flash_pytorch"`` or
``"flash_triton"`` (your Stage 3, through ``model.set_attention``); loss ``"naive"`` (full logits, then
``kit.model.cross_entropy`` in fp32) or ``"fused"`` (your :func:`fused_linear_cross_entropy` on
``model.hidden_states`` and ``lm_head.weight``: the logits never exist); optimizer ``"adamw"``
(``torch.optim.AdamW``) or ``"fused_adamw"`` (your :class:`FusedAdamW`); dtype ``"fp32"``,
``"bf16_autocast"`` (fp32 weights, bf16 matmuls under ``torch.autocast``) or ``"bf16"`` (bf16 weights, fp32
master weights and moments in ``FusedAdamW``); on several ranks your Stage 4 ``DDPBucketed`` over ``world``.
Earlier stages' modules are imported where they are used, so a Stage 3 or 4 that does not work costs only
the choices that use it.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from kit.model import ModelConfig, TransformerLM, cross_entropy, get_config, naive_attention
from kit.validate import choice, instance, integer, number, positive_int

__all__ = ["StepConfig", "TrainStep", "build_train_step", "leaderboard_options"]

ATTENTIONS = ("naive", "flash_pytorch", "flash_triton")
LOSSES = ("naive", "fused")
OPTIMIZERS = ("adamw", "fused_adamw")
DTYPES = ("fp32", "bf16_autocast", "bf16")
DEVICES = ("cpu", "cuda")


# ----------------------------------------------------------------------------------------------------
# Given: the configuration, checked when it is made
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepConfig:
    """What one training step is made of. Every field has a default: ``StepConfig(model="tiny")`` is the naive
    step (eager attention, full logits, ``torch.optim.AdamW``, fp32) on the tiny preset.

    Attributes:
        model: a preset name of :data:`kit.model.PRESETS` or a :class:`~kit.model.ModelConfig`.
        seed: ``torch.manual_seed`` before the model is built (the same weights everywhere).
        attention: ``"naive"``, ``"flash_pytorch"`` or ``"flash_triton"`` (Stage 3).
        loss: ``"naive"`` (full logits) or ``"fused"`` (handout 07 §2: the LM head and the cross-entropy fused).
        optimizer: ``"adamw"`` (``torch.optim.AdamW``) or ``"fused_adamw"`` (:class:`FusedAdamW`).
        dtype: ``"fp32"``, ``"bf16_autocast"`` or ``"bf16"`` (bf16 weights; needs ``"fused_adamw"``, whose
            master weights keep the update in fp32).
        lr, betas, eps, weight_decay: AdamW's options, one group over every parameter.
        micro_batches: gradient accumulation: this rank's rows in that many equal micro-batches.
        activation_checkpointing: recompute each block's activations in backward instead of keeping them.
        bucket_size_mb: ``DDPBucketed``'s bucket cap on several ranks (``None``: one bucket).
        device: ``"cpu"`` or ``"cuda"`` (this rank's GPU).

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a value that is not allowed (an unknown choice, bf16 weights with ``torch.optim.AdamW``).
    """

    model: ModelConfig | str = "tiny"
    seed: int = 0
    attention: str = "naive"
    loss: str = "naive"
    optimizer: str = "adamw"
    dtype: str = "fp32"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    micro_batches: int = 1
    activation_checkpointing: bool = False
    bucket_size_mb: float | None = 25.0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if isinstance(self.model, str):
            object.__setattr__(self, "model", get_config(self.model))
        instance("model", self.model, ModelConfig, "a preset name or a ModelConfig")
        integer("seed", self.seed, minimum=0)
        choice("attention", self.attention, ATTENTIONS)
        choice("loss", self.loss, LOSSES)
        choice("optimizer", self.optimizer, OPTIMIZERS)
        choice("dtype", self.dtype, DTYPES)
        choice("device", self.device, DEVICES)
        number("lr", self.lr, at_least=0)
        number("eps", self.eps, at_least=0)
        number("weight_decay", self.weight_decay, at_least=0)
        instance("betas", self.betas, (tuple, list), "a pair (beta1, beta2)")
        if len(self.betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {len(self.betas)} values")
        object.__setattr__(self, "betas", tuple(number(f"betas[{i}]", b, at_least=0, below=1)
                                               for i, b in enumerate(self.betas)))
        positive_int("micro_batches", self.micro_batches)
        instance("activation_checkpointing", self.activation_checkpointing, bool, "a bool")
        if self.bucket_size_mb is not None:
            number("bucket_size_mb", self.bucket_size_mb, above=0)
        if self.dtype == "bf16" and self.optimizer != "fused_adamw":
            raise ValueError("dtype 'bf16' keeps the weights in bf16, so the optimizer must keep fp32 master weights: "
                             f"optimizer must be 'fused_adamw' (master_weights=True), got {self.optimizer!r} "
                             "(torch.optim.AdamW would apply each update in bf16; handout 07b §4)")

    def with_(self, **changes: Any) -> StepConfig:
        """A copy with some fields changed (checked again)."""
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (the model as its fields): what an entry file or a spawned rank receives."""
        out = asdict(self)
        out["betas"] = list(self.betas)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepConfig:
        """The inverse of :meth:`as_dict`; ``ValueError`` naming an unknown field."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown StepConfig field(s) {unknown}; the fields are {sorted(known)}")
        data = dict(data)
        if isinstance(data.get("model"), dict):
            data["model"] = ModelConfig(**data["model"])
        if isinstance(data.get("betas"), list):
            data["betas"] = tuple(data["betas"])
        return cls(**data)


def leaderboard_options(task: str, device: str) -> dict[str, Any]:
    """The choices your leaderboard entry uses for ``task`` on ``device`` (``"cpu"`` or ``"cuda"``):
    ``python -m kit leaderboard`` builds ``StepConfig(model=<the task's>, **these)``; ``--set key=value`` on its
    command line overrides one. Edit them: this is where you enter your fastest correct step.

    The reference's choices: on a GPU every fused piece in bf16; on a CPU the Triton interpreter runs kernels
    in Python (slow), so the PyTorch pieces win there (handout 07b §7 has the measurements).
    """
    if device == "cuda":
        return {"attention": "flash_triton", "loss": "fused", "optimizer": "fused_adamw", "dtype": "bf16",
                "activation_checkpointing": task != "gpu1"}
    return {"attention": "naive", "loss": "naive", "optimizer": "fused_adamw", "dtype": "fp32"}


# ----------------------------------------------------------------------------------------------------
# The step: your part (the argument checks at the top of each function are given)
# ----------------------------------------------------------------------------------------------------


class TrainStep:
    """One full training step, callable: ``loss = step(inputs, targets)`` (see the module docstring).

    Attributes:
        config: the :class:`StepConfig` it was built from.
        model: the kit's ``TransformerLM`` (unwrapped; on several ranks ``DDPBucketed`` wraps it internally).
        optimizer: the optimizer over ``model.parameters()``.
        world: the process group, or None.
    """

    def __init__(self, config: StepConfig, model: TransformerLM, optimizer: torch.optim.Optimizer,
                 net: nn.Module, world: Any = None):
        self.config, self.model, self.optimizer, self.world = config, model, optimizer, world
        # What forward runs: the model's logits (naive loss) or its hidden states (fused loss), wrapped in
        # DDPBucketed on several ranks. Given in full by build_train_step.
        self.net = net
        self.device = next(model.parameters()).device

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One step on this rank's rows ``(b, T)`` int64; returns the global batch's mean loss as a float."""
        _check_batch(inputs, targets, self.config)
        device = self.device
        inputs, targets = inputs.to(device), targets.to(device)
        raise NotImplementedError("TrainStep.__call__: zero; micro-batches (loss/k, no_sync but the last); sync; step; global loss (handout 07b §5)")

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This micro-batch's mean cross-entropy, a 0-dim fp32 tensor, through ``self.net``."""
        raise NotImplementedError("TrainStep._loss: forward (autocast for bf16_autocast), then the naive or the fused loss (handout 07b §5)")


def build_train_step(config: StepConfig, *, world: Any = None) -> TrainStep:
    """The :class:`TrainStep` that ``config`` describes, data-parallel over ``world`` when it is a process group.

    Builds ``TransformerLM(config.model)`` after ``torch.manual_seed(config.seed)``, on ``config.device``; sets the
    attention; casts the weights to bf16 for ``dtype="bf16"``; wraps each block in activation checkpointing when
    asked; on a process group wraps what forward runs in your Stage 4 ``DDPBucketed(bucket_size_mb=…)``; makes
    the optimizer (``FusedAdamW(master_weights=True)`` for bf16 weights). Call it on every rank of ``world``.

    Raises:
        TypeError: ``config`` is not a StepConfig, or ``world`` is neither None nor a process group.
        ValueError: ``device="cuda"`` without a GPU.
    """
    instance("config", config, StepConfig, "a StepConfig")
    if world is not None:
        instance("world", world, dist.ProcessGroup, "None or a torch.distributed process group")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no GPU; use device='cpu'")
    raise NotImplementedError("build_train_step: seeded model, attention, dtype, checkpointing, DDPBucketed over world, optimizer (handout 07b §5)")


def _attention_fn(name: str):
    """The ``attention_fn(q, k, v, is_causal)`` for ``name``; Stage 3 is imported only when it is asked for."""
    raise NotImplementedError("_attention_fn: naive_attention, or your Stage 3 FlashAttention (PyTorch or Triton) (handout 07b §5)")


# ----------------------------------------------------------------------------------------------------
# Given helpers: used by the code above; read them, no need to change them
# ----------------------------------------------------------------------------------------------------


class _HiddenStates(nn.Module):
    """What forward runs for the fused loss: the model's final hidden states, not its logits. A module of its own
    so that ``DDPBucketed`` wraps it (its forward decides whether the step communicates) and still sees every
    parameter, the LM head's included: the fused loss uses ``lm_head.weight`` outside this forward, and its
    gradient is all-reduced like any other."""

    def __init__(self, model: TransformerLM):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.hidden_states(tokens)


def _flash_pytorch(flash_attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   is_causal: bool) -> torch.Tensor:
    """Stage 3's PyTorch FlashAttention as a Transformer attention: one dtype for q, k and v (under autocast
    the rotary embedding and the v projection may hand over different ones)."""
    return flash_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal, backend="pytorch")


def _rank_gpu() -> torch.device:
    """This rank's GPU: ``cuda:<local rank>`` in a process group, else the current device."""
    if dist.is_available() and dist.is_initialized():
        return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _check_batch(inputs: Any, targets: Any, config: StepConfig) -> None:
    """``inputs``/``targets``: int64 ``(b, T)`` of one shape, ``T ≤ context_length``, ``b`` divisible by the
    micro-batches."""
    for name, t in (("inputs", inputs), ("targets", targets)):
        instance(name, t, torch.Tensor, "a torch.Tensor")
        if t.dtype != torch.long or t.dim() != 2:
            raise ValueError(f"{name} must be an int64 tensor of shape (batch, seq), got {t.dtype} "
                             f"{tuple(t.shape)}")
    if inputs.shape != targets.shape:
        raise ValueError(f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} must have one shape")
    if inputs.shape[0] % config.micro_batches:
        raise ValueError(f"inputs has {inputs.shape[0]} rows, not divisible into micro_batches="
                         f"{config.micro_batches} equal micro-batches")
