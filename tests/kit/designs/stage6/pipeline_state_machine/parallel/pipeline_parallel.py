"""Pipeline parallelism: layers split into stages on different ranks, micro-batches flowing through (handout 06 §3).

Stage ``s`` of ``p`` holds a contiguous run of layers (the first also the embedding, the last also the
final norm, LM head and loss). A batch is cut into ``m`` micro-batches. A **schedule** is, for each
stage, an order of operations ``("F", i)`` (forward of micro-batch ``i``) and ``("B", i)`` (its
backward). Running it is the same for every schedule:

* ``F i``: receive the activation from stage ``s-1`` (or embed the tokens), run the layers, send the
  output to stage ``s+1`` (or compute the loss). Keep what the backward needs.
* ``B i``: receive ∂L/∂output from stage ``s+1`` (or start from the loss), backpropagate, send
  ∂L/∂input to stage ``s-1``. Free that micro-batch's activations.

Sends are non-blocking and receives block, so a stage waits exactly when the data it needs has not been
produced yet — the **bubble**. **GPipe** runs all forwards, then all backwards: every stage holds ``m``
micro-batches of activations. **1F1B** runs ``p − s − 1`` warm-up forwards, then alternates one
forward and one backward: stage ``s`` never holds more than ``p − s`` micro-batches. Both idle for the
same fraction of the step, ``(p − 1) / (m + p − 1)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from kit.model import TransformerLM, cross_entropy
from kit.validate import choice, index, instance, integer, positive_int

Op = tuple[str, int]  # ("F", i) or ("B", i)


def bubble_fraction(p: int, m: int) -> float:
    """Idle fraction of a GPipe or 1F1B step with ``p`` stages and ``m`` micro-batches: ``(p−1)/(m+p−1)``.

    Raises:
        TypeError: ``p`` or ``m`` is not an int.
        ValueError: ``p < 1`` or ``m < 1``.
    """
    positive_int("p", p)
    positive_int("m", m)
    return (p - 1) / (m + p - 1)


def split_layers(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` layer ranges for ``pp`` stages; the first ``num_layers % pp`` get one more.

    Raises:
        TypeError: ``num_layers`` or ``pp`` is not an int.
        ValueError: ``pp < 1`` or more stages than layers.
    """
    integer("pp", pp, minimum=1, maximum=positive_int("num_layers", num_layers))  # 1 ≤ pp ≤ num_layers
    base, extra = divmod(num_layers, pp)
    ranges, start = [], 0
    for s in range(pp):
        end = start + base + (1 if s < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


class PipelineStage(nn.Module):
    """Stage ``stage`` of ``num_stages`` cut out of an unchanged :class:`~kit.model.TransformerLM`.

    Keeps the model's own submodules and parameter names (``layers.3.attn.q_proj.weight``), so a stage's
    ``named_parameters()`` are a subset of the full model's. ``forward``: first stage takes tokens
    ``(B, T)`` int64, others activations ``(B, T, d_model)``; the last returns logits ``(B, T, vocab)``,
    others activations.
    """

    def __init__(self, model: TransformerLM, stage: int, num_stages: int):
        super().__init__()
        instance("model", model, TransformerLM, "a kit.model.TransformerLM")
        index("stage", stage, num_stages)
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.layer_range = split_layers(len(model.layers), num_stages)[stage]
        self.d_model = model.config.d_model
        start, end = self.layer_range
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(start, end)})
        self.token_embeddings = model.token_embeddings if self.is_first else None
        self.final_norm = model.final_norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.token_embeddings(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.is_last:
            x = self.lm_head(self.final_norm(x))
        return x


def gpipe_order(p: int, s: int, m: int) -> list[Op]:
    """GPipe on stage ``s`` of ``p``: ``F 0 … F m−1`` then ``B 0 … B m−1``."""
    _check_psm(p, s, m)
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_order(p: int, s: int, m: int) -> list[Op]:
    """1F1B on stage ``s`` of ``p``: ``w = min(p−s−1, m)`` warm-up forwards, then alternate F and B, then drain.

    Backwards run in micro-batch order; stage ``s`` holds at most ``min(p − s, m)`` micro-batches.
    """
    _check_psm(p, s, m)
    # Forward whenever fewer than p − s micro-batches are in flight and forwards remain; otherwise the oldest
    # backward. That is warm-up, steady 1F1B and cool-down without writing the three phases.
    limit = min(p - s, m)
    order: list[Op] = []
    forwarded = backwarded = 0
    while backwarded < m:
        if forwarded < m and forwarded - backwarded < limit:
            order.append(("F", forwarded))
            forwarded += 1
        else:
            order.append(("B", backwarded))
            backwarded += 1
    return order


#: The schedules by name, each ``order(p, s, m)``: the one place the kit lists them.
ORDERS: dict[str, Callable[[int, int, int], list[Op]]] = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order}
SCHEDULES = tuple(ORDERS)


