"""Runtime: the compiled / CUDA-graph drafter and the speculative generation loop."""

from .drafter import Drafter, DraftResult
from .speculative import SpeculativeOutput, speculative_generate

__all__ = ["DraftResult", "Drafter", "SpeculativeOutput", "speculative_generate"]
