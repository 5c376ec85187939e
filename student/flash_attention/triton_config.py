# Given code — read, don't edit. Generated from the kit's reference by `make student`.
"""Given code: how the Triton kernels are configured — compiled and autotuned on a GPU, interpreted on a CPU.

One kernel source runs in two worlds (handout 03 §5):

* **compiled** (a CUDA GPU): for bf16/fp16, tile sizes, ``num_warps`` and ``num_stages`` are chosen by
  ``@triton.autotune`` from the candidate lists below, once per *bucket* of problem shapes and dtype;
  the tiles go straight into ``tl.dot`` (tensor cores). fp32 uses one fixed config and
  ``input_precision="ieee"`` (exact fp32, not TF32).

Autotuning key (handout 03 §5). Tuning costs a few seconds per kernel (every candidate is compiled and
timed), so keying it on the exact lengths would retune at every new sequence length. The key is
:func:`tune_key`: the kernel, dtype, head dim, causal flag, the *next power of two* of Nq and Nk
(:func:`autotune_bucket`) — lengths 1025…2048 share one tuning, run at the first length seen — and the
bucket of batch·heads, which sets how many programs fill the GPU (16 × 128 query tiles and 1 × 128 are
different problems for a 132-SM H100). The chosen config is remembered per GPU model (the name of the
device the tensors are on) and also written to a small JSON file (:func:`tuning_cache_path`:
``$LLMSYS_FA_TUNE_CACHE``, by default ``~/.cache/llmsys-lab/flash_attention_tuning.json``;
``LLMSYS_FA_TUNE_CACHE=off`` keeps it in memory only), keyed also on the Triton version and the kernel's
source hash, so every later process on that machine launches the *same* config without timing anything:
results and speed are reproducible across processes, whereas a fresh timing-based choice can differ from
run to run when two candidates are within noise. Delete the file to retune.

Backward design (handout 03 §6). Two backward designs exist: the three kernels of ``triton_backward.py``
(``"split"``) and the one kernel of ``triton_backward_fused.py`` (``"fused"``, optional for students).
:func:`run_backward` runs the one :data:`BACKWARD` (``$LLMSYS_FA_BACKWARD``) names, or with ``"auto"`` (the
default) the faster of the two by measured time on a GPU — once per tuning bucket, persisted like the
configs — and the split design elsewhere. A design that is not implemented (a stub) is skipped.
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
# The kernels check it themselves (tl.static_assert), so a misaligned config fails to compile rather than
# compute a wrong gradient on the GPU only.
INTERPRETER_BLOCKS = {
    "forward": {"BLOCK_M": 64, "BLOCK_N": 32},
    "dkdv": {"BLOCK_M": 32, "BLOCK_N": 64},
    "dq": {"BLOCK_M": 64, "BLOCK_N": 32},
    "fused": {"BLOCK_M": 32, "BLOCK_N": 64},
}
KINDS = tuple(INTERPRETER_BLOCKS)
# Which tile must be a multiple of the other (see above): "m" — BLOCK_M of BLOCK_N; "n" — BLOCK_N of BLOCK_M.
MULTIPLE = {"forward": "m", "dkdv": "n", "dq": "m", "fused": "n"}


def aligned(kind: str, block_m: int, block_n: int) -> bool:
    """Whether tiles ``block_m`` × ``block_n`` keep kernel ``kind``'s tile-alignment rule (:data:`MULTIPLE`)."""
    return block_m % block_n == 0 if MULTIPLE[kind] == "m" else block_n % block_m == 0

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
# accumulators) resident and streams queries; the dQ kernel does the opposite; the fused backward is the
# dK/dV kernel plus a BLOCK_M × D dQ tile per step.
#
# Every candidate here is checked on a CPU by compiling it for sm_90 exactly as a launch on tensors whose
# addresses, strides and lengths are multiples of 16 compiles it (kit/triton_compile.py: Triton specialises
# on that; tests/kit/test_kernel_candidates.py, `make check-kernels`): it must compile, fit shared memory,
# use wgmma (Hopper's warpgroup tensor-core MMA) and spill no registers. Measured that way (bf16, causal):
# the Triton tutorial's backward configs at 4 warps fit at D = 64 except dK/dV 32 × 128 keys (52–64 bytes
# of spills per thread: this deterministic design keeps k, v, dK and dV resident), so its dQ 128 × 32 at
# 4 warps (215 registers) is here and its dK/dV only at 8 warps; at D = 128 the forward fits 128 × 128
# tiles at 8 warps and 2–3 stages (254 registers, 160 / 224 KiB), and dK/dV 32 × 64 and 64 × 64 at 8 warps
# (171 / 191 registers). The fused backward adds a BLOCK_M × D fp32 dQ tile (and the one it adds to) to
# the dK/dV kernel's registers: at D = 64 tiles of 64 queries fit (177–254 registers), at D = 128 only 32
# queries × 64 keys at 8 warps does (255 registers) — 64 × 64 spills 212 bytes, 64 × 128 440 — so there its
# dQ product runs on 32-row tiles. Its `num_stages` is 1: Triton pipelines only innermost loops, and the
# wait for its turn is a loop inside the query loop, so more stages change nothing. Which candidate and
# which design win is the autotuner's call on the GPU; none of these choices has been timed yet (no GPU
# was available).
GPU_CANDIDATES = {
    64: {
        "forward": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3),
                    (128, 32, 4, 3), (64, 32, 4, 4), (128, 128, 8, 2)],
        "dkdv": [(32, 128, 8, 3), (32, 128, 8, 4), (32, 128, 8, 5), (64, 128, 8, 3), (64, 128, 8, 4),
                 (32, 64, 4, 3), (64, 64, 4, 3), (16, 64, 4, 4)],
        "dq": [(128, 32, 8, 3), (128, 32, 8, 4), (128, 32, 8, 5), (128, 64, 8, 3), (128, 64, 8, 4),
               (128, 32, 4, 4), (128, 32, 4, 5), (64, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 5)],
        "fused": [(64, 128, 8, 1), (64, 64, 8, 1), (64, 64, 4, 1)],
    },
    128: {
        "forward": [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4),
                    (64, 64, 8, 3), (128, 32, 8, 3), (64, 32, 4, 3), (64, 32, 4, 4), (64, 32, 8, 4)],
        "dkdv": [(32, 64, 8, 3), (32, 64, 8, 4), (32, 64, 8, 2), (64, 64, 8, 3), (64, 64, 8, 2), (32, 64, 4, 3),
                 (32, 128, 8, 3), (16, 64, 8, 3)],
        "dq": [(128, 32, 8, 3), (128, 32, 8, 4), (128, 32, 8, 5), (128, 64, 8, 2), (64, 64, 8, 3), (64, 64, 4, 3),
               (64, 32, 4, 3), (64, 32, 8, 4)],
        "fused": [(32, 64, 8, 1)],
    },
}


