"""Stage 6, part 2 — the worker half of the instructor-only ring-attention checks (``test_stage6_cp_hidden``).

Other shapes and seeds than the public tests: an odd ring (cp = 3), wider heads, fp16, large logits with a causal
contiguous split, and two rings of 2 inside 4 ranks ({0, 1} and {2, 3}), where a peer named by its rank in the group
instead of its global rank talks to the wrong process. The ranks return outputs and gradients; the judge computes
float64 attention itself (``tests/support/context_parallel.py``).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

import kit.impl
from kit.checks import run_checks
from tests.support import context_parallel as support
from tests.support.context_parallel import case

CASES = {
    3: [case("cp3_n36_causal_zigzag", 36, causal=True, layout="zigzag", seed=40),
        case("cp3_n30_full_contiguous_d32", 30, causal=False, layout="contiguous", head_dim=32, seed=41)],
    4: [case("cp4_n96_causal_zigzag_d32", 96, causal=True, layout="zigzag", head_dim=32, seed=42),
        case("cp4_n32_causal_contiguous_fp16", 32, causal=True, layout="contiguous", seed=43, dtype="float16"),
        case("cp4_n32_large_logits_causal_contiguous", 32, causal=True, layout="contiguous", seed=44,
             logit_offset=150.0)],
}
SUBGROUPS = [[0, 1], [2, 3]]
SUBGROUP_CASES = [case("sub_n24_causal_zigzag", 24, causal=True, layout="zigzag", seed=45),
                  case("sub_n16_full_contiguous", 16, causal=False, layout="contiguous", seed=46)]


def _subgroup_check(cp_module: Any) -> dict:
    import datetime

    groups = [dist.new_group(ranks, timeout=datetime.timedelta(seconds=support.DEADLOCK_S)) for ranks in SUBGROUPS]
    mine = groups[dist.get_rank() // 2]
    return {spec["name"]: support.run_case(cp_module, spec, mine) for spec in SUBGROUP_CASES}


def hidden_checks() -> dict:
    impl = kit.impl.load()
    cp_module = impl.parallel.context_parallel
    world = dist.get_world_size()
    checks = {"cases": support.guarded(
        lambda: {s["name"]: support.run_case(cp_module, s, support.cp_group()) for s in CASES[world]})}
    if world == 4:
        checks["subgroups"] = support.guarded(lambda: _subgroup_check(cp_module))
    return run_checks(checks)
