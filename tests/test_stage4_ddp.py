"""Stage 4 — distributed data parallel (handout/04-ddp.md).

Every distributed check runs on 2 gloo ranks, one spawn per test (``kit.checks.run_check``: a hang costs
that test only). The expected values come from a single process training the same model on the full
batch, or from recording what the implementation sends (``kit.comm_log.CommLog`` sees every collective
and every ``wait()``, whoever issues it). Rank functions live at module level so the spawned ranks can
import them; they load the implementation with ``kit.impl.load()`` (the parent's ``--impl`` choice
travels through ``$LLMSYS_IMPL``). Checks run inside the ranks and raise with a message naming the rank,
the model, the class and the step; the test re-raises it (a stub's ``NotImplementedError`` stays one).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import kit.impl
from kit.checks import run_check
from kit.comm_log import CommLog, Event, format_events
from kit.model import ModelConfig, TransformerLM
from kit.spawn import RankFailedError, run_on_ranks
from kit.testing import assert_close, assert_equal, raises

pytestmark = pytest.mark.stage4

WORLD = 2
TIMEOUT = 120
KINDS = ("naive", "flat", "individual", "bucketed")
# A bucket cap small enough to split every toy model into several buckets, and None (one bucket).
BUCKET_SIZES = (0.0005, None)
FULL_BATCH = 8  # split into WORLD shards of 4, and for no_sync into 2 micro-batches of 2


# ----------------------------------------------------------------------------------------------------
# Toy models: each exercises one promise of handout 04 §1–§4
# ----------------------------------------------------------------------------------------------------


class FrozenParts(nn.Module):
    """Linear → ReLU·scale → Linear, where fc1's bias and the scale vector do not require grad."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc1.bias.requires_grad_(False)
        self.scale = nn.Parameter(torch.rand(16) + 0.5, requires_grad=False)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)) * self.scale)


class TiedWeights(nn.Module):
    """The embedding matrix is also the output projection (GPT-2's weight tying): one tensor, two uses."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.mix = nn.Linear(8, 8)
        self.out = nn.Linear(8, 32, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


class UnusedParameter(nn.Module):
    """``never_used`` is registered between fc1 and fc2 but forward never calls it: its grad stays None."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.never_used = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


TINY_LM = ModelConfig(vocab_size=64, context_length=8, d_model=16, d_ff=32, num_layers=1, num_heads=2)
MODELS = {
    "FrozenParts": FrozenParts,
    "TiedWeights": TiedWeights,
    "UnusedParameter": UnusedParameter,
    "TransformerLM": lambda: TransformerLM(TINY_LM),
}


