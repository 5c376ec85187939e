"""Train a tiny mixture-of-experts Transformer on a dp × tp × pp × ep × cp mesh (handout 06 §5, 06b §6).

Every rank runs :func:`train` with the same :class:`Train4DConfig`. What each rank does:

1. builds the whole model from the seed (the same on every rank), makes its attention a ring over the
   ``cp`` group with the global positions of its sequence shard, keeps its pipeline stage, splits its
   blocks across ``tp`` and keeps its experts (``ep``) — parallelism applied to an unchanged model;
2. wraps the stage's *dense* parameters in Stage 4's :class:`DDPBucketed` over the dp × ep × cp group and
   the *expert* parameters in another over the dp × cp group;
3. each step, reads its shard of the global batch (and of each sequence: ``cp``), runs the pipeline
   schedule over ``grad_accum_steps`` micro-batches, and only then synchronises the data-parallel gradients
   (never per micro-batch: the gradients are not complete until the last micro-batch's backward has run on
   every stage).

**Batch.** Every rank with the same (dp, ep) coordinates reads the same data: the global batch of step
``s`` is ``kit.data.random_batch(global_batch_size, seq_len, vocab, seed=seed + s)``; data shard
``k = dp_index · ep + ep_index`` takes rows ``[k·MBS·GA, (k+1)·MBS·GA)``, and micro-batch ``i`` of it
rows ``[i·MBS, (i+1)·MBS)`` of that. Expert-parallel ranks read different data — for the dense weights
they are data-parallel replicas — so ``global_batch_size = MBS × GA × dp × ep``.

**Sequence (cp, handout 06b §6).** The ``cp`` ranks of one data shard read the same rows and keep
``seq_len / cp`` tokens of each, inputs *and* targets at the same global positions
(``context_parallel.shard_positions(seq_len, cp, cp_index, cp_layout)``; ``"zigzag"``, the default, balances
the causal attention's work). Each rank rotates its tokens by their global positions and its attention is
``ring_attention`` over the cp group, so every query still sees every earlier key of its sequence.

**Loss.** Per micro-batch ``cross_entropy + aux_loss_coef · Σ_layers aux`` (the MoE balancing losses,
each computed over the tokens of that micro-batch this rank holds — with cp, its sequence shard), averaged
over micro-batches, data shards and cp ranks. The cross-entropy of a rank is the mean over its local tokens;
all cp ranks hold equally many, so the mean over cp ranks is the mean over the whole sequence, and
averaging gradients over dp × ep × cp gives the gradient of the global mean. The reported loss is the
cross-entropy alone, averaged the same way.

**pp × cp.** They compose: a stage's blocks keep their ring attention, and the activations sent between
stages are the local shard, ``(MBS, seq_len / cp, d_model)``. The cp ranks of a stage run the same
schedule, so their rings meet in the same order.

Run it: ``python -m reference.parallel.train_4d --dp 2 --tp 2 --pp 2 --ep 1`` spawns 8 CPU ranks with
the kit's helper (``--cp 2 --dp 2 --tp 2 --pp 1``: context parallelism on 8 ranks); under ``torchrun
--nproc-per-node 8 -m reference.parallel.train_4d --dp 2 …`` each process is one rank of the launcher's
process group (one or several nodes; see ``train_4d.slurm`` and :mod:`kit.launch`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from kit.data import random_batch
from kit.model import ModelConfig, TransformerLM, make_optimizer
from kit.validate import choice, index, instance, positive_int

from .expert_parallel import MoEFeedForward, parallelize_moe
from .mesh import build_mesh, dense_grad_group, expert_grad_group
from .pipeline_parallel import ORDERS, SCHEDULES, PipelineStage, run_schedule
from .tensor_parallel import parallelize_block

if TYPE_CHECKING:  # Stage 4's module is imported where it is used: a Stage 4 that does not import fails only that
    from ..ddp import DDPBucketed

#: The tiny model the tests, notebook and benchmarks train: 4 blocks, each with a 4-expert MoE.
TINY_MOE = ModelConfig(vocab_size=128, context_length=16, d_model=32, d_ff=64, num_layers=4, num_heads=4)


@dataclass(frozen=True)
class Train4DConfig:
    """One training run on the mesh. ``global_batch_size`` must equal ``micro_batch_size · grad_accum_steps ·
    dp · ep`` (cp ranks share their rows); ``seq_len`` must divide by ``cp`` (``"contiguous"``) or ``2·cp``
    (``"zigzag"``)."""

    dp: int = 2
    tp: int = 2
    pp: int = 2
    ep: int = 1
    cp: int = 1
    cp_layout: str = "zigzag"
    global_batch_size: int = 8
    micro_batch_size: int = 2
    grad_accum_steps: int = 2
    steps: int = 3
    seq_len: int = 16
    model: ModelConfig = TINY_MOE
    num_experts: int = 4
    top_k: int = 2
    capacity_factor: float | None = 1.25
    aux_loss_coef: float = 0.01
    lr: float = 3e-3
    weight_decay: float = 0.1
    seed: int = 0
    schedule: str = "1f1b"
    bucket_size_mb: float | None = 25.0
    zero: bool = False
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "ep", "cp", "global_batch_size", "micro_batch_size", "grad_accum_steps", "steps",
                     "seq_len", "num_experts", "top_k"):
            positive_int(f"Train4DConfig.{name}", getattr(self, name))
        instance("Train4DConfig.model", self.model, ModelConfig, "a kit.model.ModelConfig")
        expected = self.micro_batch_size * self.grad_accum_steps * self.dp * self.ep
        if self.global_batch_size != expected:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must equal micro_batch_size × grad_accum_steps × "
                f"dp × ep = {self.micro_batch_size} × {self.grad_accum_steps} × {self.dp} × {self.ep} = {expected} "
                "(expert-parallel ranks read their own data, like data-parallel ones)"
            )
        choice("Train4DConfig.schedule", self.schedule, SCHEDULES)
        if self.seq_len > self.model.context_length:
            raise ValueError(
                f"seq_len ({self.seq_len}) exceeds the model's context_length ({self.model.context_length})")
        if self.model.num_layers < self.pp:
            raise ValueError(f"pp ({self.pp}) must be ≤ num_layers ({self.model.num_layers})")
        choice("Train4DConfig.cp_layout", self.cp_layout, ("contiguous", "zigzag"))
        chunks = self.cp * (2 if self.cp_layout == "zigzag" else 1)
        if self.seq_len % chunks:
            raise ValueError(
                f"seq_len ({self.seq_len}) must be divisible by {'2·cp' if self.cp_layout == 'zigzag' else 'cp'} = "
                f"{chunks}: the {self.cp_layout} layout gives each of the cp = {self.cp} ranks equal chunks "
                "(handout 06b §1)")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.ep * self.cp

    def with_(self, **changes) -> Train4DConfig:
        return replace(self, **changes)


def build_model(cfg: Train4DConfig) -> TransformerLM:
    """The full, unsharded model every rank starts from: the kit's Transformer with each ``ffn`` replaced by
    a :class:`MoEFeedForward`. Seeded by ``cfg.seed``: the same weights on every rank and in a single process."""
    torch.manual_seed(cfg.seed)
    model = TransformerLM(cfg.model)
    for block in model.layers:
        block.ffn = MoEFeedForward(cfg.model.d_model, cfg.model.d_ff, cfg.num_experts, top_k=cfg.top_k,
                                   capacity_factor=cfg.capacity_factor)
    return model


def global_batch(cfg: Train4DConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of step ``step``, both ``(global_batch_size, seq_len)`` int64."""
    return random_batch(cfg.global_batch_size, cfg.seq_len, cfg.model.vocab_size, seed=cfg.seed + step)


