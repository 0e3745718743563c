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
    a minute or two per batch bucket, and nothing written outside the test's directories);
    tests/runtime/test_cached_round.py turns the cache on for itself."""
    torch.set_num_threads(1)
    os.environ[round_cache.ENV_VAR] = "off"


# `make test`'s pytest-xdist work units (--dist loadfile): a file each, except files that share a session fixture or an
# on-disk build too costly to make twice (each worker would build its own, both at once): those run as one unit, in
# one worker. Units start heaviest first (HEAVIEST_FIRST, measured cold on 2 cores), then by number of tests, so that
# no long unit starts last while the other worker runs out of work.
SHARED_UNITS = {
    # compiled_k8 (compiled per process, FX graph cache off) and tiny8_distilled (tests/runtime/conftest.py)
    "tests/runtime/test_drafter_depths.py": "tiny8",
    "tests/runtime/test_lossless_compiled_depths.py": "tiny8",
    "tests/runtime/test_multimodal.py": "tiny8",
    # one 120-step distillation of tiny, cached on disk: built once, then read
    "tests/runtime/test_lossless_compiled.py": "distilled-tiny",
    "tests/runtime/test_quantized_drafting.py": "distilled-tiny",
    # quick_distilled (tests/conftest.py)
    "tests/training/test_distill.py": "quick-distilled",
    "tests/bench/test_e2e.py": "quick-distilled",
}
HEAVIEST_FIRST = (  # seconds, cold, in one sequential run of the suite on 2 cores shared with two other jobs
    "tiny8",  # 257: tiny8's distillation, the K = 8 compile
    "distilled-tiny",  # 146: the distillation, the K = 1 compile
    "tests/model/test_tensor_parallel.py",  # 135: 10 interpreters (gloo ranks, torchrun)
    "tests/passes/test_fuse_draft_input.py",  # 131
    "tests/runtime/test_drafter.py",  # 123
    "tests/runtime/test_cached_round.py",  # 123: one dynamic-rows entry (2 AOTInductor compiles)
    "tests/test_imports.py",  # 112: 6 interpreters
    "tests/bench/test_bench_json.py",  # 89
    "tests/passes/test_only_our_graphs.py",  # 57
    "tests/passes/test_manager.py",  # 53
    "tests/passes/test_real_model.py",  # 46
    "tests/model/test_nan_isolation.py",  # 43
    "tests/runtime/test_speculative.py",  # 42
    "tests/training/test_text_target.py",  # 41
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with SHARED_UNITS' files together and HEAVIEST_FIRST's units handed out first (xdist is
    imported only where it runs: `pytest -p no:xdist` and `TEST_WORKERS=0` need none)."""
    from xdist.scheduler import LoadFileScheduling

    class SharedFixtureUnits(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SHARED_UNITS.get(path, path)

        def _assign_work_unit(self, node) -> None:
            heaviest = next((unit for unit in HEAVIEST_FIRST if unit in self.workqueue), None)
            if heaviest is not None:
                self.workqueue.move_to_end(heaviest, last=False)
            super()._assign_work_unit(node)

    return SharedFixtureUnits(config, log) if config.getvalue("dist") == "loadfile" else None


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """The tiny synthetic checkpoint (written once, cached)."""
    return cached_checkpoint("tiny")


@pytest.fixture(scope="session")
def quick_distilled(tiny_checkpoint, tmp_path_factory):
    """``tiny_checkpoint`` self-distilled with :data:`QUICK_DISTILL`."""
    return distill.distill(tiny_checkpoint, tmp_path_factory.mktemp("distill") / "tiny-distilled", progress=False,
                           **QUICK_DISTILL)
