"""Eager modules of the Inkling MTP draft head, one concept per file."""

from .cache import DepthCache, MTPCache
from .mtp import InklingMTP, MTPDepth

__all__ = ["DepthCache", "InklingMTP", "MTPCache", "MTPDepth"]
