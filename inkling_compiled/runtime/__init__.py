"""Runtime: the compiled / CUDA-graph drafter, its AOTInductor packages, the speculative generation loop, and its
``generate(custom_generate=...)`` entry."""

from .drafter import Drafter, DraftResult, DraftSource
from .packaged import PackageError, PackageMismatch
from .speculative import SpeculativeOutput, speculative_generate

__all__ = ["DraftResult", "DraftSource", "Drafter", "PackageError", "PackageMismatch", "SpeculativeGenerateOutput",
           "SpeculativeOutput", "custom_generate", "speculative_generate"]


def __getattr__(name: str):
    """``custom_generate`` and its output type import transformers' generation code: loaded on first use, so that
    importing the runtime stays cheap (docs/architecture.md §1)."""
    if name in ("custom_generate", "SpeculativeGenerateOutput"):
        from . import hf_generate

        return getattr(hf_generate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
