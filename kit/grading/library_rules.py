"""What a submission may not call: the library implementation of the thing its chapter has it build.

Each chapter grades something the student builds — a loss scaler, FlashAttention, DDP, ZeRO, FSDP, a fused loss,
a fused AdamW — and PyTorch ships a working version of most of them. Wrapping that version passes every test of
behaviour (it *is* right), so a full grade would mean nothing. A :class:`Rule` names, for one thing built, the
library entry points that do the graded logic. While a graded function runs, :func:`watch` records every call
of them whose Python stack passes through the submission's package, every object the submission hands back
whose class derives from one of them, and every forbidden operator dispatched (a ``TorchDispatchMode``). The
rule tests (``tests/test_stage*_rules.py``) run a representative workload this way in the worker and judge
the record; :func:`static_findings` is the judge's second line, reading the submission's source as text.

The line is "delegates the graded logic", not "touches torch": building blocks stay allowed — collectives
(``all_reduce``, ``all_to_all_single``, functional collectives), ``_foreach_*`` kernels, GradScaler's
unscale-and-check kernel (``_amp_foreach_non_finite_check_and_unscale_``), ``torch.utils.checkpoint`` — and
so does anything the test itself calls (its references run outside the watch, or from the kit's frames).

A student who defeats the watch inside their own process can; it is visible in their code. The watch exists
so that the plain shortcut never earns the points.
"""

from __future__ import annotations

import ast
import functools
import importlib
import sys
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RULES", "Rule", "Violation", "Watch", "describe_one", "rule", "static_findings", "submission_root", "watch"]

_SDPA_OPS = ("scaled_dot_product_attention", "_scaled_dot_product_attention_math",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
             "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
             "_flash_attention_backward", "_efficient_attention_forward", "_efficient_attention_backward")
# torch's context parallelism (handout 06b, What is graded), as torch 2.13 has it: the implementation lives in
# experimental._context_parallel._attention; experimental._attention (the module before torch 2.8) is a stub that
# re-exports its public and ring functions, patched there too. Torch's own functions reach the private ones
# through their module's globals and its classes' methods, so a submission that imported a name before the watch
# began still trips the rotater, the merger or the ring's backward. An entry another torch lacks is skipped
# (:func:`_patch`), and the judge's reading of the source (``_CP_STATIC``) does not depend on the version.
_CP = "torch.distributed.tensor.experimental"
_CP_REEXPORTED = ("context_parallel", "context_parallel_unshard", "_context_parallel_shard", "set_rotate_method",
                  "_enable_context_parallel_dispatcher", "_templated_ring_attention")
_CP_INTERNAL = ("_templated_ring_attention_backward", "_create_rotater", "_scaled_dot_product_ring_flash_attention",
                "_scaled_dot_product_ring_flash_attention_backward", "_scaled_dot_product_ring_efficient_attention",
                "_scaled_dot_product_ring_efficient_attention_backward", "_scaled_dot_product_ring_cudnn_attention",
                "_scaled_dot_product_ring_cudnn_attention_backward", "_SDPAMerger.step",
                "_AllToAllRotater.exchange_buffers", "_AllGatherRotater.exchange_buffers", "_ContextParallel.__init__")
_CP_ENTRIES = (tuple(f"{_CP}.{name}" for name in ("context_parallel", "local_map", "register_sharding",
                                                  "implicit_replication"))
               + tuple(f"{_CP}._attention.{name}" for name in _CP_REEXPORTED)
               + tuple(f"{_CP}._context_parallel._attention.{name}" for name in _CP_REEXPORTED + _CP_INTERNAL))
_CP_STATIC = ("context_parallel", "context_parallel_unshard", "_context_parallel_shard", "local_map",
              "register_sharding", "implicit_replication", "set_rotate_method", "_templated_ring_attention",
              "_templated_ring_attention_backward", "_create_rotater", "_SDPAMerger", "_RingRotater",
              "_AllToAllRotater", "_AllGatherRotater", "_ContextParallel", "_AttentionContextParallel",
              "_scaled_dot_product_ring_flash_attention", "_scaled_dot_product_ring_efficient_attention",
              "_scaled_dot_product_ring_cudnn_attention")
