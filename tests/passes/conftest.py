"""Fixtures for the pass tests: an isolated post-grad slot, code in tests/ counted as the model's, bf16 ulp
distance."""

from pathlib import Path

import pytest
import torch
from torch._inductor import config as inductor_config

from inkling_compiled.passes import fusion

TESTS_DIR = str(Path(__file__).resolve().parents[1])


@pytest.fixture
def empty_slot():
    """The test starts with ``post_grad_custom_post_pass`` empty; whatever was there comes back afterwards."""
    saved = inductor_config.post_grad_custom_post_pass
    inductor_config.post_grad_custom_post_pass = None
    yield
    inductor_config.post_grad_custom_post_pass = saved


@pytest.fixture
def tests_count_as_model(monkeypatch):
    """The passes also rewrite ops written under tests/, as if the model had written them: for the tests of a fusion's
    own conditions (eps, dtypes, shapes, spellings) on graphs that the model's functions cannot produce."""
    monkeypatch.setattr(fusion, "MODEL_SOURCE_DIRS", (*fusion.MODEL_SOURCE_DIRS, TESTS_DIR))


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in representable steps between two same-dtype float tensors (bf16/fp16/fp32)."""
    assert a.dtype == b.dtype and a.is_floating_point()
    int_type = {2: torch.int16, 4: torch.int32}[a.element_size()]

    def ordered(t):  # sign-magnitude bit pattern -> monotonically ordered integer
        bits = t.contiguous().view(int_type).to(torch.int64)
        sign_bit = 1 << (8 * a.element_size() - 1)
        return torch.where(bits < 0, -(bits & (sign_bit - 1)), bits)

    return (ordered(a) - ordered(b)).abs()


@pytest.fixture
def ulps():
    return ulp_distance