def candidate_head_dim(head_dim: int) -> int:
    """The :data:`GPU_CANDIDATES` list a head dim uses: 64 for D ≤ 64, else 128."""
    return 64 if head_dim <= 64 else 128


def gpu_configs(kind: str, head_dim: int) -> list[triton.Config]:
    """The autotune candidates of kernel ``kind`` (``"forward"``, ``"dkdv"``, ``"dq"``, ``"fused"``) at ``head_dim``."""
    return _configs(GPU_CANDIDATES[candidate_head_dim(head_dim)][kind])


# What the autotuner is built with: every candidate of every head dim (the pruner keeps those of the
# launch's head dim).
GPU_CONFIGS = {kind: _configs(list(dict.fromkeys(c for by_kind in GPU_CANDIDATES.values() for c in by_kind[kind])))
               for kind in KINDS}


def fixed_config(kind: str, dtype: torch.dtype, head_dim: int) -> dict[str, int]:
    """One safe launch config (tiles, warps, stages) for a GPU when not autotuning: fits in shared
    memory and registers for every supported dtype and head dim."""
    # Checked by compiling for sm_90: the bf16/fp16 ones fit shared memory, use wgmma and spill no registers
    # (tests/kit/test_kernel_candidates.py); the fp32 ones fit shared memory but may spill (fp32 is not tuned).
    if dtype == torch.float32 and head_dim <= 32:  # fp32 runs on the CUDA cores: small tiles, short pipelines
        m, n, w, s = {"forward": (64, 32, 4, 2), "dkdv": (32, 32, 4, 2), "dq": (64, 32, 4, 2),
                      "fused": (32, 32, 4, 2)}[kind]
    elif dtype == torch.float32:
        m, n, w, s = {"forward": (64, 32, 8, 2), "dkdv": (32, 32, 8, 2), "dq": (32, 32, 8, 2),
                      "fused": (32, 32, 8, 2)}[kind]
    elif head_dim <= 64:
        m, n, w, s = {"forward": (128, 64, 4, 3), "dkdv": (32, 128, 8, 3), "dq": (128, 32, 8, 3),
                      "fused": (64, 128, 8, 1)}[kind]
    else:
        m, n, w, s = {"forward": (128, 64, 8, 2), "dkdv": (32, 64, 8, 3), "dq": (128, 32, 8, 3),
                      "fused": (32, 64, 8, 1)}[kind]
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
            small_enough = m <= max(16, triton.next_power_of_2(nq)) and n <= max(16, triton.next_power_of_2(nk))
            if aligned(kind, m, n) and small_enough and (m, n, c.num_warps, c.num_stages) in mine:
                kept.append(c)
        return kept or gpu_configs(kind, head_dim)[-1:]

    return prune


