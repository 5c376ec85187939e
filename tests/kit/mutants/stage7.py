"""Stage 7 mistakes (handout/07-fused-loss.md, handout/07b-whole-step.md).

Each must fail a public test with a message that points at it.
"""

from instructor.mutants import Mutant

# ------------------------------------------------------------------------------------ the fused loss (07 §1–§3)
FUSED_LOSS: list[Mutant] = [
]


# ------------------------------------------------------------------------ the optimizer and the step (07b §4–§7)
STEP: list[Mutant] = [
]


MUTANTS = FUSED_LOSS + STEP