@dataclass
class PipelineResult:
    """What one pipelined step reports, on every rank of the pipeline.

    ``loss``: mean over micro-batches of ``loss_fn`` (computed on the last stage, broadcast to all).
    ``peak_activation_bytes``: this stage's :class:`ActivationMeter` peak. ``peak_in_flight``: most
    micro-batches forwarded but not yet backwarded at once. ``busy_s``/``total_s``: seconds computing
    vs the whole step (``1 − busy/total`` is the measured bubble). ``events``: ``(op, i, t0, t1)``.
    """

    loss: float
    peak_activation_bytes: int
    peak_in_flight: int
    busy_s: float
    total_s: float
    events: list[tuple[str, int, float, float]] = field(default_factory=list)


def run_schedule(
    stage: nn.Module,
    microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    order: Sequence[Op],
    *,
    group: dist.ProcessGroup | None,
    activation_shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy,
) -> PipelineResult:
    """Run this stage's ``order`` of F/B operations; gradients accumulate into ``stage``'s parameters.

    Args:
        stage: this rank's stage (``stage.is_first``/``stage.is_last`` say what it receives and sends).
        microbatches: ``m`` pairs ``(inputs (b, T) int64, targets (b, T) int64)``, the same on every stage
            (the first stage reads inputs, the last reads targets).
        order: this stage's operations, e.g. ``one_f_one_b_order(p, s, m)``.
        group: the pipeline process group; stage ``s`` is group rank ``s``.
        activation_shape: the shape of the activation between stages, ``(b, T, d_model)``.
        loss_fn: ``loss_fn(logits, targets)``; each micro-batch's loss is scaled by ``1/m`` before its
            backward, so the gradients are those of the mean loss.

    Point-to-point: activations go to group rank ``s+1``, gradients to ``s−1``, with ``dist.isend`` (waited
    at the end of the step) and blocking ``dist.recv``. Returns a :class:`PipelineResult`.

    Raises:
        ValueError: a schedule that does not match the micro-batches or this stage.
    """
    m = len(microbatches)
    if m < 1:
        raise ValueError("microbatches must hold at least one (inputs, targets) pair")
    if sorted(order) != sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)]):
        raise ValueError(f"order must contain F i and B i exactly once for each of the {m} micro-batches")
    group = dist.group.WORLD if group is None else group
    p, s = dist.get_world_size(group), dist.get_rank(group)
    prev = dist.get_global_rank(group, s - 1) if s > 0 else None
    nxt = dist.get_global_rank(group, s + 1) if s < p - 1 else None
    params = list(stage.parameters())
    device = params[0].device if params else torch.device("cpu")
    meter = ActivationMeter(params)
    inputs: dict[int, torch.Tensor | None] = {}
    outputs: dict[int, torch.Tensor] = {}  # the stage output, or the (unscaled) loss on the last stage
    pending: list[tuple[dist.Work, torch.Tensor]] = []
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    peak, busy, events = 0, 0.0, []
    start = time.perf_counter()
    for op, i in order:
        if op == "F":
            tokens, targets = microbatches[i]
            if stage.is_first:
                x = tokens
            else:
                x = torch.empty(tuple(activation_shape), dtype=dtype, device=device)
                dist.irecv(x, src=prev, group=group).wait()
                x.requires_grad_()
            t0 = time.perf_counter()
            with meter:
                out = stage(x)
                if stage.is_last:
                    out = loss_fn(out, targets)
                    loss_sum += out.detach().float()
            t1 = time.perf_counter()
            if not stage.is_last:
                sent = out.detach().contiguous()
                pending.append((dist.isend(sent, dst=nxt, group=group), sent))
            inputs[i], outputs[i] = (None if stage.is_first else x), out
            peak = max(peak, len(outputs))
        else:
            x, out = inputs.pop(i), outputs.pop(i)
            if stage.is_last:
                grad = torch.full_like(out, 1.0 / m)  # the mean over micro-batches: scale in the backward
            else:
                grad = torch.empty_like(out)
                dist.irecv(grad, src=nxt, group=group).wait()
            t0 = time.perf_counter()
            out.backward(grad)
            t1 = time.perf_counter()
            if not stage.is_first:
                sent = x.grad.contiguous()
                pending.append((dist.isend(sent, dst=prev, group=group), sent))
            del x, out
        busy += t1 - t0
        events.append((op, i, t0 - start, t1 - start))
    for work, _ in pending:
        work.wait()
    dist.broadcast(loss_sum, src=dist.get_global_rank(group, p - 1), group=group)
    return PipelineResult(loss=float(loss_sum.cpu()) / m, peak_activation_bytes=meter.peak, peak_in_flight=peak,
                          busy_s=busy, total_s=time.perf_counter() - start, events=events)


