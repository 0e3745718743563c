"""inkling_compiled: the Inkling MTP speculative-decoding draft head, eager PyTorch made fast by torch.compile.

Importing the package installs its Inductor passes (``inkling_compiled.passes``) into
``torch._inductor.config.post_grad_custom_post_pass``, chained after any pass already there, so that
``torch.compile(model)`` is all a user writes. ``INKLING_COMPILED_PASSES=0`` in the environment, or
``inkling_compiled.passes.uninstall()``, leaves Inductor stock. The install is lazy (when ``torch._inductor`` is
imported), and importing the package imports neither Inductor, Dynamo nor transformers (docs/architecture.md §1).
"""

from . import hf_compat, passes  # noqa: F401 (hf_compat first: importing it checks the transformers version)
from .checkpoint.layout import CheckpointError
from .config import ConfigError, MTPConfig
from .model import InklingMTP, MTPCache

passes.install()

__all__ = ["CheckpointError", "ConfigError", "InklingMTP", "MTPCache", "MTPConfig", "passes"]
