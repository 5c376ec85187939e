# Given code — read, don't edit. Generated from the kit's reference by `make student`.
"""Given code: how the Triton kernels are configured — compiled and autotuned on a GPU, interpreted on a CPU.

One kernel source runs in two worlds (handout 03 §5):

* **compiled** (a CUDA GPU): for bf16/fp16, tile sizes, ``num_warps`` and ``num_stages`` are chosen by
  ``@triton.autotune`` from the candidate lists below, once per *bucket* of problem shapes and dtype;
  the tiles go straight into ``tl.dot`` (tensor cores). fp32 uses one fixed config and
  ``input_precision="ieee"`` (exact fp32, not TF32).

Autotuning key (handout 03 §5). Tuning costs a few seconds per kernel (every candidate is compiled and
timed), so keying it on the exact lengths would retune at every new sequence length. The key is
:func:`tune_key`: the kernel, dtype, head dim, causal flag and the *next power of two* of Nq and Nk
(:func:`autotune_bucket`) — lengths 1025…2048 share one tuning, run at the first length seen. The chosen
config is also written to a small JSON file (:func:`tuning_cache_path`: ``$LLMSYS_FA_TUNE_CACHE``, by default
``~/.cache/llmsys-lab/flash_attention_tuning.json``; ``LLMSYS_FA_TUNE_CACHE=off`` keeps it in memory only),
keyed also on the GPU name, the Triton version and the kernel's source hash, so every later process on
that machine launches the *same* config without timing anything: results and speed are reproducible
across processes, whereas a fresh timing-based choice can differ from run to run when two candidates
are within noise. Delete the file to retune.
* **interpreted** (``TRITON_INTERPRET=1``, set by ``import kit`` on machines without CUDA): the kernel
  body runs as NumPy code. Autotuning with more than one config needs a GPU driver, so one fixed
  config is used; and the 3.6 interpreter cannot do bf16 arithmetic (bf16 ``tl.dot`` returns garbage),
  so the kernels upcast bf16 tiles to fp32 right after loading — your kernel does it, when
  :func:`upcast_in_kernel` says so (the ``UPCAST`` constexpr).

``import kit`` must happen before ``import triton`` so that the interpreter switch is seen: this
package's ``__init__`` does it first, before any module here imports triton.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import triton

from kit import triton_interpreted  # the package's __init__ imported kit before triton (see there)

# Fixed tiles under the interpreter: large enough that the interpreted loop over tiles stays short,
# and unequal so that the CPU tests exercise diagonals that span several tiles, as on the GPU.
# BLOCK_M must be a multiple of BLOCK_N (forward, dQ) and BLOCK_N a multiple of BLOCK_M (dK/dV) so
# that a tile boundary falls on the causal diagonal (§4).
INTERPRETER_BLOCKS = {
    "forward": {"BLOCK_M": 64, "BLOCK_N": 32},
    "dkdv": {"BLOCK_M": 32, "BLOCK_N": 64},
    "dq": {"BLOCK_M": 64, "BLOCK_N": 32},
}

# Autotune on a GPU (bf16/fp16 only: fp32 runs on the CUDA cores, is not what this kernel is tuned for,
# and its big tiles take minutes to compile). Set ``AUTOTUNE = False`` (or LLMSYS_FA_AUTOTUNE=0) to use
# the fixed configs below everywhere — the GPU correctness checks do, to compile fewer variants.
AUTOTUNE = os.environ.get("LLMSYS_FA_AUTOTUNE", "1") != "0"


def _configs(entries: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in entries]


# Candidates for a Hopper-class GPU (227 KiB shared memory per block, 255 registers per thread), as
# (BLOCK_M, BLOCK_N, warps, stages), per head dim: D ≤ 64 and D = 128 (a D = 128 tile holds twice the
# registers, so it needs 8 warps or smaller tiles). The forward keeps a BLOCK_M × D query tile and its
# accumulator resident and streams K/V tiles; the dK/dV kernel keeps BLOCK_N keys (k, v and the dK, dV
# accumulators) resident and streams queries; the dQ kernel does the opposite.
#
# Every candidate here is checked on a CPU by compiling it for sm_90 (tests/kit/test_kernel_candidates.py,
# `make check-kernels`): it must compile, fit shared memory, use wgmma (Hopper's warpgroup tensor-core
# MMA; it needs ≥ 64 rows per warpgroup in the first matmul operand — dK/dV tiles of 32 keys lose it) and
# spill no registers. The Triton tutorial's backward configs (dK/dV 32–64 queries × 128 keys and dQ 128
# queries × 32–64 keys, at 4 warps and 4–5 stages) are here with 8 warps: at 4 warps this kernel's
# dK/dV spills 190–2100 bytes per thread at D = 64 and its dQ 8–130 bytes (the deterministic design
# keeps k, v, dK and dV resident: 2·BLOCK_N·D fp32 accumulators plus two bf16 tiles). Which one wins is
# the autotuner's call on the GPU; none of these choices has been timed yet (no GPU was available).
GPU_CANDIDATES = {
    64: {
        "forward": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3),
                    (128, 32, 4, 3), (64, 32, 4, 4), (128, 128, 8, 2)],
        "dkdv": [(32, 128, 8, 3), (32, 128, 8, 4), (32, 128, 8, 5), (64, 128, 8, 3), (64, 128, 8, 4),
                 (32, 64, 4, 3), (64, 64, 4, 3), (16, 64, 4, 4)],
        "dq": [(128, 32, 8, 3), (128, 32, 8, 4), (128, 32, 8, 5), (128, 64, 8, 3), (128, 64, 8, 4),
               (64, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 5)],
    },
    128: {
        "forward": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (64, 64, 8, 3), (128, 32, 8, 3),
                    (64, 32, 4, 3), (64, 32, 4, 4), (64, 32, 8, 4)],
        "dkdv": [(16, 64, 8, 3), (16, 64, 8, 4)],
        "dq": [(128, 32, 8, 3), (128, 32, 8, 4), (128, 32, 8, 5)],
    },
}


def candidate_head_dim(head_dim: int) -> int:
    """The :data:`GPU_CANDIDATES` list a head dim uses: 64 for D ≤ 64, else 128."""
    return 64 if head_dim <= 64 else 128


def gpu_configs(kind: str, head_dim: int) -> list[triton.Config]:
    """The autotune candidates of kernel ``kind`` (``"forward"``, ``"dkdv"``, ``"dq"``) at ``head_dim``."""
    return _configs(GPU_CANDIDATES[candidate_head_dim(head_dim)][kind])


# What the autotuner is built with: every candidate of every head dim (the pruner keeps those of the
# launch's head dim).
GPU_CONFIGS = {kind: _configs(list(dict.fromkeys(c for by_kind in GPU_CANDIDATES.values() for c in by_kind[kind])))
               for kind in ("forward", "dkdv", "dq")}


def fixed_config(kind: str, dtype: torch.dtype, head_dim: int) -> dict[str, int]:
    """One safe launch config (tiles, warps, stages) for a GPU when not autotuning: fits in shared
    memory and registers for every supported dtype and head dim."""
    # Checked by compiling for sm_90: the bf16/fp16 ones fit shared memory, use wgmma and spill no registers
    # (tests/kit/test_kernel_candidates.py); the fp32 ones fit shared memory but may spill (fp32 is not tuned).
    if dtype == torch.float32 and head_dim <= 32:  # fp32 runs on the CUDA cores: small tiles, short pipelines
        m, n, w, s = {"forward": (64, 32, 4, 2), "dkdv": (32, 32, 4, 2), "dq": (64, 32, 4, 2)}[kind]
    elif dtype == torch.float32:
        m, n, w, s = {"forward": (64, 32, 8, 2), "dkdv": (32, 32, 8, 2), "dq": (32, 32, 8, 2)}[kind]
    elif head_dim <= 64:
        m, n, w, s = {"forward": (128, 64, 4, 3), "dkdv": (32, 128, 8, 3), "dq": (128, 32, 8, 3)}[kind]
    else:
        m, n, w, s = {"forward": (128, 64, 8, 2), "dkdv": (16, 64, 8, 3), "dq": (128, 32, 8, 3)}[kind]
    return {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}


def _prune(kind: str):
    """Keep the candidates of the launch's head dim that keep the tile-alignment rule and are not far
    larger than the problem."""

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        nq, nk = named_args["Nq"], named_args["Nk"]
        head_dim = named_args.get("HEAD_DIM", kwargs.get("HEAD_DIM", 128))
        mine = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in
                gpu_configs(kind, head_dim)}
        kept = []
        for c in configs:
            m, n = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
            aligned = (n % m == 0) if kind == "dkdv" else (m % n == 0)
            small_enough = m <= max(16, triton.next_power_of_2(nq)) and n <= max(16, triton.next_power_of_2(nk))
            if aligned and small_enough and (m, n, c.num_warps, c.num_stages) in mine:
                kept.append(c)
        return kept or gpu_configs(kind, head_dim)[-1:]

    return prune


def autotune_bucket(n: int) -> int:
    """The autotuning bucket of a sequence length ``n``: the next power of two, at least 16 (the smallest
    tile), so that 600 and 1000 share the bucket 1024 and 1025 starts the bucket 2048."""
    return max(16, triton.next_power_of_2(int(n)))


def tune_key(kind: str, dtype: torch.dtype, head_dim: int, is_causal: bool, nq: int, nk: int) -> str:
    """The autotuning key of one launch: ``kind`` (``"forward"``, ``"dkdv"``, ``"dq"``), dtype, head dim,
    causal flag and the buckets of Nq and Nk (:func:`autotune_bucket`), as a string."""
    return (f"{kind}|{str(dtype).removeprefix('torch.')}|D={head_dim}|causal={bool(is_causal)}"
            f"|Nq<={autotune_bucket(nq)}|Nk<={autotune_bucket(nk)}")


def tuning_cache_path() -> Path | None:
    """Where autotuned choices persist across processes (``$LLMSYS_FA_TUNE_CACHE``, default
    ``~/.cache/llmsys-lab/flash_attention_tuning.json``); None when set to ``off``."""
    value = os.environ.get("LLMSYS_FA_TUNE_CACHE", "")
    if value.lower() in ("off", "0", "none"):
        return None
    return Path(value) if value else Path.home() / ".cache" / "llmsys-lab" / "flash_attention_tuning.json"


def load_choice(path: Path | None, key: str) -> dict[str, int] | None:
    """The config stored under ``key`` in the JSON file ``path`` (BLOCK_M, BLOCK_N, num_warps,
    num_stages), or None (no file, no entry, unreadable file)."""
    try:
        entry = json.loads(path.read_text()).get(key) if path is not None else None
    except (OSError, ValueError):
        return None
    fields = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
    return {f: int(entry[f]) for f in fields} if isinstance(entry, dict) and all(f in entry for f in fields) else None


def save_choice(path: Path | None, key: str, config: dict[str, int]) -> None:
    """Add ``key → config`` to the JSON file ``path`` (written to a temporary file, then renamed, so a
    reader never sees half a file); errors are ignored: persistence is an optimisation."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            table = {}
        table[key] = config
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass


