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
    key = config.tune_key("forward", torch.bfloat16, 64, True, 600, 1000)
    assert key == config.tune_key("forward", torch.bfloat16, 64, True, 1000, 513)
    for other in (config.tune_key("forward", torch.bfloat16, 64, True, 1025, 1000),  # Nq bucket
                  config.tune_key("forward", torch.bfloat16, 64, True, 600, 1025),  # Nk bucket
                  config.tune_key("forward", torch.float16, 64, True, 600, 1000),  # dtype
                  config.tune_key("forward", torch.bfloat16, 128, True, 600, 1000),  # head dim
                  config.tune_key("forward", torch.bfloat16, 64, False, 600, 1000),  # causal
                  config.tune_key("dq", torch.bfloat16, 64, True, 600, 1000)):  # kernel
        assert other != key


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
    """Stands in for triton.autotune's Autotuner: "tunes" by picking the first config."""

    def __init__(self):
        self.cache, self.tuned_at = {}, []

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
    q = torch.zeros(1, dtype=torch.bfloat16)
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
    assert len(second.tuned.cache) == 1  # reported as the autotuner's pick (kit gpu-check's "chosen")

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