def autotune_bucket(n: int) -> int:
    """The autotuning bucket of a sequence length ``n``: the next power of two, at least 16 (the smallest
    tile), so that 600 and 1000 share the bucket 1024 and 1025 starts the bucket 2048."""
    return max(16, triton.next_power_of_2(int(n)))


def batch_heads_bucket(batch_heads: int) -> int:
    """The autotuning bucket of batch·heads: the next power of two (1, 2, 4, …), so that 12 and 16 share one."""
    return triton.next_power_of_2(max(1, int(batch_heads)))


def tune_key(kind: str, dtype: torch.dtype, head_dim: int, is_causal: bool, nq: int, nk: int,
             batch_heads: int = 1) -> str:
    """The autotuning key of one launch: ``kind`` (``"forward"``, ``"dkdv"``, ``"dq"``, ``"fused"``, or
    ``"backward"`` for the choice of design), dtype, head dim, causal flag, the buckets of Nq and Nk
    (:func:`autotune_bucket`) and of batch·heads (:func:`batch_heads_bucket`), as a string."""
    return (f"{kind}|{str(dtype).removeprefix('torch.')}|D={head_dim}|causal={bool(is_causal)}"
            f"|Nq<={autotune_bucket(nq)}|Nk<={autotune_bucket(nk)}|BH<={batch_heads_bucket(batch_heads)}")


def device_name(t: torch.Tensor) -> str:
    """The name of the GPU ``t`` lives on (``torch.cuda.get_device_name`` of its device, not the current one)."""
    return torch.cuda.get_device_name(t.device)


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
    entry = _load_entry(path, key)
    fields = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
    return {f: int(entry[f]) for f in fields} if isinstance(entry, dict) and all(f in entry for f in fields) else None


def _load_entry(path: Path | None, key: str):
    try:
        return json.loads(path.read_text()).get(key) if path is not None else None
    except (OSError, ValueError, AttributeError):
        return None