def build(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def full_batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same full batch on every rank and in the single-process reference."""
    g = torch.Generator().manual_seed(1000 + step)
    if name in ("FrozenParts", "UnusedParameter"):
        return torch.randn(FULL_BATCH, 8, generator=g), torch.randint(0, 4, (FULL_BATCH,), generator=g)
    if name == "TiedWeights":
        tokens = torch.randint(0, 32, (FULL_BATCH, 6), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    tokens = torch.randint(0, TINY_LM.vocab_size, (FULL_BATCH, TINY_LM.context_length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy: the mean of equal-sized shard means is the full-batch mean."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def shard(t: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    size = t.shape[0] // parts
    return t[index * size : (index + 1) * size]


def make_optimizer(params) -> torch.optim.Optimizer:
    # Weight decay makes a zero gradient differ from a missing one: SGD skips parameters whose grad is None.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)


def wrap(impl, kind: str, model: nn.Module, bucket_mb: float | None = None):
    ddp = impl.ddp
    if kind == "naive":
        return ddp.NaiveDDP(model)
    if kind == "flat":
        return ddp.FlatDDP(model)
    if kind == "individual":
        return ddp.DDPIndividualParameters(model)
    return ddp.DDPBucketed(model, bucket_size_mb=bucket_mb)


def label(kind: str, bucket_mb: float | None) -> str:
    return f"{kind} (bucket_size_mb={bucket_mb})" if kind == "bucketed" else kind


def check_params(model: nn.Module, reference: nn.Module, what: str, section: str) -> None:
    rank = dist.get_rank()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert_close(p, q, name=f"rank {rank}, {what}: parameter {name}", section=section, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# Rank functions
# ----------------------------------------------------------------------------------------------------


def _construction_rank() -> dict:
    impl = kit.impl.load()
    rank = dist.get_rank()
    out = {}
    # The broadcast lives in the base class; NaiveDDP and FlatDDP add nothing to its construction, so this
    # test needs only Problem 4.1's code.
    for kind in ("naive", "flat"):
        for name in ("FrozenParts", "TransformerLM"):
            model = build(name, seed=100 + rank)  # every rank starts from its own random weights
            # numpy copies: tensors sent between processes would travel as shared memory that vanishes
            # when the rank exits.
            before = {k: v.numpy().copy() for k, v in model.state_dict().items()}
            wrap(impl, kind, model, 0.0005)
            after = {k: v.numpy().copy() for k, v in model.state_dict().items()}
            out[(kind, name)] = (before, after)
    return out


def _training_rank(kind: str, steps: int) -> None:
    """Train each toy model for ``steps`` steps; after each, compare with a single process on the full batch."""
    impl = kit.impl.load()
    rank = dist.get_rank()
    section = "handout 04 §2–§4"
    for bucket_mb in BUCKET_SIZES if kind == "bucketed" else (None,):
        for name in MODELS:
            reference = build(name, seed=0)  # what rank 0 starts from: the broadcast makes it everyone's start
            model = build(name, seed=rank)
            ddp = wrap(impl, kind, model, bucket_mb)
            optimizer, ref_optimizer = make_optimizer(ddp.parameters()), make_optimizer(reference.parameters())
            for step in range(steps):
                x, y = full_batch(name, step)
                ref_optimizer.zero_grad(set_to_none=True)
                loss_fn(reference, x, y).backward()
                ref_optimizer.step()

                optimizer.zero_grad(set_to_none=True)
                ddp.on_train_batch_start()
                loss_fn(ddp, shard(x, rank, WORLD), shard(y, rank, WORLD)).backward()
                ddp.finish_gradient_synchronization()
                what = f"{label(kind, bucket_mb)} on {name}, step {step + 1}"
                for pname, p in model.named_parameters():
                    if not p.requires_grad and p.grad is not None:
                        raise AssertionError(f"rank {rank}, {what}: frozen parameter {pname} got a .grad; "
                                             "parameters that do not require grad must be left alone (handout 04 §1)")
                if name == "UnusedParameter" and model.never_used.weight.grad is not None:
                    raise AssertionError(
                        f"rank {rank}, {what}: never_used.weight got a .grad although forward never used it; "
                        "a parameter without a gradient must keep grad None, or the optimizer's weight decay "
                        "moves it (handout 04 §7)")
                optimizer.step()
                check_params(model, reference, f"{what} (vs one process on the full batch)", section)


def _no_sync_rank(steps: int) -> None:
    """Two micro-batches per rank: the first inside no_sync (no collective), the second communicates."""
    impl = kit.impl.load()
    rank = dist.get_rank()
    for kind in KINDS:
        for name in ("FrozenParts", "UnusedParameter", "TransformerLM"):
            reference = build(name, seed=0)
            model = build(name, seed=rank)
            ddp = wrap(impl, kind, model, 0.0005)
            optimizer, ref_optimizer = make_optimizer(ddp.parameters()), make_optimizer(reference.parameters())
            for step in range(steps):
                x, y = full_batch(name, step)
                ref_optimizer.zero_grad(set_to_none=True)
                loss_fn(reference, x, y).backward()
                ref_optimizer.step()

                xs, ys = shard(x, rank, WORLD), shard(y, rank, WORLD)
                optimizer.zero_grad(set_to_none=True)
                ddp.on_train_batch_start()
                with CommLog() as log, ddp.no_sync():
                    # Forward and backward both inside: the loss is halved because the full-batch loss is
                    # the mean over two micro-batches.
                    (loss_fn(ddp, shard(xs, 0, 2), shard(ys, 0, 2)) / 2).backward()
                    ddp.finish_gradient_synchronization()  # inside no_sync this must not communicate either
                inside = log.collectives()
                what = f"{label(kind, 0.0005)} on {name}, step {step + 1}"
                if inside:
                    raise AssertionError(
                        f"rank {rank}, {what}: {len(inside)} collectives were issued inside no_sync() "
                        f"({log.format()}); gradients must only accumulate locally there (handout 04 §5)")
                (loss_fn(ddp, shard(xs, 1, 2), shard(ys, 1, 2)) / 2).backward()
                ddp.finish_gradient_synchronization()
                optimizer.step()
                check_params(model, reference, f"{what} with 2 accumulated micro-batches "
                             "(vs one process on the full batch)", "handout 04 §5")


OVERLAP_CAP_MB = 0.0041  # 4299 bytes


class Deep(nn.Module):
    """Six Linear(32, 32) layers. With a cap of OVERLAP_CAP_MB each layer's bias + weight is one bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def build_deep(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Deep()


def _overlap_events_rank() -> dict:
    """For individual and bucketed DDP: gradient-ready marks, collectives and waits of one step, in order."""
    impl = kit.impl.load()
    rank = dist.get_rank()
    report: dict = {}
    for kind in ("individual", "bucketed"):
        model = build_deep(rank)
        log = CommLog()
        # Registered before DDP's own hooks, so for each parameter "grad ready" is logged before any
        # all-reduce that this gradient triggers.
        for pname, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _p, n=pname, log=log: log.mark(f"grad {n}"))
        ddp = wrap(impl, kind, model, OVERLAP_CAP_MB)
        if kind == "bucketed":
            report["bucket_names"] = ddp.bucket_names
            report["bucket_numels"] = ddp.bucket_numels
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank))
        ddp.on_train_batch_start()
        loss = ddp(x).square().mean()
        with log:
            loss.backward()
            log.mark("backward returned")
            ddp.finish_gradient_synchronization()
        report[kind] = log.events
    return report


