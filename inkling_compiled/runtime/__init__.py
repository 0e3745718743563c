"""Runtime: the compiled / CUDA-graph drafter, its AOTInductor packages, and the speculative generation loop."""

from .drafter import Drafter, DraftResult, DraftSource
from .packaged import PackageError, PackageMismatch
from .speculative import SpeculativeOutput, speculative_generate

__all__ = ["DraftResult", "DraftSource", "Drafter", "PackageError", "PackageMismatch", "SpeculativeOutput",
           "speculative_generate"]