def save_choice(path: Path | None, key: str, config: dict) -> None:
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
      :func:`tune_key` (power-of-two buckets of Nq, Nk and batch·heads, head dim, causal flag, dtype) and GPU
      model; the choice is remembered in :attr:`chosen` and in the file :func:`tuning_cache_path`, so later
      launches in the bucket, in this process or another, use it without tuning. A kernel that accumulates
      into an output names it in ``reset_to_zero`` (zeroed before each of the autotuner's trial launches);
      the others write their outputs without reading them, so the repeated trial launches are harmless;
    * otherwise: :func:`fixed_config`.

    ``grid`` must be a function of the launch meta-parameters, e.g.
    ``lambda meta: (BH, triton.cdiv(Nq, meta["BLOCK_M"]))`` (batch·heads on axis 0: CUDA caps axes 1 and 2 at
    65,535 programs, axis 0 at 2³¹ − 1), because the tile size is only known here.
    The first positional argument must be a ``(batch·heads, N, D)`` tensor (its dtype picks the config, its
    device the GPU, its first dimension the batch·heads bucket); ``HEAD_DIM`` a keyword.
    """

    def __init__(self, kernel, kind: str, reset_to_zero: tuple[str, ...] = ()):
        self.kernel, self.kind = kernel, kind
        self.tuned = None
        self.chosen: dict[str, dict[str, int]] = {}  # tune_key|GPU name → config, this process
        if not triton_interpreted() and torch.cuda.is_available():
            self.tuned = triton.autotune(configs=GPU_CONFIGS[kind], key=["Nq", "Nk", "HEAD_DIM", "IS_CAUSAL"],
                                         prune_configs_by={"early_config_prune": _prune(kind)},
                                         reset_to_zero=list(reset_to_zero) or None)(kernel)

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
                       named["Nk"], args[0].shape[0])
        gpu = device_name(args[0])
        config = self.chosen.get(f"{key}|{gpu}")
        if config is not None:  # the common case: tuned (or loaded) earlier in this process, on this GPU model
            return self.kernel[grid](*args, **config, **kwargs)
        stored_key = "|".join((key, gpu, f"triton {triton.__version__}",
                               f"{self.kernel.__module__}.{self.kernel.__name__}", str(self.kernel.cache_key)[:16]))
        config = load_choice(tuning_cache_path(), stored_key)
        candidates = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                      for c in gpu_configs(self.kind, named["HEAD_DIM"])}
        if config is not None and tuple(config[f] for f in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")) \
                not in candidates:
            config = None  # stored before the candidate list changed: tune again
        if config is None:  # first launch in this bucket: tune (at this shape), remember, persist
            # Triton's autotuner keys on the exact Nq, Nk, head dim and causal flag only: forget what it picked
            # for another bucket (another batch·heads, another GPU) so that it times the candidates again here.
            self.tuned.cache.clear()
            result = self.tuned[grid](*args, **kwargs)
            best = self.tuned.best_config
            config = {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}
            save_choice(tuning_cache_path(), stored_key, config)
            self.chosen[f"{key}|{gpu}"] = config
            return result
        self.chosen[f"{key}|{gpu}"] = config  # loaded from the file: this process's pick from now on
        return self.kernel[grid](*args, **config, **kwargs)


def configure(kernel, kind: str, reset_to_zero: tuple[str, ...] = ()) -> Launcher:
    """``kernel`` ready to launch as ``configure(kernel, kind)[grid](...)`` without tile sizes (see
    :class:`Launcher`); ``kind`` is ``"forward"``, ``"dkdv"``, ``"dq"`` or ``"fused"``; ``reset_to_zero`` names
    the arguments the kernel accumulates into (zeroed before each autotuning trial)."""
    launcher = Launcher(kernel, kind, reset_to_zero)
    LAUNCHERS.append(launcher)
    return launcher


LAUNCHERS: list[Launcher] = []  # every launcher configure() made, in this process


# ------------------------------------------------------------------ the backward design


# "auto": on a GPU, the faster design by measured time (bf16/fp16 with AUTOTUNE on), else "split"; or a design's
# name to run that one (a stub design falls back to "split").
BACKWARD = os.environ.get("LLMSYS_FA_BACKWARD", "auto")
BACKWARD_DESIGNS = ("split", "fused")
_BACKWARD_KINDS = ("dkdv", "dq", "fused")


class BackwardChooser:
    """:func:`run_backward`'s memory: the design picked per tuning bucket and GPU model, in this process."""

    def __init__(self):
        self.chosen: dict[str, str] = {}

    def __call__(self, designs: dict, q: torch.Tensor, nk: int, is_causal: bool):
        if BACKWARD not in ("auto", *BACKWARD_DESIGNS):
            raise ValueError(f"LLMSYS_FA_BACKWARD must be 'auto' or one of {BACKWARD_DESIGNS}, got {BACKWARD!r}")
        if BACKWARD != "auto":
            return _run_design(designs, BACKWARD)
        if triton_interpreted() or not AUTOTUNE or q.dtype == torch.float32 or not torch.cuda.is_available():
            return _run_design(designs, "split")
        key = tune_key("backward", q.dtype, q.shape[-1], is_causal, q.shape[-2], nk, q[..., 0, 0].numel())
        gpu = device_name(q)
        design = self.chosen.get(f"{key}|{gpu}")
        if design is None:
            sources = ",".join(str(getattr(la.kernel, "cache_key", ""))[:8] for la in LAUNCHERS
                               if la.kind in _BACKWARD_KINDS)
            stored_key = "|".join((key, gpu, f"triton {triton.__version__}", sources))
            entry = _load_entry(tuning_cache_path(), stored_key)
            design = entry.get("design") if isinstance(entry, dict) else None
            if design not in designs:
                design = _fastest(designs)
                save_choice(tuning_cache_path(), stored_key, {"design": design})
            self.chosen[f"{key}|{gpu}"] = design
        return _run_design(designs, design)


def _not_implemented(exc: Exception) -> bool:
    """A stub: NotImplementedError in the interpreter, the stub's static_assert when compiled."""
    return isinstance(exc, NotImplementedError) or "NotImplementedError" in str(exc)


def _run_design(designs: dict, name: str):
    try:
        return designs[name]()
    except Exception as exc:
        if name == "split" or not _not_implemented(exc):
            raise
        return designs["split"]()


def _fastest(designs: dict) -> str:
    """The design whose backward takes least time on this GPU (each runs once first: its kernels autotune)."""
    from triton.testing import do_bench

    times = {}
    for name, run in designs.items():
        try:
            run()
        except Exception as exc:
            if _not_implemented(exc):
                continue
            raise
        times[name] = do_bench(run)
    return min(times, key=times.get) if times else "split"


_chooser = BackwardChooser()


def run_backward(designs: dict, q: torch.Tensor, nk: int, is_causal: bool):
    """The gradients of the backward design :data:`BACKWARD` names, or with ``"auto"`` of the faster one on
    this GPU (measured once per tuning bucket and GPU model, persisted in :func:`tuning_cache_path`), the
    split design elsewhere.

    ``designs`` maps ``"split"`` and ``"fused"`` to functions of no argument that run that design and return
    (dq, dk, dv); a design that is not implemented (its stub raises) falls back to ``"split"``. ``q`` is the
    query tensor (its dtype, device and shape pick the bucket), ``nk`` the number of keys.
    """
    return _chooser(designs, q, nk, is_causal)


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
