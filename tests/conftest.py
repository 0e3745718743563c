"""Fixtures shared by the whole suite."""

import os

import pytest
import torch

from inkling_compiled.model.torchao_schemes import quiet_import

with quiet_import():  # transformers imports torchao with its model classes: its import-time lines are noise here
    from transformers import InklingForConditionalGeneration  # noqa: F401

from inkling_compiled.runtime import round_cache  # noqa: E402
from inkling_compiled.testing.synthetic import cached_checkpoint  # noqa: E402
from inkling_compiled.training import distill  # noqa: E402
from tests.helpers import QUICK_DISTILL  # noqa: E402


def pytest_configure(config):
    """One intra-op thread for the whole session, on CI's 2 cores: these tiny shapes run faster and steadier on one
    (Inductor's C++ compile workers keep the other core), and a compiled graph serves every later test of its
    geometry only at the thread count it was compiled at (Dynamo guards on the count, and a CPU kernel keeps it).
    A test that needs more threads would set them itself; none does.

    K > 1 CPU drafters compile their rounds here instead of packaging them into the disk cache (seconds instead of
    a minute per bucket, and nothing written outside the test's directories); tests/runtime/test_cached_round.py
    turns the cache on for itself."""
    torch.set_num_threads(1)
    os.environ[round_cache.ENV_VAR] = "off"


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """The tiny synthetic checkpoint (written once, cached)."""
    return cached_checkpoint("tiny")


@pytest.fixture(scope="session")
def quick_distilled(tiny_checkpoint, tmp_path_factory):
    """``tiny_checkpoint`` self-distilled with :data:`QUICK_DISTILL`."""
    return distill.distill(tiny_checkpoint, tmp_path_factory.mktemp("distill") / "tiny-distilled", progress=False,
                           **QUICK_DISTILL)
