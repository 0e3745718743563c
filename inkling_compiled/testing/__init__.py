"""Helpers for users' own tests and our benchmark: synthetic checkpoints in the real layout
(:mod:`~inkling_compiled.testing.synthetic`), kernel statistics of generated code
(:mod:`~inkling_compiled.testing.kernel_stats`).

Not imported by ``import inkling_compiled``: import the submodule you need.
"""
