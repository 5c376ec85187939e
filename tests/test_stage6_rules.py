"""Stage 6's rule: the student builds ring attention; PyTorch's own context parallelism and attention may not build
it for them (handout 06b, What is graded).

``torch.distributed.tensor.experimental``'s ``_templated_ring_attention`` (behind ``context_parallel``) computes
exactly what this chapter asks: K/V blocks passed around the ring, partial outputs merged through their
log-sum-exp, the zig-zag ("head-tail") layout. So does a ring whose blocks are
``aten._scaled_dot_product_flash_attention_for_cpu``, which hands back each block's log-sum-exp as well. Either
passes every test of behaviour in ``tests/test_stage6_context_parallel.py``; only this rule tells it from a ring
that runs each block through the block interface (``attention_forward_with_lse`` / ``attention_backward_with_lse``,
the student's Stage 3 FlashAttention).

The judge runs ``ring_attention`` forward and backward on 2 spawned ranks under
:func:`kit.grading.library_rules.watch`: a causal zig-zag case and a bf16 case without a mask in the contiguous
layout, so both layouts, both masks and the bf16 path run. The watch records any call, from the submission, of
torch's context-parallel entry points (public, and the private ring, rotaters and merger that a wrapper cannot
avoid) and any SDPA ATen kernel dispatched. :mod:`tests.support.rules` adds a reading of
``parallel/context_parallel.py`` and, when the rule is broken, fails every test marked
``builds("torch-context-parallel")`` with the same message.

Allowed, and exercised here: point-to-point calls and collectives (``batch_isend_irecv``, ``all_gather``), the
merge's tensor arithmetic, and the block interface. The tests' own references (float64 attention) run in the
judge process, never under a watch.
"""

from __future__ import annotations

from typing import Any

import pytest

import kit.impl
from kit.checks import run_check
from kit.grading import library_rules
from tests.support import context_parallel as support
from tests.support import rules

pytestmark = pytest.mark.stage6

TIMEOUT = 120.0  # seconds for one spawn of 2 ranks, start-up included (~10 s under load)
# 160 tokens: 80 per rank, two 40-token zig-zag chunks; the causal mask makes every kind of block (skipped, diagonal,
# full). 32 tokens in bf16 without a mask: the contiguous layout, and the dtype's own path through the block interface.
WATCHED_CASES = (support.case("rule_causal_zigzag", 160, causal=True, layout="zigzag", seed=40),
                 support.case("rule_full_contiguous_bf16", 32, causal=False, layout="contiguous", seed=41,
                              dtype="bfloat16"))


def _ring_workload() -> dict:
    """``ring_attention`` forward and backward on :data:`WATCHED_CASES`, watched: ``{"violations": [...],
    "error": what it raised, or ""}``. A ring that raises (a stub) keeps what was recorded until then."""
    cp_module = kit.impl.load().parallel.context_parallel
    group = support.cp_group()  # times out instead of hanging when a peer raised mid-ring
    error = ""
    with library_rules.watch(["torch-context-parallel"]) as seen:
        try:
            for spec in WATCHED_CASES:
                support.run_case(cp_module, spec, group)
        except Exception as exc:  # noqa: BLE001 — a stub or a bug: the behaviour tests report it
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return {"violations": seen.as_data(), "error": error}


def _violations(per_rank: list[Any]) -> tuple[list[dict], str]:
    """The ranks' records, each breach once, and the first rank's error (data from the ranks: anything malformed is
    dropped)."""
    out: list[dict] = []
    errors = [r["error"] for r in per_rank if isinstance(r, dict) and isinstance(r.get("error"), str) and r["error"]]
    for record in per_rank:
        found = record.get("violations") if isinstance(record, dict) else None
        for v in found if isinstance(found, list) else []:
            if not (isinstance(v, dict) and v.get("how") in ("called", "derives", "dispatched")
                    and all(isinstance(v.get(k), str) for k in ("rule", "what", "where"))):
                continue
            if not any(o["how"] == v["how"] and o["what"] == v["what"] for o in out):
                out.append(v)
    return out, errors[0] if errors else ""


@rules.judge("torch-context-parallel")
def _judge_ring(request: pytest.FixtureRequest) -> list[dict]:
    violations, error = _violations(run_check(_ring_workload, 2, timeout=TIMEOUT))
    if error and not violations:
        raise RuntimeError(error)
    return violations


@pytest.mark.points(1)
def test_builds_its_own_ring_attention(request) -> None:
    """ring_attention calls none of torch's context parallelism and dispatches none of SDPA's ATen kernels."""
    rules.assert_kept("torch-context-parallel", request, (
        "ring_attention on 2 ranks (causal zig-zag, and bf16 contiguous without a mask), forward and backward, "
        "failed with {error}. Make the ring-attention tests pass first (handout 06b §2–§5)."))
