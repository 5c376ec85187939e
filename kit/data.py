"""Batches of random tokens: enough to time and check training code, with no data set to download."""

from __future__ import annotations

import torch

from kit.validate import positive_int


def random_batch(
    batch_size: int,
    context_length: int,
    vocab_size: int,
    *,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)``, both int64 ``(batch_size, context_length)``; targets are inputs shifted by one.

    Pass ``seed`` (or a ``generator``) for the same batch on every rank and every run.
    """
    for name, value in (("batch_size", batch_size), ("context_length", context_length), ("vocab_size", vocab_size)):
        positive_int(name, value)
    if generator is None and seed is not None:
        generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, context_length + 1), generator=generator)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]
