"""What a worker sends costs the judge little, whatever its shape: :func:`kit.spawn.wire.decode` reads it within
limits on its structure (parts, nesting, tensor elements, whole tensors) as well as its bytes, and the grading
plugin stops a test on which the judge itself spends more than ``--judge-cpu-limit`` CPU-seconds."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kit.grading import plugin, running
from kit.spawn import wire

ROOT = Path(__file__).resolve().parents[2]


def _saved(value: Any) -> bytes:
    """``value`` as a worker could send it by hand: torch.save, without :func:`wire.normalise`."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _bomb(levels: int = 60) -> bytes:
    part: list = [0]
    for _ in range(levels):
        part = [part, part]
    return _saved({"ok": True, "value": part})


def test_a_message_the_memo_expands_exponentially_is_refused_after_little_work():
    data = _bomb()
    assert len(data) < 2000, "a kilobyte or two on the wire"
    start = time.process_time()
    with pytest.raises(wire.NotData, match=r"more than 1,000,000 parts \(wire\.MAX_NODES"):
        wire.decode(data)
    spent = time.process_time() - start
    assert spent < 1.0, f"refusing a 2^61-part tree took {spent:.2f} CPU-seconds: the walk must stop at its budget"


def test_a_dict_key_of_shared_tuples_is_refused_before_it_is_hashed():
    # A tuple does not cache its hash: a key whose tuples share their parts costs torch.load itself 2^levels to
    # hash, in C, where no limit can interrupt it (4x per two levels: 60 levels would never finish). Built at 20
    # levels here (hashing it once to build the dict takes ~10 ms); the refusal does not depend on the depth.
    part: tuple = (0,)
    for _ in range(20):
        part = (part, part)
    data = _saved({"ok": True, "value": {part: 1}})
    start = time.process_time()
    with pytest.raises(wire.NotData, match="refers to one tuple more than once"):
        wire.decode(data)
    assert time.process_time() - start < 0.1, "refused from the pickle's opcodes, before anything is built"


def test_honest_messages_with_tuples_sets_devices_and_dtypes_decode():
    value = {"pairs": [(1, 2), (1, 2)], "keys": {(1, "a"): {(2, 3), (4, 5)}}, "dtypes": [torch.float32] * 3,
             "devices": [torch.device("cpu")] * 3, "names": ["mean"] * 4}
    assert wire.decode(wire.encode(value)) == value


@pytest.mark.parametrize("value, limit", [
    ([[0] * 1000] * 1001, r"more than 1,000,000 parts \(wire\.MAX_NODES"),  # one list, referred to 1001 times
    ({"x": [0] * (wire.MAX_NODES + 1)}, r"more than 1,000,000 parts \(wire\.MAX_NODES"),
])
def test_parts_past_the_budget_are_refused_counting_each_reference(value, limit):
    with pytest.raises(wire.NotData, match=limit):
        wire.decode(_saved(value))


