"""One full training step from the student's own pieces (handout 07b §5). SKELETON: the whole-step helper writes it.

Public API (the tests and ``python -m kit leaderboard`` call exactly this):

    build_train_step(config: StepConfig, *, world=None) -> TrainStep

``TrainStep(inputs, targets) -> float`` runs forward, loss, backward and the optimizer step once and returns
the step's loss; ``world`` is ``None`` (one process) or the process group to train data-parallel over.
"""

from __future__ import annotations

__all__ = ["build_train_step"]


def build_train_step(config, *, world=None):
    """See the module docstring."""
    # BEGIN SOLUTION the skeleton's placeholder: the whole-step helper replaces it (handout 07b §5)
    raise NotImplementedError("skeleton")
    # END SOLUTION