# What a Triton path must leave to its kernels: the matrix products, the softmax and its log-sum-exp, attention,
# the loss. (Elementwise work, reductions for checks, allocation and copies stay allowed in the wrapper.)
_TORCH_MATH_OPS = ("mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "dot", "mv", "linear", "einsum",
                   "_softmax", "softmax", "_log_softmax", "log_softmax", "logsumexp", "_softmax_backward_data",
                   "_log_softmax_backward_data", "nll_loss", "nll_loss_forward", "nll_loss_backward",
                   "nll_loss2d_forward", "cross_entropy_loss") + _SDPA_OPS


@dataclass(frozen=True)
class Rule:
    """One thing a chapter has the student build, and the library code that must not build it for them.

    ``entries``: dotted paths of Python callables (``"torch.amp.GradScaler.update"``); a call whose stack passes
    through the submission breaks the rule. ``classes``: dotted paths of classes the submission's objects must
    not derive from. ``ops``: ATen operator names (``"_amp_update_scale_"``) that must not be dispatched while the
    graded code runs. ``section``: where the chapter states the rule. ``modules`` (files or folders of the
    package) and ``static`` (identifiers): the judge's reading — no code in those modules may call or derive
    from one of them (:func:`static_findings`)."""

    key: str
    stage: int
    builds: str
    library: str
    section: str
    entries: tuple[str, ...] = ()
    classes: tuple[str, ...] = ()
    ops: tuple[str, ...] = ()
    allowed: str = ""
    modules: tuple[str, ...] = ()
    static: tuple[str, ...] = ()


