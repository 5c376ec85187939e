"""Stage 2 benchmark: activation checkpointing with segments of k blocks — the bytes saved, measured.

    python -m benchmarks.bench_checkpoint                 # small, context 256, batch 2, k = none 1 2 3 4 6 12
    python -m benchmarks.bench_checkpoint --smoke         # seconds, any machine (into bench-output/smoke/)
    python -m benchmarks.bench_checkpoint --preset medium --context 128 --policies 1 2 3
    python -m benchmarks.bench_checkpoint --impl reference --save   # the committed benchmarks/results/ table

Run it from the repository root. Per checkpoint policy (``none`` or a segment length k), with Stage 2's
``saved_activation_bytes`` (works on a CPU):

* ``after_forward_MiB`` — the bytes autograd keeps after a training forward of the model wrapped by
  ``checkpointed(model, k)``: one input per segment plus what the embedding, head and loss save;
* ``recompute_MiB`` — the bytes one segment of k blocks saves when the backward recomputes it (its blocks
  run uncheckpointed on an input of the same shape), which coexist with the checkpoints during the
  backward;
* ``peak_saved_MiB`` — their sum, the most saved-activation bytes alive at once (the first segment the
  backward recomputes is a full k blocks while every checkpoint is still held);
* ``estimate_MiB`` — Stage 2's ``activation_memory_estimate`` for the same policy: ``total`` +
  ``recompute_peak``.

The recompute time does not depend on k (every block is recomputed once whatever the segment length), so
the table is about memory only. On CUDA ``peak_train_MiB`` adds the measured peak allocation of a whole
train step (``step_peak_memory``). Writes ``checkpoint.{md,csv,json}`` into ``bench-output/`` unless
``--out DIR`` or ``--save`` (full reference runs only) says otherwise.
"""

from __future__ import annotations

import torch

import kit  # noqa: F401 — sets TRITON_INTERPRET before anything imports triton
from kit import bench
from kit.data import random_batch
from kit.impl import load
from kit.model import TransformerLM, cross_entropy, get_config, make_optimizer

MiB = 2**20


def _policy(text: str) -> str | int:
    return text if text in ("none", "every_block") else int(text)


def run_one(impl, preset: str, context: int, batch: int, policy: str | int, device: torch.device) -> dict:
    precision = impl.precision
    config = get_config(preset, context_length=max(context, get_config(preset).context_length))
    inputs, targets = random_batch(batch, context, config.vocab_size, device=device, seed=0)
    torch.manual_seed(0)
    model = TransformerLM(config).to(device)
    k = 0 if policy == "none" else len(precision.checkpoint_segments(config.num_layers, policy)[0])
    if policy != "none":
        precision.checkpointed(model, policy)
    after = precision.saved_activation_bytes(lambda: cross_entropy(model(inputs), targets))
    recompute = 0
    if k:
        torch.manual_seed(0)
        plain = TransformerLM(config).to(device)
        h = torch.randn(batch, context, config.d_model, device=device, requires_grad=True)

        def segment() -> torch.Tensor:
            x = h
            for block in plain.layers[:k]:
                x = block(x)
            return x

        recompute = precision.saved_activation_bytes(segment)
        del plain
    est = precision.activation_memory_estimate(config, batch, context, "fp32", device_type=device.type,
                                               checkpoint_policy=policy)
    peak_train = None
    if device.type == "cuda":
        optimizer = make_optimizer(model)
        peak_train = precision.step_peak_memory(model, (inputs, targets), dtype="fp32", mode="train_step",
                                                optimizer=optimizer) / MiB
    segments = len(precision.checkpoint_segments(config.num_layers, policy)) if k else 0
    return {
        "preset": preset, "context": context, "batch": batch, "policy": str(policy), "k": k, "segments": segments,
        "after_forward_MiB": after / MiB, "recompute_MiB": recompute / MiB, "peak_saved_MiB": (after + recompute) / MiB,
        "estimate_MiB": (est["total"] + est["recompute_peak"]) / MiB, "peak_train_MiB": peak_train,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = bench.parser(__doc__)
    p.add_argument("--preset", default=None)
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--policies", nargs="+", default=None, help="none, every_block or segment lengths k")
    args = bench.parse(p, argv)
    if args.smoke:
        preset, context, batch, policies = "tiny", 16, 1, ["none", "1", "2"]
    else:
        preset, context, batch, policies = "small", 256, 2, ["none", "1", "2", "3", "4", "6", "12"]
    preset, context, batch = args.preset or preset, args.context or context, args.batch or batch
    policies = [_policy(x) for x in (args.policies or policies)]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    impl = load(args.impl)
    rows = [run_one(impl, preset, context, batch, policy, device) for policy in bench.progress(policies, "policy")]
    columns = ["preset", "context", "batch", "policy", "k", "segments", "after_forward_MiB", "recompute_MiB",
               "peak_saved_MiB", "estimate_MiB", "peak_train_MiB"]
    bench.save("checkpoint", rows, args, columns=columns,
               title=f"Activation checkpointing: saved bytes by segment length ({preset}, context {context}, "
                     f"batch {batch}, fp32)")
    fig, ax = bench.subplots()
    sel = [r for r in rows if r["k"]]
    ax.plot([r["k"] for r in sel], [r["after_forward_MiB"] for r in sel], marker="o", label="after forward")
    ax.plot([r["k"] for r in sel], [r["peak_saved_MiB"] for r in sel], marker="o", label="+ one recomputed segment")
    ax.set(xlabel="segment length k (blocks)", ylabel="MiB saved for backward", title="Checkpoint segment length")
    ax.legend()
    bench.save_figure(fig, "checkpoint", args)
    return rows


if __name__ == "__main__":
    main()
