"""Fixtures shared by the runtime tests."""

import pytest

from tests.runtime.test_speculative import make_target


@pytest.fixture(scope="module")
def target():
    return make_target()