RULES: tuple[Rule, ...] = (
    Rule("grad-scaler", 2, "the dynamic loss scaler (DynamicLossScaler)", "torch.amp.GradScaler",
         "handout 02, What is graded",
         entries=("torch.amp.GradScaler.__init__", "torch.amp.GradScaler.scale", "torch.amp.GradScaler.unscale_",
                  "torch.amp.GradScaler.step", "torch.amp.GradScaler.update"),
         classes=("torch.amp.GradScaler",), ops=("_amp_update_scale_",),
         allowed="torch._amp_foreach_non_finite_check_and_unscale_ (the unscale-and-check kernel), _foreach_* ops",
         modules=("precision.py",), static=("GradScaler", "_amp_update_scale_")),
    Rule("sdpa", 3, "FlashAttention-2 in PyTorch (FlashAttentionPytorch)",
         "torch.nn.functional.scaled_dot_product_attention and its ATen kernels", "handout 03, What is graded",
         entries=("torch.nn.functional.scaled_dot_product_attention",), ops=_SDPA_OPS,
         allowed="torch matmuls, exp, max and sums in FlashAttentionPytorch; Triton kernels in FlashAttentionTriton",
         modules=("flash_attention/pytorch_impl.py",), static=_SDPA_OPS),
    Rule("triton-attention", 3, "FlashAttentionTriton's forward and backward in Triton kernels",
         "PyTorch matmuls, softmax, log-sum-exp or attention in the Triton path", "handout 03, What is graded",
         entries=("torch.nn.functional.scaled_dot_product_attention",), ops=_TORCH_MATH_OPS,
         allowed="allocating outputs, reshapes, .contiguous(), elementwise work such as D = rowsum(dO∘O)",
         modules=("flash_attention/triton_impl.py", "flash_attention/triton_forward.py",
                  "flash_attention/triton_backward.py", "flash_attention/triton_backward_fused.py"),
         static=_SDPA_OPS),
    Rule("torch-ddp", 4, "data parallelism (the four DDP classes)",
         "torch.nn.parallel.DistributedDataParallel and its C++ Reducer", "handout 04, What is graded",
         entries=("torch.nn.parallel.DistributedDataParallel.__init__",
                  "torch.nn.parallel.DistributedDataParallel.forward",
                  "torch.distributed.Reducer", "torch._C._distributed_c10d.Reducer"),
         classes=("torch.nn.parallel.DistributedDataParallel",),
         allowed="torch.distributed collectives (all_reduce, broadcast…), async_op, futures, functional collectives",
         modules=("ddp.py",), static=("DistributedDataParallel", "Reducer", "_DDPSink")),
    Rule("torch-zero", 5, "optimizer-state sharding (ShardedOptimizer)",
         "torch.distributed.optim.ZeroRedundancyOptimizer", "handout 05, What is graded",
         entries=("torch.distributed.optim.ZeroRedundancyOptimizer.__init__",
                  "torch.distributed.optim.ZeroRedundancyOptimizer.step"),
         classes=("torch.distributed.optim.ZeroRedundancyOptimizer",),
         allowed="the wrapped optimizer class (torch.optim.AdamW…) on the local shard, collectives",
         modules=("zero.py",), static=("ZeroRedundancyOptimizer",)),
    Rule("torch-fsdp", 5, "fully sharded data parallelism (FSDP)",
         "torch.distributed.fsdp.fully_shard and FullyShardedDataParallel", "handout 05b, What is graded",
         entries=("torch.distributed.fsdp.fully_shard", "torch.distributed._composable.fsdp.fully_shard",
                  "torch.distributed.fsdp.FullyShardedDataParallel.__init__"),
         classes=("torch.distributed.fsdp.FullyShardedDataParallel", "torch.distributed.fsdp.FSDPModule"),
         allowed="collectives (all_gather_into_tensor, reduce_scatter_tensor…), hooks, torch.autograd.Function",
         modules=("fsdp.py",), static=("fully_shard", "FullyShardedDataParallel", "FSDPModule")),
    Rule("torch-context-parallel", 6, "ring attention (context parallelism)",
         "torch.distributed.tensor.experimental's context parallelism and PyTorch's attention kernels",
         "handout 06b, What is graded",
         entries=("torch.nn.functional.scaled_dot_product_attention", *_CP_ENTRIES), ops=_SDPA_OPS,
         allowed="torch.distributed point-to-point calls and collectives (isend, irecv, P2POp, batch_isend_irecv, "
                 "all_gather…) and their work handles; plain tensor arithmetic for the merge (exp, log1p, maximum, "
                 "sums); the block interface (attention_forward_with_lse, attention_backward_with_lse)",
         modules=("parallel/context_parallel.py",), static=_CP_STATIC + _SDPA_OPS),
    Rule("torch-adamw", 7, "the fused AdamW update (FusedAdamW)", "torch.optim.Adam / AdamW and their kernels",
         "handout 07b, What is graded",
         entries=("torch.optim.Adam.__init__", "torch.optim.AdamW.__init__", "torch.optim.adam._single_tensor_adam",
                  "torch.optim.adam._multi_tensor_adam", "torch.optim.adam._fused_adam", "torch.optim.adam.adam"),
         classes=("torch.optim.Adam", "torch.optim.AdamW"), ops=("_fused_adam_", "_fused_adamw_"),
         allowed="_foreach_* ops and your own Triton kernels; torch.optim.Optimizer as the base class",
         modules=("whole_step/fused_adamw.py",),
         static=("Adam", "AdamW", "_single_tensor_adam", "_multi_tensor_adam", "_fused_adam", "_fused_adam_",
                 "_fused_adamw_")),
    # The reference's fused loss dispatches none of _TORCH_MATH_OPS (forward and backward, fp32 and bf16, on inputs
    # larger than the tests'): its checks, allocations, the mean over tokens and the casts are other ops. The judge
    # (tests/test_stage7_rules.py) also checks that dH and dW are stored by kernels that run tl.dot.
    Rule("triton-loss", 7, "the fused loss's forward and backward in Triton kernels",
         "PyTorch matmuls, softmax, log-sum-exp, cross-entropy", "handout 07, What is graded",
         ops=_TORCH_MATH_OPS,
         allowed="input checks, allocation, casts and copies, the final mean over tokens, elementwise work and "
                 "reductions such as combining per-tile partial log-sum-exps (max, exp, log, sum)"),
)