def microbatches(cfg: Train4DConfig, step: int, shard: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``grad_accum_steps`` micro-batches of data shard ``shard`` (``0 ≤ shard < dp·ep``) at ``step``.

    Raises:
        TypeError: ``shard`` is not an int.
        ValueError: ``shard`` outside ``[0, dp·ep)``.
    """
    index("shard", shard, cfg.dp * cfg.ep)  # a data shard: 0 ≤ shard < dp·ep
    # BEGIN SOLUTION MBS·GA consecutive rows for this shard, cut into GA micro-batches (handout 06 §5.2)
    inputs, targets = global_batch(cfg, step)
    b, ga = cfg.micro_batch_size, cfg.grad_accum_steps
    start = shard * b * ga
    return [(inputs[start + i * b:start + (i + 1) * b], targets[start + i * b:start + (i + 1) * b]) for i in range(ga)]
    # END SOLUTION


def parallelize_context(model: TransformerLM, mesh, cfg: Train4DConfig) -> TransformerLM:
    """Context parallelism applied to an unchanged model, in place: every attention becomes
    ``ring_attention`` over ``mesh.get_group("cp")``, and every rotary embedding rotates this rank's tokens by
    their global positions ``shard_positions(cfg.seq_len, cfg.cp, cp_index, cfg.cp_layout)``. Nothing to do
    when ``cfg.cp == 1``. Returns the model."""
    if cfg.cp == 1:
        return model
    from .context_parallel import ring_attention, shard_positions  # part 2 of the stage: only cp > 1 needs it

    cp_rank = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))["cp"]
    # BEGIN SOLUTION global positions of this rank's shard for rotary; attention as a ring over cp (handout 06b §6)
    group, layout = mesh.get_group("cp"), cfg.cp_layout

    def attention_over_the_ring(q, k, v, is_causal: bool):
        return ring_attention(q, k, v, group, is_causal=is_causal, layout=layout)

    model.set_attention(attention_over_the_ring)
    positions = shard_positions(cfg.seq_len, cfg.cp, cp_rank, layout)
    model.set_positions(positions.to(model.lm_head.weight.device))
    return model
    # END SOLUTION


def sequence_shards(cfg: Train4DConfig, batches: list[tuple[torch.Tensor, torch.Tensor]], cp_rank: int
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Context-parallel rank ``cp_rank``'s part of each ``(inputs, targets)`` micro-batch: both ``(MBS, seq_len /
    cp)`` int64, the tokens at ``shard_positions(seq_len, cp, cp_rank, cfg.cp_layout)`` of every row — the same
    positions for both, so each target is still the token after its input. With ``cfg.cp == 1``, the batches.

    Raises:
        TypeError: ``cp_rank`` is not an int.
        ValueError: ``cp_rank`` outside ``[0, cp)``.
    """
    index("cp_rank", cp_rank, cfg.cp)  # a context-parallel rank: 0 ≤ cp_rank < cp
    if cfg.cp == 1:
        return list(batches)
    from .context_parallel import shard_sequence

    # BEGIN SOLUTION inputs and targets sharded along the sequence (dim −1) at the same positions (handout 06b §6)
    shards = []
    for inputs, targets in batches:
        local_inputs = shard_sequence(inputs, cp=cfg.cp, cp_rank=cp_rank, layout=cfg.cp_layout, dim=-1)
        local_targets = shard_sequence(targets, cp=cfg.cp, cp_rank=cp_rank, layout=cfg.cp_layout, dim=-1)
        shards.append((local_inputs, local_targets))
    return shards
    # END SOLUTION


@dataclass
class Parallelized:
    """This rank's share of the model: its pipeline stage and the DDP wrappers of its gradients."""

    stage: PipelineStage
    dense_ddp: DDPBucketed
    expert_ddp: DDPBucketed | None
    coords: dict[str, int] = field(default_factory=dict)


def parallelize(model: TransformerLM, mesh, cfg: Train4DConfig) -> Parallelized:
    """Apply cp, pp, then tp, then ep, then dp to an unchanged model, torchtitan style; returns this rank's part."""
    from ..ddp import DDPBucketed  # Stage 4's, imported here: only what trains with it depends on Stage 4

    coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    parallelize_context(model, mesh, cfg)
    # BEGIN SOLUTION stage (pp), blocks (tp), MoEs (ep), then DDPBucketed for dense and expert params (handout 06 §5.1)
    stage = PipelineStage(model, coords["pp"], cfg.pp)
    tp_group, ep_group = mesh.get_group("tp"), mesh.get_group("ep")
    experts: list[nn.Parameter] = []
    for block in stage.layers.values():
        parallelize_block(block, tp_group)
        if isinstance(block.ffn, MoEFeedForward):
            parallelize_moe(block.ffn, ep_group)
            # The balancing loss is backpropagated where it is computed (its micro-batch's share: 1/GA).
            block.ffn.aux_grad_scale = cfg.aux_loss_coef / cfg.grad_accum_steps
            experts += block.ffn.expert_parameters()
    expert_ids = {id(p) for p in experts}
    dense = [p for p in stage.parameters() if id(p) not in expert_ids]
    dense_ddp = DDPBucketed(_Params(dense), cfg.bucket_size_mb, process_group=dense_grad_group(mesh))
    expert_ddp = None
    if experts:
        expert_ddp = DDPBucketed(_Params(experts), cfg.bucket_size_mb, process_group=expert_grad_group(mesh))
    return Parallelized(stage, dense_ddp, expert_ddp, coords)
    # END SOLUTION


def train_step(part: Parallelized, optimizer: torch.optim.Optimizer, cfg: Train4DConfig, step: int, mesh) -> float:
    """One optimizer step on this rank; returns the step's loss (mean cross-entropy over the global batch)."""
    coords = part.coords
    shard = coords["dp"] * cfg.ep + coords["ep"]
    device = _device(cfg)
    local = sequence_shards(cfg, microbatches(cfg, step, shard), coords["cp"])  # this cp rank's part of each row
    batches = [(x.to(device), y.to(device)) for x, y in local]
    ddps = [d for d in (part.dense_ddp, part.expert_ddp) if d is not None]
    order = ORDERS[cfg.schedule](cfg.pp, coords["pp"], len(batches))  # this stage's F/B operations
    # BEGIN SOLUTION whole schedule without DP sync, then sync once, rescale expert grads, step (handout 06 §5.2)
    for ddp in ddps:
        ddp.on_train_batch_start()
    # DDP decides at forward time whether a backward communicates. The pipeline runs the forwards, so tell
    # each wrapper "accumulate locally" for the whole schedule, then "synchronise" once it is over.
    with contextlib.ExitStack() as stack:
        for ddp in ddps:
            stack.enter_context(ddp.no_sync())
            ddp()
        result = run_schedule(part.stage, batches, order, group=mesh.get_group("pp"),
                              activation_shape=(cfg.micro_batch_size, cfg.seq_len // cfg.cp, cfg.model.d_model))
    for ddp in ddps:
        ddp()
        ddp.finish_gradient_synchronization()
    if part.expert_ddp is not None and cfg.ep > 1:
        # An expert's gradient already sums the tokens of all ep ranks (the all-to-all backward brought them
        # home); DDP divided by dp·cp only, so divide by ep to average over all dp·ep data shards.
        for p in part.expert_ddp.parameters():
            if p.grad is not None:
                p.grad.div_(cfg.ep)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = torch.tensor(result.loss, device=device)
    group = dense_grad_group(mesh)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(loss, group=group)
        loss /= dist.get_world_size(group)
    return float(loss)
    # END SOLUTION


def make_train_optimizer(part: Parallelized, cfg: Train4DConfig, mesh) -> torch.optim.Optimizer:
    """AdamW over the stage (the kit's defaults), or Stage 5's ZeRO-1 :class:`ShardedOptimizer` with ``cfg.zero``."""
    if not cfg.zero:
        return make_optimizer(part.stage, lr=cfg.lr, weight_decay=cfg.weight_decay)
    from ..zero import ShardedOptimizer

    # Dense parameters are replicated over dp × ep, so their optimizer state is sharded over that group.
    # (Expert parameters would shard over dp; one wrapper per group keeps the example short: experts stay
    # in a plain AdamW.)
    dense = list(part.dense_ddp.parameters())
    experts = list(part.expert_ddp.parameters()) if part.expert_ddp is not None else []
    optimizers = [ShardedOptimizer(dense, torch.optim.AdamW, process_group=dense_grad_group(mesh), lr=cfg.lr,
                                   betas=(0.9, 0.95), weight_decay=cfg.weight_decay)]
    if experts:
        optimizers.append(torch.optim.AdamW(experts, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay))
    return _Optimizers(optimizers)


def train(cfg: Train4DConfig, mesh=None, *, step_callback=None) -> dict:
    """Train ``cfg.steps`` steps on this rank; call on every rank of a ``cfg.world_size`` process group.

    Returns ``{"losses": [...] (same on every rank), "params": {name: local tensor}, "coords": {axis: index},
    "step_s": [...]}``. ``step_callback(step)`` returns a context manager entered around each step (the
    tests count the bytes each collective moves with it).

    Raises:
        TypeError: ``cfg`` is not a ``Train4DConfig``.
    """
    instance("cfg", cfg, Train4DConfig, "a Train4DConfig")
    mesh = mesh or build_mesh(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, cp=cfg.cp, device_type=cfg.device_type)
    part = parallelize(build_model(cfg).to(_device(cfg)), mesh, cfg)
    optimizer = make_train_optimizer(part, cfg, mesh)
    losses, times = [], []
    for step in range(cfg.steps):
        context = step_callback(step) if step_callback else contextlib.nullcontext()
        t0 = time.perf_counter()
        with context:
            losses.append(train_step(part, optimizer, cfg, step, mesh))
        times.append(time.perf_counter() - t0)
    params = {n: p.detach().cpu().clone() for n, p in part.stage.named_parameters()}
    return {"losses": losses, "params": params, "coords": part.coords, "step_s": times}


# ------------------------------------------------------------------------------------------------------
# Given helpers and the command line: read them, no need to change them.


def _device(cfg: Train4DConfig) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cfg.device_type == "cuda" else torch.device("cpu")


class _Params(nn.Module):
    """Holds a subset of a stage's parameters (the same tensors) so a DDP wrapper can own just those."""

    def __init__(self, params: list[nn.Parameter]):
        super().__init__()
        self.params = nn.ParameterList(params)

    def forward(self) -> None:  # the pipeline runs the real forward; DDP only needs to be told (see train_step)
        return None


class _Optimizers:
    """Several optimizers stepped as one."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def _spawned(cfg_dict: dict) -> dict:
    cfg = Train4DConfig(**{**cfg_dict, "model": ModelConfig(**cfg_dict["model"])})
    out = train(cfg)
    return {"losses": out["losses"], "coords": out["coords"], "step_s": out["step_s"]}


def train_on_ranks(cfg: Train4DConfig, *, timeout: float = 300.0) -> list[dict]:
    """Start ``cfg.world_size`` gloo ranks on this machine and :func:`train` on them (given code).

    Returns, by rank, ``{"losses": [...], "coords": {axis: index}, "step_s": [...]}``.

    Raises:
        TypeError: ``cfg`` is not a ``Train4DConfig``.
    """
    if not isinstance(cfg, Train4DConfig):
        raise TypeError(f"cfg must be a Train4DConfig, got {type(cfg).__name__}")
    from kit.spawn import run_on_ranks

    cfg_dict = {**asdict(cfg), "model": asdict(cfg.model)}
    return run_on_ranks(_spawned, cfg.world_size, args=(cfg_dict,), timeout=timeout, backend="gloo")


def config_from_args(argv: list[str] | None = None) -> Train4DConfig:
    """The :class:`Train4DConfig` the command line ``argv`` asks for (a bad combination is a usage error)."""
    ap = argparse.ArgumentParser(description="Train a tiny MoE Transformer on a dp × tp × pp × ep × cp mesh.")
    for axis, default in (("dp", 2), ("tp", 2), ("pp", 2), ("ep", 1), ("cp", 1)):
        ap.add_argument(f"--{axis}", type=int, default=default)
    ap.add_argument("--cp-layout", choices=("contiguous", "zigzag"), default="zigzag",
                    help="how the sequence is cut over the cp ranks (handout 06b §5)")
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--grad-accum-steps", type=int, default=2)
    ap.add_argument("--global-batch-size", type=int, default=None, help="default: MBS × GA × dp × ep")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    ap.add_argument("--zero", action="store_true", help="ZeRO-1 (Stage 5) for the dense parameters")
    args = ap.parse_args(argv)
    gbs = args.global_batch_size or args.micro_batch_size * args.grad_accum_steps * args.dp * args.ep
    try:
        return Train4DConfig(dp=args.dp, tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp, cp_layout=args.cp_layout,
                             global_batch_size=gbs,
                             micro_batch_size=args.micro_batch_size, grad_accum_steps=args.grad_accum_steps,
                             steps=args.steps, schedule=args.schedule, zero=args.zero)
    except (TypeError, ValueError) as exc:
        ap.error(str(exc))
        raise  # unreachable: ap.error exits


def main(argv: list[str] | None = None) -> None:
    """Command line. Under torchrun (one node or several) this process is one rank of the launcher's process
    group; without a launcher it spawns the ``dp·tp·pp·ep·cp`` ranks on this CPU. Either way it prints each step's
    loss, then one JSON line ``{"losses": [...], "step_s": [...], "world_size": W, "launcher": ...}`` (under
    torchrun, rank 0 alone prints). A launch that cannot work (a world size other than dp·tp·pp·ep·cp, a missing
    rendezvous) prints why and exits with status 2 before any rank waits (:mod:`kit.launch`)."""
    from kit.launch import exit_on_launch_error, join, launched, leave, require_world_size

    with exit_on_launch_error("train_4d"):
        cfg = config_from_args(argv)
        launch = launched()
        if launch is None:
            out = train_on_ranks(cfg)[0]
        else:
            mesh = f"--dp {cfg.dp} --tp {cfg.tp} --pp {cfg.pp} --ep {cfg.ep} --cp {cfg.cp} (dp·tp·pp·ep·cp)"
            require_world_size(cfg.world_size, mesh, launch)
            if launch.rank == 0 and launch.local_world_size < launch.world_size and launch.local_world_size % cfg.tp:
                print(f"train_4d: note: tp={cfg.tp} does not divide the {launch.local_world_size} ranks per node, so "
                      "tensor-parallel groups span nodes, over the slowest links (handout 06 §1)", flush=True)
            backend = join(launch)
            out = train(cfg.with_(device_type="cuda" if backend == "nccl" else "cpu"))
            leave()
            if launch.rank != 0:
                return
    for step, loss in enumerate(out["losses"]):
        print(f"step {step}: loss {loss:.4f}  ({out['step_s'][step] * 1e3:.0f} ms)")
    launcher = "spawn" if launch is None else "torchrun" if launch.torchrun else "environment"
    print(json.dumps({"losses": out["losses"], "step_s": out["step_s"], "world_size": cfg.world_size,
                      "launcher": launcher}), flush=True)


if __name__ == "__main__":
    main()