def _mismatched_models_rank() -> None:
    impl = kit.impl.load()
    model = FrozenParts()
    if dist.get_rank() == 1:
        model.fc2 = nn.Linear(16, 5)  # a different architecture on one rank: a classic DDP misuse
    impl.ddp.NaiveDDP(model)
    dist.barrier()


def _failing_rank() -> None:
    impl = kit.impl.load()
    rank = dist.get_rank()
    ddp = impl.ddp.NaiveDDP(build("FrozenParts", seed=0))
    x, y = full_batch("FrozenParts", 0)
    for _ in range(2):
        ddp.on_train_batch_start()
        loss = loss_fn(ddp, shard(x, rank, WORLD), shard(y, rank, WORLD))
        if rank == 1:
            raise RuntimeError("rank 1 lost its data loader")  # rank 0 goes on into a collective alone
        loss.backward()
        ddp.finish_gradient_synchronization()


# ----------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------


@pytest.mark.points(2)
def test_ranks_agree_after_construction() -> None:
    """Construction broadcasts rank 0's parameters and buffers — frozen ones included — to every rank."""
    results = run_check(_construction_rank, WORLD, timeout=TIMEOUT)
    for (kind, name), (before0, after0) in results[0].items():
        before1, after1 = results[1][(kind, name)]
        differed = any(not (before0[k] == before1[k]).all() for k in before0)
        assert differed, f"test setup: ranks should start from different weights for {name}"
        for key in before0:
            for rank, after in ((0, after0), (1, after1)):
                assert_close(torch.from_numpy(after[key]), torch.from_numpy(before0[key]),
                             name=f"{kind} on {name}: rank {rank}'s {key} after "
                             "construction vs rank 0's initial value", section="handout 04 §1", rtol=0, atol=0)


# One test per class, so each handout problem owns its own. Each trains 4 models (frozen parts, tied weights, an
# unused parameter, a tiny Transformer) for 3 SGD steps; after every step both ranks' parameters must equal one
# process trained on the full batch.


@pytest.mark.points(3)
def test_naive_ddp_matches_single_process() -> None:
    run_check(_training_rank, WORLD, args=("naive", 3), timeout=TIMEOUT)


@pytest.mark.points(3)
def test_flat_ddp_matches_single_process() -> None:
    run_check(_training_rank, WORLD, args=("flat", 3), timeout=TIMEOUT)


@pytest.mark.points(3)
def test_individual_ddp_matches_single_process() -> None:
    run_check(_training_rank, WORLD, args=("individual", 3), timeout=TIMEOUT)


@pytest.mark.points(3)
def test_bucketed_ddp_matches_single_process() -> None:
    """Twice: with a 0.0005 MiB cap (several buckets per model) and with bucket_size_mb=None (one bucket)."""
    run_check(_training_rank, WORLD, args=("bucketed", 3), timeout=TIMEOUT)


@pytest.mark.points(3)
def test_no_sync_accumulates_without_communicating() -> None:
    """Inside no_sync no collective is issued; the accumulated step equals the full-batch step."""
    run_check(_no_sync_rank, WORLD, args=(2,), timeout=TIMEOUT)