def rule(key: str) -> Rule:
    """The rule named ``key`` (``"torch-ddp"``…)."""
    for r in RULES:
        if r.key == key:
            return r
    raise KeyError(f"rule must be one of {[r.key for r in RULES]}, got {key!r}")


@dataclass
class Violation:
    """One breach: ``how`` is ``"called"`` (an entry point), ``"derives"`` (a class) or ``"dispatched"`` (an op);
    ``what`` the entry, class or op; ``where`` the innermost submission frame (``file:line in function``)."""

    rule: str
    how: str
    what: str
    where: str = ""

    def as_data(self) -> dict:
        return asdict(self)


@dataclass
class Watch:
    """What :func:`watch` saw: the violations, and how many times each forbidden op was dispatched."""

    package: str
    rules: tuple[Rule, ...]
    violations: list[Violation] = field(default_factory=list)

    def note(self, r: Rule, how: str, what: str, where: str = "") -> None:
        if not any(v.rule == r.key and v.how == how and v.what == what for v in self.violations):
            self.violations.append(Violation(r.key, how, what, where))

    def check_object(self, obj: Any) -> None:
        """Record a breach when ``obj``'s class derives from a forbidden class (subclassing, not composition)."""
        for r in self.rules:
            for dotted in r.classes:
                cls = _resolve(dotted)
                if isinstance(cls, type) and isinstance(obj, cls):
                    self.note(r, "derives", dotted, type(obj).__module__ + "." + type(obj).__qualname__)

    def as_data(self) -> list[dict]:
        return [v.as_data() for v in self.violations]


def _resolve(dotted: str) -> Any:
    """The object at ``dotted`` (``"torch.amp.GradScaler.update"``), or None where this torch lacks it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return None
        return obj
    return None


def _submission_frame(package: str) -> str:
    """``file:line in function`` of the innermost frame of ``package`` on the stack, or ``""`` when none."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name == package or name.startswith(package + "."):
            code = frame.f_code
            return f"{Path(code.co_filename).name}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return ""


def _patch(stack: ExitStack, dotted: str, seen: Watch, r: Rule) -> None:
    """Replace the callable at ``dotted`` for the duration of ``stack`` with one that records calls from the
    submission, then does what the original does."""
    owner_path, _, attr = dotted.rpartition(".")
    owner = _resolve(owner_path)
    original = getattr(owner, attr, None) if owner is not None else None
    if original is None:
        return
    raw = owner.__dict__.get(attr, original) if isinstance(owner, type) else original

    @functools.wraps(original)
    def recording(*args: Any, **kwargs: Any) -> Any:
        where = _submission_frame(seen.package)
        if where:
            seen.note(r, "called", dotted, where)
        elif args and isinstance(owner, type) and isinstance(args[0], owner):
            cls = type(args[0])  # a method of a subclass the submission defined, called by the test
            if cls.__module__ == seen.package or cls.__module__.startswith(seen.package + "."):
                seen.note(r, "derives", owner_path, cls.__module__ + "." + cls.__qualname__)
        return original(*args, **kwargs)

    replacement: Any = recording
    if isinstance(raw, staticmethod):
        replacement = staticmethod(recording)
    elif isinstance(raw, classmethod):
        replacement = classmethod(recording)
    try:
        setattr(owner, attr, replacement)
    except (AttributeError, TypeError):
        return  # a C type's attribute: the dispatch-level ops and the class check still see it
    stack.callback(setattr, owner, attr, raw)


