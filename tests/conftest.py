"""Fixtures shared by the whole suite."""

import pytest

from inkling_compiled.testing.synthetic import cached_checkpoint
from inkling_compiled.training import distill
from tests.helpers import QUICK_DISTILL, intra_op_threads


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests: on 2 shared cores it is several times faster (and steadier) for
    these tiny shapes."""
    with intra_op_threads(1):
        yield


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """The tiny synthetic checkpoint (written once, cached)."""
    return cached_checkpoint("tiny")


@pytest.fixture(scope="session")
def quick_distilled(tiny_checkpoint, tmp_path_factory):
    """``tiny_checkpoint`` self-distilled with :data:`QUICK_DISTILL` (one intra-op thread)."""
    with intra_op_threads(1):
        return distill.distill(tiny_checkpoint, tmp_path_factory.mktemp("distill") / "tiny-distilled", progress=False,
                               **QUICK_DISTILL)
