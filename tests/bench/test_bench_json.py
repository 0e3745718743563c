"""A minimal ``python -m bench.run`` (quick, tiny, one in-process compile) writes JSON that matches the documented
schema (``bench/schema.py``), prints the table with every goal, and appends to the results file."""

import copy
import json

import pytest
import torch

from bench import report, run
from bench.compile_probe import _split
from bench.schema import SCHEMA_ID, validate
from bench.step import kernel_summary


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["--quick", "--config", "tiny", "--skip", "compile,e2e,stock", "--threads", "1",
            "--json", str(out / "result.json"), "--results-md", str(out / "RESULTS.md")]
    result = run.run(argv)
    yield result, out
    torch._dynamo.reset()  # drop the compiled step so later tests start from a clean Dynamo cache


def test_json_matches_the_schema(quick):
    result, out = quick
    on_disk = json.loads((out / "result.json").read_text())
    assert on_disk["schema"] == SCHEMA_ID
    assert validate(on_disk) == []
    lat = on_disk["configs"]["tiny"]["latency"]["1"]
    assert {"eager", "compiled", "hf_eager", "gemm_floor"} <= set(lat["variants"])
    for stats in lat["variants"].values():
        assert stats["median_ms"] > 0 and stats["n"] > 0
    assert lat["ratios"]["speedup_vs_peer"]["compiled"] > 0
    assert lat["ratios"]["x_floor"]["eager"] > 1  # the step is slower than its GEMMs alone
    assert lat["gemm_calls"] == sum(g["count"] for g in lat["gemms"]) > 0
    kernels = on_disk["configs"]["tiny"]["kernels"]
    assert kernels["passes"]["kernels"] > 0 and kernels["passes"]["extern_calls"] > 0
    assert kernels["passes"]["launches"] == kernels["passes"]["kernel_launches"] + kernels["passes"]["extern_calls"]
    assert sum(kernels["matches_passes"].values()) >= 1  # our passes fired on the real step
    assert on_disk["configs"]["tiny"]["compile"] is None and on_disk["e2e"] is None  # skipped


def test_goals_are_printed_with_values_or_na(quick, capsys):
    result, _ = quick
    ids = [g["id"] for g in result["goals"]]
    assert ids == ["cpu_tiny_vs_transformers", "small_vs_gemm_floor", "e2e_tiny_faster_than_target",
                   "gpu_full_vs_hbm_floor", "cpu_tiny_cold_compile", "cpu_tiny_warm_compile"]
    vs_peer = result["goals"][0]
    assert vs_peer["value"] > 0 and vs_peer["met"] in (True, False)
    assert all(g["met"] is None for g in result["goals"][1:])  # not measured in this run
    table = report.format_table(result)
    assert "goals (targets, not asserts)" in table
    assert all(g["text"] in table for g in result["goals"])


def test_results_md_gets_an_entry(quick):
    result, out = quick
    text = (out / "RESULTS.md").read_text()
    assert result["command"] in text and result["machine"]["torch"] in text and result["date"] in text


def test_validate_reports_problems(quick):
    result, _ = quick
    broken = copy.deepcopy(result)
    del broken["machine"]["cpu"]
    broken["configs"]["tiny"]["latency"]["1"]["variants"]["eager"]["median_ms"] = -1.0
    broken["goals"][0]["met"] = "yes"
    problems = validate(broken)
    assert any("machine" in p and "cpu" in p for p in problems)
    assert any("eager.median_ms" in p for p in problems)
    assert any("goals[0].met" in p for p in problems)


def test_compile_time_split():
    times = {"_compile.compile_inner": 10.0, "OutputGraph.call_user_compiler": 8.5, "compile_fx_inner": 7.0,
             "bytecode_tracing": 1.0}
    split = _split(times)
    assert split["dynamo_s"] == pytest.approx(1.5) and split["backend_s"] == 8.5 and split["inductor_s"] == 7.0
    assert split["breakdown_s"] == {"bytecode_tracing": 1.0, "compile_fx_inner": 7.0}
    assert _split({})["dynamo_s"] == 0.0


CPP_WRAPPER = """
extern "C"  void  cpp_fused_a_0(const float* in_ptr0, float* out_ptr0);
extern "C"  void  cpp_fused_b_1(const float* in_ptr0, float* out_ptr0);
void inductor_entry_impl() {
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(1, a, b, f32, cpu, 0, &buf0_handle));
    cpp_fused_a_0((const float*)(arg0_1.data_ptr()), (float*)(buf0.data_ptr()));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_mm_out(buf1, buf0, arg1_1));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_addmm_out(buf2, buf3, buf1, arg2_1, 0L, 0.5));
    cpp_fused_b_1((const float*)(buf2.data_ptr()), (float*)(buf4.data_ptr()));
}
extern "C"  void  cpp_fused_a_0(const float* in_ptr0, float* out_ptr0)
{
    #pragma omp parallel
    {
        for(int64_t x0=0; x0<64; x0++) { for(int64_t x1=0; x1<4; x1++) { out_ptr0[x0] += in_ptr0[x1]; } }
        for(int64_t x0=0; x0<64; x0++) { out_ptr0[x0] *= 2; }
    }
}
extern "C"  void  cpp_fused_b_1(const float* in_ptr0, float* out_ptr0)
{
    for(int64_t x0=0; x0<8; x0++) { out_ptr0[x0] = in_ptr0[x0]; }
}
"""


def test_kernel_summary_reads_a_cpp_wrapper():
    s = kernel_summary([CPP_WRAPPER])
    assert s["wrapper"] == "cpp"
    assert (s["kernels"], s["kernel_launches"], s["loop_nests"]) == (2, 2, 3)
    assert (s["extern_calls"], s["extern_ops"], s["launches"]) == (2, ["addmm", "mm"], 4)