@contextmanager
def watch(rules: Iterable[str], package: str | None = None) -> Iterator[Watch]:
    """Watch the block for breaches of ``rules`` (keys of :data:`RULES`) by ``package`` (default: the
    implementation in force, :func:`kit.impl.selected`). Yields the :class:`Watch`; call its
    :meth:`~Watch.check_object` on what the graded code hands back."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kit import impl

    chosen = tuple(rule(k) for k in rules)
    seen = Watch(package or impl.selected(), chosen)
    by_op = {op: r for r in chosen for op in r.ops}

    class _Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            if func.namespace == "aten" and name in by_op:
                seen.note(by_op[name], "dispatched", f"aten.{name}", _submission_frame(seen.package))
            return func(*args, **(kwargs or {}))

    with ExitStack() as stack:
        for r in chosen:
            for dotted in r.entries:
                _patch(stack, dotted, seen, r)
        if by_op:
            stack.enter_context(_Ops())
            # Composite ops (linear, einsum, matmul) decompose before they reach a dispatch mode; their pieces
            # (mm, bmm, _softmax…) are what is seen, and each of those is in the list too.
        yield seen


def describe_one(violation: dict, r: Rule) -> str:
    """One line of a rule's message for a violation recorded as data (:meth:`Watch.as_data`)."""
    # A judge's own finding (Stage 7's "computes dH … in no kernel with tl.dot") says its verb itself.
    verb = {"called": "calls", "derives": "derives from", "dispatched": "dispatches"}.get(violation["how"],
                                                                                          violation["how"])
    where = f" (at {violation['where']})" if violation.get("where") else ""
    return f"  - {verb} {violation['what']}{where}"


# ------------------------------------------------------------------------------------------ the judge's reading

MAX_SOURCE_BYTES = 2_000_000  # no real module is near this; a bigger one is not parsed (and says so)


def _chain(node: ast.AST) -> Iterator[str]:
    """The identifiers of a dotted expression: ``torch.amp.GradScaler.update`` → update, GradScaler, amp, torch."""
    while isinstance(node, ast.Attribute):
        yield node.attr
        node = node.value
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Call):  # super().__init__, GradScaler(...).update
        yield from _chain(node.func)


def _uses(tree: ast.AST) -> Iterator[tuple[str, int, str]]:
    """(identifier, line, how) for each identifier that code *calls* or *derives a class from* — not one it only
    names in a type check, an annotation, a string or a docstring (``isinstance(s, torch.amp.GradScaler)`` and
    ``scaler: DynamicLossScaler | torch.amp.GradScaler`` are fine; ``torch.amp.GradScaler(...)`` is not)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for ident in _chain(node.func):
                yield ident, node.lineno, "calls"
        elif isinstance(node, ast.ClassDef):
            for base in node.bases:
                for ident in _chain(base):
                    yield ident, node.lineno, "derives from"


def submission_root(package: str | None = None) -> Path | None:
    """The folder of the submission's package: beside ``kit/`` in the repository or grading tree (where the grader
    stages it), found on disk — the judge imports nothing of it, nor asks the import system (the grader's guard
    refuses that). None when there is no such folder."""
    from kit import impl

    folder = Path(__file__).resolve().parents[2] / (package or impl.selected())
    return folder if folder.is_dir() else None


def static_findings(r: Rule, root: Path | None = None) -> list[str]:
    """Lines of the submission's modules for rule ``r`` (read as text, never imported) that call or derive from
    one of ``r.static``: ``"zero.py:12 derives from ZeroRedundancyOptimizer"``, one per identifier and file."""
    root = root or submission_root()
    if root is None:
        return []
    findings = []
    for relative in r.modules:
        path = root / relative
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            try:
                if file.stat().st_size > MAX_SOURCE_BYTES:
                    findings.append(f"{file.name} is over {MAX_SOURCE_BYTES} bytes and was not read")
                    continue
                tree = ast.parse(file.read_text(errors="replace"))
            except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
                continue  # missing, unreadable or not Python: the behaviour tests say so
            said: set[str] = set()
            for ident, line, how in _uses(tree):
                if ident in r.static and ident not in said:
                    said.add(ident)
                    findings.append(f"{file.relative_to(root)}:{line} {how} {ident}")
    return findings
