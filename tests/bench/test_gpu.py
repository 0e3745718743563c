"""The benchmark's CUDA-only pieces, without compiling: the CUDA-graph GEMM floor, copy bandwidth, bytes per step,
and a quick bench run (eager / transformers / floor, bf16) whose JSON carries the bandwidth block."""

import pytest
import torch

from bench import run
from bench.floor import GemmFloor, record_gemms
from bench.models import load_models
from bench.schema import validate
from bench.step import copy_bandwidth, make_drafter, make_inputs, prefill, step_bytes, step_fn

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return load_models("tiny", device="cuda", dtype=torch.bfloat16)


def test_floor_is_captured_as_a_cuda_graph_and_replays_the_step_gemms(models):
    inputs = make_inputs(models, 2, 16)
    eager = make_drafter(models, 2, 64, compile=False)
    prefill(models, eager, inputs)
    gemms, _ = record_gemms(step_fn(eager, inputs), models.mtp.parameters())
    assert any(g.weight and g.mnk == (2, models.config.vocab_size, models.config.hidden_size) for g in gemms)
    floor = GemmFloor(gemms, "cuda")
    assert floor.graph is not None
    floor()
    torch.cuda.synchronize()


def test_copy_bandwidth_and_step_bytes(models):
    bw = copy_bandwidth(torch.device("cuda"), nbytes=1 << 28, iters=5)
    assert 1e10 < bw < 1e14  # 10 GB/s .. 100 TB/s
    b = step_bytes(models, 1, 16)
    c = models.config
    assert b["lm_head"] == c.logits_vocab_size * c.hidden_size * 2
    assert b["total"] == sum(v for k, v in b.items() if k != "total")


def test_quick_bench_on_cuda_without_compiling(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    result = run.run(["--quick", "--device", "cuda", "--config", "tiny", "--skip", "compile,compiled,e2e",
                      "--json", str(tmp_path / "r.json"), "--results-md", ""])
    assert validate(result) == []
    lat = result["configs"]["tiny"]["latency"]["1"]
    assert {"eager", "hf_eager", "gemm_floor"} <= set(lat["variants"])
    assert lat["bandwidth"]["hbm_floor_ms"] > 0 and 0 < lat["bandwidth"]["achieved_fraction"]["eager"] < 1.5
