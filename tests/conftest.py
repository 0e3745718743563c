"""Fixtures shared by the whole suite."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests: on 2 shared cores it is several times faster (and steadier) for
    these tiny shapes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