def gpipe(stage: nn.Module, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]], **kwargs) -> PipelineResult:
    """One GPipe step (all forwards, then all backwards); ``kwargs`` as :func:`run_schedule`."""
    group = kwargs.get("group")
    return run_schedule(stage, microbatches, gpipe_order(dist.get_world_size(group), dist.get_rank(group),
                                                         len(microbatches)), **kwargs)


def one_f_one_b(stage: nn.Module, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                **kwargs) -> PipelineResult:
    """One 1F1B step; ``kwargs`` as :func:`run_schedule`."""
    group = kwargs.get("group")
    return run_schedule(stage, microbatches, one_f_one_b_order(dist.get_world_size(group), dist.get_rank(group),
                                                               len(microbatches)), **kwargs)


def simulate_schedule(kind: str, p: int, m: int, t_forward: float = 1.0, t_backward: float = 2.0
                      ) -> list[list[tuple[str, int, float, float]]]:
    """Timeline of a schedule on ideal hardware: per stage a list of ``(op, i, start, end)``.

    Each stage runs its ops in order; ``F i`` on stage ``s`` waits for ``F i`` on ``s−1``, ``B i`` waits for
    ``B i`` on ``s+1`` (on the last stage, for its own ``F i``). Communication is free. Given helper for
    the notebook and the benchmark; uses :func:`gpipe_order` / :func:`one_f_one_b_order`.

    Raises:
        ValueError: an unknown ``kind``.
        RuntimeError: a schedule that deadlocks (no stage can make progress).
    """
    choice("kind", kind, SCHEDULES)
    orders = [ORDERS[kind](p, s, m) for s in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    timeline: list[list[tuple[str, int, float, float]]] = [[] for _ in range(p)]
    cursor, free = [0] * p, [0.0] * p
    while any(cursor[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if cursor[s] == len(orders[s]):
                continue
            op, i = orders[s][cursor[s]]
            dep = ("F", s - 1, i) if op == "F" and s > 0 else ("B", s + 1, i) if op == "B" and s < p - 1 else None
            if op == "B" and s == p - 1:
                dep = ("F", s, i)
            if dep is not None and dep not in done:
                continue
            t0 = max(free[s], done.get(dep, 0.0))
            t1 = t0 + (t_forward if op == "F" else t_backward)
            done[(op, s, i)] = free[s] = t1
            timeline[s].append((op, i, t0, t1))
            cursor[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {kind!r} deadlocks for p={p}, m={m}")
    return timeline


# ------------------------------------------------------------------------------------------------------
# Given helpers: argument checks and the activation meter. Read them; no need to change them.


def _check_psm(p: int, s: int, m: int) -> None:
    positive_int("p", p)
    positive_int("m", m)
    index("s", s, p)  # a stage index


class ActivationMeter:
    """Bytes of tensors autograd has saved for the backward and not yet freed (parameters excluded).

    Use as ``with meter:`` around forwards: ``saved_tensors_hooks`` sees each tensor saved for the
    backward; a tensor's bytes count once per storage while any graph still holds it. ``peak`` is the
    high-water mark — the activation memory a schedule needs.
    """

    def __init__(self, params: Sequence[torch.Tensor] = ()):
        self._param_storages = {p.untyped_storage().data_ptr() for p in params}
        self._refs: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _pack(self, t: torch.Tensor) -> object:
        key = t.untyped_storage().data_ptr()
        if key in self._param_storages or t.device.type == "meta":
            return t
        return _Saved(t, key, t.untyped_storage().nbytes(), self)

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class _Saved:
    """One saved tensor; counted while alive (autograd drops it when the graph is freed)."""

    __slots__ = ("tensor", "key", "meter", "__weakref__")

    def __init__(self, tensor: torch.Tensor, key: int, nbytes: int, meter: ActivationMeter):
        self.tensor, self.key, self.meter = tensor, key, meter
        refs = meter._refs.get(key, 0)
        if refs == 0:
            meter.current += nbytes
            meter.peak = max(meter.peak, meter.current)
            meter._sizes = getattr(meter, "_sizes", {})
            meter._sizes[key] = nbytes
        meter._refs[key] = refs + 1

    def __del__(self) -> None:
        meter = self.meter
        refs = meter._refs[self.key] - 1
        if refs == 0:
            del meter._refs[self.key]
            meter.current -= meter._sizes.pop(self.key)
        else:
            meter._refs[self.key] = refs