def test_nesting_past_the_limit_is_refused_naming_where():
    deep: list = []
    for _ in range(wire.MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(wire.NotData, match=r"value\['x'\](\[0\]){100} is nested more than 100 levels deep "
                                           r"\(wire\.MAX_DEPTH\)"):
        wire.decode(_saved({"x": deep}))
    loop: list = []
    loop.append(loop)  # a cycle is as deep as the limit, and no deeper
    with pytest.raises(wire.NotData, match=r"wire\.MAX_DEPTH"):
        wire.decode(_saved(loop))


def test_tensor_elements_past_the_limit_are_refused_counting_each_reference():
    one = torch.zeros(1 << 20, dtype=torch.int8)  # a megabyte, sent once and referred to 1025 times
    with pytest.raises(wire.NotData, match=r"more than 1,073,741,824 elements in all \(wire\.MAX_ELEMENTS"):
        wire.decode(_saved([one] * 1025))
    assert len(wire.decode(_saved([one] * 1024))) == 1024, "at the limit: read"


@pytest.mark.parametrize("view, what", [
    (torch.zeros(1).expand(1 << 30), r"size \(1073741824,\), strides \(0,\), offset 0 in a storage of 4 bytes"),
    (torch.arange(10)[3:], r"offset 3 in a storage of 80 bytes"),
    (torch.arange(10)[:3], r"size \(3,\), strides \(1,\), offset 0 in a storage of 80 bytes"),
    (torch.arange(6).reshape(2, 3).t(), r"strides \(1, 3\)"),
])
def test_a_tensor_that_is_not_its_whole_storage_is_not_data(view, what):
    with pytest.raises(wire.NotData, match=r"value\['t'\] is a view, not a whole tensor, so it is not data: .*" + what):
        wire.decode(_saved({"t": view}))


def test_other_types_are_still_refused_naming_where():
    from collections import OrderedDict

    with pytest.raises(wire.NotData, match=r"value\['a'\]\[1\]: a worker sent a OrderedDict, which is not data"):
        wire.decode(_saved({"a": [1, OrderedDict()]}))


def _same(a: Any, b: Any) -> bool:
    """Equal and of exactly the same types, all the way down (tensors: same dtype, shape and values)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_large_honest_messages_decode_as_before():
    """Far larger than any test's (6,468 parts at most, 7 levels, 525,056 elements): a whole model's parameters,
    a list of 100,000 events, a training run's results."""
    torch.manual_seed(0)
    value = {
        "params": {f"layers.{i}.weight": torch.randn(64, 64) for i in range(200)},
        "events": [(i, 0.5 * i, "all_reduce") for i in range(100_000)],
        "steps": [{"loss": 1.0 / (i + 1), "lr": 1e-3, "grad_norm": torch.tensor(0.5)} for i in range(1000)],
        "meta": {"dtype": torch.bfloat16, "device": torch.device("cpu"), "shape": (4, 8), "ranks": {0, 1, 2, 3},
                 "nested": [[[[[[{"deep": b"bytes", "none": None, "z": 1 + 2j}]]]]]]},
        "empty": torch.zeros(0), "flag": True,
    }
    message = wire.normalise(value)
    decoded = wire.decode(wire.encode(value))
    assert _same(decoded, message)


def test_the_judge_cpu_limit_reaches_the_judge_from_the_command_line():
    import argparse

    from kit.__main__ import add_limit_options, limits_of

    parser = argparse.ArgumentParser()
    add_limit_options(parser)
    default = limits_of(parser.parse_args([])).judge_cpu_limit
    assert default == plugin.JUDGE_CPU_LIMIT == running.Limits().judge_cpu_limit
    assert limits_of(parser.parse_args(["--judge-cpu-limit", "7"])).judge_cpu_limit == 7.0


BURN = '''import time


def _burn(seconds):
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass


def test_burns_the_judge():
    _burn(5)


def test_after_it():
    pass
'''


def _judge(tmp_path: Path, limit: str) -> dict[tuple[str, str], dict]:
    """Run the tests of :data:`BURN` in a judge (pytest with the grading plugin, grading) with
    ``--judge-cpu-limit=limit``: its report events by (test, phase)."""
    (tmp_path / "test_burn.py").write_text(BURN)
    log = tmp_path / f"events-{limit}.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LLMSYS_IMPL": "reference"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "kit.grading.plugin", "-p", "no:cacheprovider",
                           f"--grading-log={log}", f"--judge-cpu-limit={limit}", "test_burn.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events[-1]["event"] == "finished", proc.stdout + proc.stderr
    return {(e["nodeid"].split("::")[-1], e["when"]): e for e in events if e["event"] == "report"}


def test_the_judge_cpu_meter_fails_the_test_that_spins_the_judge_and_grading_goes_on(tmp_path):
    reports = _judge(tmp_path, "0.5")
    burnt = reports[("test_burns_the_judge", "call")]
    assert burnt["outcome"] == "failed", burnt
    assert ("the judge spent more than 0.5 CPU-seconds of its own on this test (--judge-cpu-limit; stopped in _burn, "
            "test_burn.py:") in burnt["longrepr"], burnt["longrepr"]
    # "stopped in _burn" is the proof that it was stopped while it ran, not after its 5 CPU-seconds: a wall-clock
    # bound (it was < 3 s) failed on a busy clean-machine run (3.15 s), which is what the meter exists to ignore.
    assert reports[("test_after_it", "call")]["outcome"] == "passed", "the next test is graded as usual"

    unmetered = _judge(tmp_path, "0")
    assert unmetered[("test_burns_the_judge", "call")]["outcome"] == "passed", "--judge-cpu-limit=0: no limit"
