"""Runtime: the compiled / CUDA-graph drafter, its AOTInductor packages, the speculative generation loop, and its
``generate(custom_generate=...)`` entry."""

from .drafter import Drafter, DraftResult, DraftSource
from .hf_generate import SpeculativeGenerateOutput, custom_generate
from .packaged import PackageError, PackageMismatch
from .speculative import SpeculativeOutput, speculative_generate

__all__ = ["DraftResult", "DraftSource", "Drafter", "PackageError", "PackageMismatch", "SpeculativeGenerateOutput",
           "SpeculativeOutput", "custom_generate", "speculative_generate"]