@pytest.mark.points(2)
def test_bucket_assignment(impl) -> None:
    """Buckets in reverse registration order, capped in MiB, a too-large parameter alone."""
    assign = impl.ddp.assign_buckets

    def params(*mib: float, dtype=torch.float32):
        # meta tensors: sizes without memory. 2**18 float32 elements = 1 MiB.
        return [torch.empty(int(m * 2**18), dtype=dtype, device="meta") for m in mib]

    cases = [
        (params(4, 4, 4), 8, [[2, 1], [0]], "three 4 MiB parameters, cap 8 MiB (a full bucket is allowed)"),
        (params(4, 4, 4), None, [[2, 1, 0]], "bucket_size_mb=None: one bucket"),
        (params(4, 4, 4), 3, [[2], [1], [0]], "every parameter larger than the cap: one bucket each"),
        (params(1, 10, 1, 1), 2, [[3, 2], [1], [0]], "a 10 MiB parameter between small ones, cap 2 MiB"),
        (params(0.25, 0.25, 0.25, 0.25, 0.25), 0.5, [[4, 3], [2, 1], [0]], "fractional cap 0.5 MiB"),
        (params(1, 1) + params(1, dtype=torch.float16), 100, [[2], [1, 0]], "a dtype change starts a new bucket"),
    ]
    for ps, cap, expected, what in cases:
        assert_equal(assign(ps, cap), expected, name=f"assign_buckets: {what}", section="handout 04 §4")
    for cap, error in ((0, ValueError), (-5, ValueError), ("25", TypeError)):
        with raises(error, match="bucket_size_mb", what=f"assign_buckets(params, {cap!r})", section="handout 04 §4"):
            assign(params(1), cap)


def _waited_at_once(events: list[Event], grads: list[int]) -> list[tuple[int, int]]:
    """(launch, wait) of each collective launched during backward and waited on before the next gradient.

    Such a collective overlaps nothing: backward blocks in the hook until it is done. Waiting for an earlier
    bucket later on (after more gradients were computed) is a fine design and is not reported.
    """
    found = []
    for w, e in enumerate(events):
        if e.kind == "wait" and e.target is not None:
            later = [g for g in grads if g > e.target]
            if later and w < later[0]:
                found.append((e.target, w))
    return found


@pytest.mark.points(4)
def test_communication_overlaps_backward() -> None:
    """The first all-reduce is launched before backward produced the last gradient; one flat async
    all-reduce per bucket (per parameter for DDPIndividualParameters), not waited on at once."""
    report = run_check(_overlap_events_rank, WORLD, timeout=TIMEOUT)[0]
    # Expected buckets for Deep with a 0.0041 MiB (4299 B) cap: a layer's bias (128 B) + weight (4096 B)
    # is 4224 B; adding the next layer's bias would make 4352 B.
    expected_names = [[f"layers.{i}.bias", f"layers.{i}.weight"] for i in reversed(range(6))]
    assert_equal(report["bucket_names"], expected_names, name="DDPBucketed(Deep, 0.0041).bucket_names",
                 section="handout 04 §4")
    assert_equal(report["bucket_numels"], [32 * 32 + 32] * 6, name="DDPBucketed(Deep, 0.0041).bucket_numels",
                 section="handout 04 §4")
    fp32 = 4
    for kind, expected_bytes in (("individual", None), ("bucketed", [fp32 * (32 * 32 + 32)] * 6)):
        events = report[kind]
        trace = format_events(events)
        grads = [i for i, e in enumerate(events) if e.kind == "mark" and e.label.startswith("grad ")]
        returned = next(i for i, e in enumerate(events) if e.kind == "mark" and e.label == "backward returned")
        reduces = [i for i, e in enumerate(events) if e.kind == "collective" and e.op == "all_reduce"]
        assert len(grads) == 12, f"{kind}: expected 12 gradient-ready events, got {len(grads)}; events: {trace}"
        assert reduces, f"{kind}: no dist.all_reduce during the step (handout 04 §3). Events: {trace}"
        assert reduces[0] < grads[-1], (
            f"{kind}: the first all-reduce must be launched during backward, before the last gradient "
            f"({events[grads[-1]].label[5:]}) is ready — that is what overlaps communication with computation "
            f"(handout 04 §3–§4). Events in order: {trace}")
        not_async = [i for i in reduces if not events[i].async_op]
        launched_during_backward = [i for i in reduces if i < returned]
        assert not not_async and launched_during_backward, (
            f"{kind}: every all-reduce launched from a hook must pass async_op=True, or backward waits for "
            f"it (handout 04 §3). Events in order: {trace}")
        at_once = _waited_at_once(events, grads)
        assert not at_once, (
            f"{kind}: all-reduce #{at_once[0][0]} is waited on (event {at_once[0][1]}) before backward computed "
            "another gradient: wait() right after launching blocks backward until the all-reduce is done, so "
            "nothing overlaps. Keep the handle and wait in finish_gradient_synchronization (handout 04 §3). "
            f"Events in order: {trace}")
        nbytes = [events[i].nbytes for i in reduces]
        if expected_bytes is None:
            assert_equal(sorted(nbytes), sorted([fp32 * 32 * 32, fp32 * 32] * 6),
                         name=f"{kind}: bytes of the all-reduced tensors (one per parameter)",
                         section="handout 04 §3")
        else:
            assert_equal(nbytes, expected_bytes,
                         name=f"{kind}: bytes of the all-reduced tensors, in launch order (one flat buffer "
                         "per bucket, bucket 0 first)", section="handout 04 §4")


