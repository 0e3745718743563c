"""Training tools: self-distillation of the MTP depths on a target's own greedy continuations
(:mod:`~inkling_compiled.training.distill`, ``python -m inkling_compiled.training.distill``), and the text target, a
tiny Inkling trained on stdlib source with its depths distilled (:mod:`~inkling_compiled.training.text_target`).

Not imported by ``import inkling_compiled``.
"""
