"""Runtime: the compiled / CUDA-graph drafter and the speculative generation loop."""

from .drafter import Drafter, DraftResult

__all__ = ["DraftResult", "Drafter"]