@pytest.mark.points(2)
def test_failing_rank_surfaces_its_error() -> None:
    """Mismatched models fail at construction naming the parameter; an exception on one rank mid-training
    reaches the caller instead of hanging the other rank in a collective."""
    # A hang would end in RankTimeoutError after 60 s instead of the RankFailedError expected here.
    with raises(RankFailedError, match="fc2", section="handout 04 §1",
                what="NaiveDDP(model) where rank 1's model has fc2 = Linear(16, 5) and rank 0's Linear(16, 4)",
                hint="Construction must compare the replicas (verify_same_model) and raise ValueError naming the "
                "first parameter that differs, on every rank, before any broadcast."):
        run_on_ranks(_mismatched_models_rank, WORLD, timeout=60)
    with raises(RankFailedError, match="rank 1 lost its data loader", section="handout 04 §7",
                what="NaiveDDP training where rank 1 raises mid-step",
                hint="The error must reach the caller; a rank left alone in a collective must not hang."):
        run_on_ranks(_failing_rank, WORLD, timeout=60)


@pytest.mark.points(2)
def test_all_reduce_benchmark(impl) -> None:
    """Timing rows for each size, and bandwidths from the ring all-reduce's traffic 2(n-1)/n · size."""
    coll = impl.collectives
    for size, seconds, n in ((2**20, 1e-3, 2), (2**30, 0.25, 4), (12 * 2**20, 3e-3, 6)):
        algbw, busbw = coll.bus_bandwidth(size, seconds, n)
        assert_close(torch.tensor(algbw, dtype=torch.float64), torch.tensor(size / seconds, dtype=torch.float64),
                     name=f"algbw for {size} B in {seconds} s", section="handout 04 §6", rtol=1e-9, atol=0)
        expected = torch.tensor(size / seconds * 2 * (n - 1) / n, dtype=torch.float64)
        assert_close(torch.tensor(busbw, dtype=torch.float64), expected,
                     name=f"busbw for {size} B in {seconds} s over {n} ranks", section="handout 04 §6",
                     rtol=1e-9, atol=0)
    rows = coll.all_reduce_benchmark([4096, 2**16], [2], backend="gloo", device="cpu", warmup=1, iters=3)
    assert_equal([(r["world_size"], r["size_bytes"]) for r in rows], [(2, 4096), (2, 2**16)],
                 name="all_reduce_benchmark rows (world_size, size_bytes)", section="handout 04 §6")
    for r in rows:
        assert r["time_ms"] > 0, f"time_ms must be positive, got {r['time_ms']}"
        expected = torch.tensor(r["size_bytes"] / (r["time_ms"] / 1e3) / 1e9, dtype=torch.float64)
        assert_close(torch.tensor(r["algbw_gbps"], dtype=torch.float64), expected,
                     name=f"algbw_gbps for {r['size_bytes']} B", section="handout 04 §6", rtol=1e-6, atol=0)
    with raises(ValueError, match="sizes_bytes", what="all_reduce_benchmark([3], [2]) (3 bytes: not whole float32s)",
                section="handout 04 §6"):
        coll.all_reduce_benchmark([3], [2])
    with raises(ValueError, match="world_sizes", what="all_reduce_benchmark([4096], [1]) (one rank)",
                section="handout 04 §6"):
        coll.all_reduce_benchmark([4096], [1])
