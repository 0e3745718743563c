"""Training tools: self-distillation of the MTP depths on a target's own greedy continuations
(:mod:`~inkling_compiled.training.distill`, ``python -m inkling_compiled.training.distill``).

Not imported by ``import inkling_compiled``.
"""