class Launcher:
    """``launcher[grid](*args, **kwargs)`` launches a kernel with its tile sizes chosen for you:

    * interpreted: the fixed :data:`INTERPRETER_BLOCKS`;
    * compiled, bf16/fp16, :data:`AUTOTUNE` on: ``@triton.autotune`` over :data:`GPU_CONFIGS`, once per
      :func:`tune_key` (power-of-two buckets of Nq and Nk, head dim, causal flag, dtype); the choice is
      remembered in :attr:`chosen` and in the file :func:`tuning_cache_path`, so later launches in the
      bucket, in this process or another, use it without tuning. Every kernel here writes its outputs
      without accumulating into them, so the repeated benchmark launches of autotuning are harmless;
    * otherwise: :func:`fixed_config`.

    ``grid`` must be a function of the launch meta-parameters, e.g.
    ``lambda meta: (BH, triton.cdiv(Nq, meta["BLOCK_M"]))`` (batch·heads on axis 0: CUDA caps axes 1 and 2 at
    65,535 programs, axis 0 at 2³¹ − 1), because the tile size is only known here.
    The first positional argument must be a tensor (its dtype picks the config); ``HEAD_DIM`` a keyword.
    """

    def __init__(self, kernel, kind: str):
        self.kernel, self.kind = kernel, kind
        self.tuned = None
        self.chosen: dict[str, dict[str, int]] = {}  # tune_key → config, this process
        if not triton_interpreted() and torch.cuda.is_available():
            self.tuned = triton.autotune(configs=GPU_CONFIGS[kind], key=["Nq", "Nk", "HEAD_DIM", "IS_CAUSAL"],
                                         prune_configs_by={"early_config_prune": _prune(kind)})(kernel)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if triton_interpreted():
                return self.kernel[grid](*args, **INTERPRETER_BLOCKS[self.kind], **kwargs)
            dtype = args[0].dtype
            if self.tuned is not None and AUTOTUNE and dtype != torch.float32:
                return self._launch_tuned(grid, args, kwargs)
            return self.kernel[grid](*args, **fixed_config(self.kind, dtype, kwargs["HEAD_DIM"]), **kwargs)

        return launch

    def _launch_tuned(self, grid, args: tuple, kwargs: dict):
        named = {**dict(zip(self.kernel.arg_names, args)), **kwargs}
        key = tune_key(self.kind, args[0].dtype, named["HEAD_DIM"], named.get("IS_CAUSAL", False), named["Nq"],
                       named["Nk"])
        config = self.chosen.get(key)
        if config is not None:  # the common case: tuned (or loaded) earlier in this process
            return self.kernel[grid](*args, **config, **kwargs)
        stored_key = "|".join((key, torch.cuda.get_device_name(), f"triton {triton.__version__}",
                               f"{self.kernel.__module__}.{self.kernel.__name__}", str(self.kernel.cache_key)[:16]))
        config = load_choice(tuning_cache_path(), stored_key)
        candidates = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                      for c in gpu_configs(self.kind, named["HEAD_DIM"])}
        if config is not None and tuple(config[f] for f in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")) \
                not in candidates:
            config = None  # stored before the candidate list changed: tune again
        if config is None:  # first launch in this bucket: tune (at this shape), remember, persist
            result = self.tuned[grid](*args, **kwargs)
            best = self.tuned.best_config
            config = {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}
            save_choice(tuning_cache_path(), stored_key, config)
            self.chosen[key] = config
            return result
        self.chosen[key] = config  # loaded from the file: show it as the autotuner's pick too
        self.tuned.cache[("bucket", key)] = triton.Config(
            {"BLOCK_M": config["BLOCK_M"], "BLOCK_N": config["BLOCK_N"]}, num_warps=config["num_warps"],
            num_stages=config["num_stages"])
        return self.kernel[grid](*args, **config, **kwargs)


def configure(kernel, kind: str) -> Launcher:
    """``kernel`` ready to launch as ``configure(kernel, kind)[grid](...)`` without tile sizes (see
    :class:`Launcher`); ``kind`` is ``"forward"``, ``"dkdv"`` or ``"dq"``."""
    return Launcher(kernel, kind)


def upcast_in_kernel(dtype: torch.dtype) -> bool:
    """Whether kernels must upcast loaded tiles to fp32: only bf16 under the interpreter."""
    return triton_interpreted() and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` for ``tl.dot``: exact ``"ieee"`` for fp32 inputs; fp16/bf16 ignore it."""
    return "ieee" if dtype == torch.float32 or upcast_in_kernel(dtype) else "tf32"


def check_triton_device(q: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors; the interpreter runs on CPU tensors.

    Raises:
        ValueError: a tensor on a device the Triton kernels cannot run on (a CPU tensor without the interpreter).
    """
    if not triton_interpreted() and q.device.type != "cuda":
        raise ValueError(f"FlashAttentionTriton needs CUDA tensors (q is on {q.device}); on a machine without "
                         "a GPU, `import kit` before triton so that TRITON_INTERPRET=1 runs the kernels on the CPU")
