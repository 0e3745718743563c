"""inkling_compiled: the Inkling MTP speculative-decoding draft head, eager PyTorch made fast by torch.compile."""

from .checkpoint import CheckpointError
from .config import ConfigError, MTPConfig
from .model import InklingMTP, MTPCache

__all__ = ["CheckpointError", "ConfigError", "InklingMTP", "MTPCache", "MTPConfig"]
