"""Fixtures for the pass tests: an isolated post-grad slot, and bf16 ulp distance."""

import pytest
import torch
from torch._inductor import config as inductor_config


@pytest.fixture
def empty_slot():
    """The test starts with ``post_grad_custom_post_pass`` empty; whatever was there comes back afterwards."""
    saved = inductor_config.post_grad_custom_post_pass
    inductor_config.post_grad_custom_post_pass = None
    yield
    inductor_config.post_grad_custom_post_pass = saved


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
