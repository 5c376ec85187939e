"""The given Triton launch configuration (``flash_attention/triton_config.py``): the autotuning key is
bucketed by powers of two and the autotuned choice persists across processes (handout 03 §5).

Autotuning needs a GPU, so the launcher is driven here with stand-ins for the kernel and the autotuner:
what is checked is the bookkeeping (when it tunes, what it stores, what a later process launches).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kit  # noqa: F401 — before triton
from kit.impl import load

config = load("reference").flash_attention.triton_config


@pytest.mark.parametrize(("n", "bucket"), [(1, 16), (16, 16), (17, 32), (600, 1024), (1000, 1024), (1024, 1024),
                                           (1025, 2048), (16384, 16384), (16385, 32768)])
def test_autotune_bucket_is_the_next_power_of_two(n, bucket):
    assert config.autotune_bucket(n) == bucket


def test_tune_key_shares_a_bucket_and_separates_what_changes_the_kernel():
    key = config.tune_key("forward", torch.bfloat16, 64, True, 600, 1000, 16)
    assert key == config.tune_key("forward", torch.bfloat16, 64, True, 1000, 513, 12)
    for other in (config.tune_key("forward", torch.bfloat16, 64, True, 1025, 1000, 16),  # Nq bucket
                  config.tune_key("forward", torch.bfloat16, 64, True, 600, 1025, 16),  # Nk bucket
                  config.tune_key("forward", torch.float16, 64, True, 600, 1000, 16),  # dtype
                  config.tune_key("forward", torch.bfloat16, 128, True, 600, 1000, 16),  # head dim
                  config.tune_key("forward", torch.bfloat16, 64, False, 600, 1000, 16),  # causal
                  config.tune_key("forward", torch.bfloat16, 64, True, 600, 1000, 1),  # batch·heads bucket
                  config.tune_key("dq", torch.bfloat16, 64, True, 600, 1000, 16)):  # kernel
        assert other != key


@pytest.mark.parametrize(("bh", "bucket"), [(1, 1), (2, 2), (3, 4), (12, 16), (16, 16), (17, 32)])
def test_batch_heads_bucket_is_the_next_power_of_two(bh, bucket):
    assert config.batch_heads_bucket(bh) == bucket


@pytest.mark.parametrize("kind", config.KINDS)
def test_every_kind_has_interpreter_tiles_and_candidates_that_keep_its_alignment_rule(kind):
    blocks = config.INTERPRETER_BLOCKS[kind]
    assert config.aligned(kind, blocks["BLOCK_M"], blocks["BLOCK_N"])
    for c in config.GPU_CONFIGS[kind]:
        assert config.aligned(kind, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]), f"{kind} candidate {c}"
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for d in (16, 64, 128):
            fixed = config.fixed_config(kind, dtype, d)
            assert config.aligned(kind, fixed["BLOCK_M"], fixed["BLOCK_N"]), f"{kind} fixed {dtype} D={d}"


def test_tuning_cache_path_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMSYS_FA_TUNE_CACHE", str(tmp_path / "t.json"))
    assert config.tuning_cache_path() == tmp_path / "t.json"
    monkeypatch.setenv("LLMSYS_FA_TUNE_CACHE", "off")
    assert config.tuning_cache_path() is None
    config.save_choice(None, "k", {"BLOCK_M": 1})  # persistence off: a no-op
    assert config.load_choice(None, "k") is None


def test_choice_round_trips_and_a_corrupt_file_is_ignored(tmp_path):
    path = tmp_path / "sub" / "tuning.json"
    choice = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    assert config.load_choice(path, "a") is None
    config.save_choice(path, "a", choice)
    config.save_choice(path, "b", {**choice, "BLOCK_N": 32})
    assert config.load_choice(path, "a") == choice and config.load_choice(path, "b")["BLOCK_N"] == 32
    path.write_text("{not json")
    assert config.load_choice(path, "a") is None


class FakeKernel:
    """Stands in for a JITFunction: records the launches made with explicit configs."""

    arg_names = ["Q", "Nq", "Nk"]
    __module__, __name__, cache_key = "fake", "kernel", "0123456789abcdef"

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(kwargs)


class FakeTuner:
    """Stands in for triton.autotune's Autotuner: "tunes" by picking the first config; counts how often the
    launcher clears its cache."""

    def __init__(self):
        tuner = self

        class Cache(dict):
            def clear(self):
                tuner.cleared += 1
                super().clear()

        self.cache, self.tuned_at, self.cleared = Cache(), [], 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.tuned_at.append(args[1:])
            self.best_config = SimpleNamespace(kwargs={"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3)
            self.cache[tuple(args[1:])] = self.best_config

        return run


def fresh_launcher():
    launcher = config.Launcher(FakeKernel(), "forward")  # on a CPU: no autotuner is built
    launcher.tuned = FakeTuner()
    return launcher


def test_launcher_tunes_once_per_bucket_and_a_new_process_reuses_the_choice(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMSYS_FA_TUNE_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake H100")
    q = torch.zeros(1, dtype=torch.bfloat16)  # batch·heads = q.shape[0] = 1
    first = fresh_launcher()
    first._launch_tuned(None, (q, 1000, 1000), {"HEAD_DIM": 64, "IS_CAUSAL": True})
    first._launch_tuned(None, (q, 600, 700), {"HEAD_DIM": 64, "IS_CAUSAL": True})  # same bucket: no retune
    first._launch_tuned(None, (q, 1025, 1000), {"HEAD_DIM": 64, "IS_CAUSAL": True})  # new bucket: tunes
    assert first.tuned.tuned_at == [(1000, 1000), (1025, 1000)]
    picked = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    assert first.kernel.launches == [{**picked, "HEAD_DIM": 64, "IS_CAUSAL": True}]

    second = fresh_launcher()  # another process: same file, nothing timed, the same config launched
    second._launch_tuned(None, (q, 900, 900), {"HEAD_DIM": 64, "IS_CAUSAL": True})
    assert second.tuned.tuned_at == []
    assert second.kernel.launches == [{**picked, "HEAD_DIM": 64, "IS_CAUSAL": True}]
    assert list(second.chosen.values()) == [picked]  # reported as this process's pick (kit gpu-check's "chosen")

    monkeypatch.setattr(config, "GPU_CANDIDATES", {64: {"forward": [(64, 32, 4, 3)]}, 128: {}})
    fourth = fresh_launcher()  # the stored pick is no longer a candidate: tunes again
    fourth._launch_tuned(None, (q, 900, 900), {"HEAD_DIM": 64, "IS_CAUSAL": True})
    assert fourth.tuned.tuned_at == [(900, 900)]
    monkeypatch.undo()
    monkeypatch.setenv("LLMSYS_FA_TUNE_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake A100")  # another GPU: tunes again
    third = fresh_launcher()
    third._launch_tuned(None, (q, 900, 900), {"HEAD_DIM": 64, "IS_CAUSAL": True})
    assert third.tuned.tuned_at == [(900, 900)]


def test_batch_heads_and_the_tensor_s_gpu_are_part_of_the_choice(monkeypatch, tmp_path):
    """The leaderboard (batch·heads 16) does not inherit a config tuned for batch·heads 1 at the same lengths, and a
    process with two GPU models tunes for the one the tensors are on, not the current device."""
    monkeypatch.setenv("LLMSYS_FA_TUNE_CACHE", str(tmp_path / "tuning.json"))
    names = {"cuda:0": "Fake H100", "cuda:1": "Fake L4"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names[str(device)])
    monkeypatch.setattr(config, "device_name", lambda t: names[t.device_label])

    class OnDevice:  # a (batch·heads, N, D) tensor's dtype, shape and device, without a GPU
        def __init__(self, bh, device):
            self.dtype, self.shape, self.device_label = torch.bfloat16, (bh, 16384, 64), device

    launcher = fresh_launcher()
    named = {"HEAD_DIM": 64, "IS_CAUSAL": True}
    launcher._launch_tuned(None, (OnDevice(1, "cuda:0"), 16384, 16384), named)
    launcher._launch_tuned(None, (OnDevice(16, "cuda:0"), 16384, 16384), named)  # batch·heads 16: tunes again
    launcher._launch_tuned(None, (OnDevice(12, "cuda:0"), 16384, 16384), named)  # same bucket as 16: no retune
    launcher._launch_tuned(None, (OnDevice(16, "cuda:1"), 16384, 16384), named)  # the other GPU: tunes again
    assert launcher.tuned.tuned_at == [(16384, 16384)] * 3
    assert launcher.tuned.cleared == 3, "Triton's own cache (exact lengths only) is forgotten before each tuning"
    assert sorted(key.rsplit("|", 1)[1] for key in launcher.chosen) == ["Fake H100", "Fake H100", "Fake L4"]


# ---------------------------------------------------------------------------- the backward design


def designs(calls: list, fused_missing: bool = False) -> dict:
    def split():
        calls.append("split")
        return "split grads"

    def fused():
        calls.append("fused")
        if fused_missing:
            raise NotImplementedError("triton_attention_backward_fused: …")
        return "fused grads"

    return {"split": split, "fused": fused}


def test_run_backward_runs_the_design_asked_for_and_falls_back_from_a_stub(monkeypatch):
    q = torch.zeros(2, 3, 8, 16)
    calls: list = []
    assert config.run_backward(designs(calls), q, 8, True) == "split grads"  # auto on a CPU: the split design
    monkeypatch.setattr(config, "BACKWARD", "fused")
    assert config.run_backward(designs(calls), q, 8, True) == "fused grads"
    assert config.run_backward(designs(calls, fused_missing=True), q, 8, True) == "split grads"
    assert calls == ["split", "fused", "fused", "split"]
    monkeypatch.setattr(config, "BACKWARD", "fastest")
    with pytest.raises(ValueError, match="LLMSYS_FA_BACKWARD"):
        config.run_backward(designs(calls), q, 8, True)


def test_on_a_gpu_the_faster_design_is_measured_once_and_persisted(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMSYS_FA_TUNE_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(config, "triton_interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(config, "device_name", lambda t: "Fake H100")
    timed = []

    def do_bench(fn):
        timed.append(fn())
        return {"split grads": 2.0, "fused grads": 1.5}[timed[-1]]

    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    q = torch.zeros(16, 1024, 64, dtype=torch.bfloat16)
    calls: list = []
    chooser = config.BackwardChooser()
    assert chooser(designs(calls), q, 1024, True) == "fused grads"
    assert timed == ["split grads", "fused grads"]
    assert chooser(designs(calls), q, 1000, True) == "fused grads" and len(timed) == 2  # same bucket: no timing
    again = config.BackwardChooser()  # another process: the stored choice, nothing timed
    assert again(designs(calls), q, 1024, True) == "fused grads" and len(timed) == 2
    assert chooser(designs(calls, fused_missing=True), q[:1], 1024, True) == "split grads"  # a stub is skipped
