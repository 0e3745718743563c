"""The benchmark's CUDA-only pieces, without compiling: the CUDA-graph GEMM floor, copy bandwidth, bytes per step.
(The whole benchmark on CUDA is the GPU check's `full` stage.)"""

import pytest
import torch

from bench.floor import GemmFloor, record_gemms
from bench.models import load_models
from bench.step import copy_bandwidth, make_drafter, make_inputs, prefill, step_bytes

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return load_models("tiny", device="cuda", dtype=torch.bfloat16)


def test_floor_replays_the_step_gemms_from_one_captured_graph(models):
    inputs = make_inputs(models, 2, 16)
    eager = make_drafter(models, 2, 64, compile=False)
    gemms, _ = record_gemms(prefill(models, eager, inputs), models.mtp.parameters())
    assert any(g.weight and g.mnk == (2, models.config.vocab_size, models.config.hidden_size) for g in gemms)
    floor = GemmFloor(gemms, "cuda")
    assert floor.graph is not None
    floor()
    torch.cuda.synchronize()


def test_copy_bandwidth_and_step_bytes(models):
    bw = copy_bandwidth(torch.device("cuda"), nbytes=1 << 28)
    assert 1e10 < bw < 1e14  # 10 GB/s .. 100 TB/s
    b = step_bytes(models, 1, 16)
    c = models.config
    assert b["lm_head"] == c.logits_vocab_size * c.hidden_size * 2
    assert b["total"] == sum(v for k, v in b.items() if k != "total")
