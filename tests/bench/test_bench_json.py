"""A minimal ``python -m bench.run`` (quick, tiny, one in-process compile) writes JSON that conforms to the typed
records (``bench/records.py``) after every section, prints the table with every goal, and appends to a results
file only when asked."""

import copy
import json

import pytest
import torch

from bench import report, run
from bench.compile_probe import _split
from bench.records import SCHEMA_ID, problems


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    json_path = out / "result.json"
    on_disk_before_e2e = {}

    def e2e_section(settings):  # stands in for the last section: what is on disk now is what a kill would leave
        on_disk_before_e2e.update(json.loads(json_path.read_text()))
        raise RuntimeError("no e2e in this test")

    argv = ["--quick", "--config", "tiny", "--skip", "compile,stock,depths,perrow,packaged", "--threads", "1",
            "--json", str(json_path), "--record", str(out / "RESULTS.md")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run, "e2e_section", e2e_section)
        result = run.run(argv)
    yield result, out, on_disk_before_e2e
    torch._dynamo.reset()  # drop the compiled step so later tests start from a clean Dynamo cache


def test_json_conforms_to_the_records_after_every_section(quick):
    result, out, partial = quick
    on_disk = json.loads((out / "result.json").read_text())
    assert on_disk["schema"] == SCHEMA_ID and problems(on_disk) == []
    assert on_disk["partial"] is False and on_disk["completed"] == ["tiny/models", "tiny/latency/1", "tiny", "e2e"]
    assert on_disk["e2e"] == {"error": "RuntimeError: no e2e in this test"}  # a failed section is recorded
    assert problems(partial) == [] and partial["partial"] is True
    assert partial["completed"] == ["tiny/models", "tiny/latency/1", "tiny"]
    assert partial["configs"] == on_disk["configs"]
    lat = on_disk["configs"]["tiny"]["latency"]["1"]
    assert {"eager", "compiled", "compiled_call", "hf_eager", "gemm_floor"} <= set(lat["variants"])
    assert lat["ratios"]["speedup_vs_peer"]["compiled"] > 0
    assert lat["ratios"]["x_floor"]["eager"] > 1  # the step is slower than its GEMMs alone
    assert lat["gemm_calls"] == sum(g["count"] for g in lat["gemms"]) > 0
    kernels = on_disk["configs"]["tiny"]["kernels"]
    assert kernels["no_passes"] is None  # stock skipped
    assert kernels["passes"]["kernels"] > 0 and kernels["passes"]["extern_calls"] > 0
    assert kernels["passes"]["launches"] == kernels["passes"]["kernel_launches"] + kernels["passes"]["extern_calls"]
    assert sum(kernels["matches_passes"].values()) >= 1  # our passes fired on the real step
    assert on_disk["configs"]["tiny"]["compile"] is None  # skipped
    assert "quant" not in on_disk["configs"]["tiny"]  # opt-in on tiny (--with quant)

    broken = copy.deepcopy(on_disk)
    del broken["machine"]["cpu"]
    broken["configs"]["tiny"]["latency"]["1"]["variants"]["eager"]["median_ms"] = "fast"
    broken["goals"][0]["met"] = "yes"
    broken["settings"]["extra"] = 1
    assert problems(broken) == ["$.machine: missing key 'cpu'", "$.settings: unexpected key 'extra'",
                                "$.configs.tiny.latency.1.variants.eager.median_ms: expected float, got 'fast'",
                                "$.goals[0].met: expected bool or null, got 'yes'"]


def test_goals_are_printed_with_values_or_na(quick):
    result, _, _ = quick
    ids = [g["id"] for g in result["goals"]]
    assert ids == ["cpu_tiny_vs_transformers", "small_vs_gemm_floor", "e2e_tiny_faster_than_target",
                   "gpu_full_vs_hbm_floor", "cpu_tiny_cold_compile", "cpu_tiny_warm_compile",
                   "cpu_tiny_packaged_startup", "cpu_tiny_packaged_vs_transformers", "perrow_batch4_tokens_per_forward",
                   "k_sweep_compile_ratio"]
    vs_peer = result["goals"][0]
    assert vs_peer["value"] > 0 and vs_peer["met"] in (True, False)
    assert all(g["met"] is None for g in result["goals"][1:])  # not measured in this run
    table = report.format_table(result)
    assert "goals (targets, not asserts)" in table
    assert all(g["text"] in table for g in result["goals"])


def test_record_appends_an_entry(quick):
    result, out, _ = quick
    text = (out / "RESULTS.md").read_text()
    assert result["command"] in text and result["machine"]["torch"] in text and result["date"] in text


def test_results_stay_out_of_the_tracked_tree_unless_recorded():
    settings = run.parse_args([])
    assert settings.record is None and settings.json_path.parent == run.OUT_DIR
    assert run.parse_args(["--record"]).record == run.RESULTS_MD
    assert run.parse_args(["--record", "elsewhere.md", "--skip", "e2e,peer"]).skip == {"e2e", "peer"}


@pytest.mark.parametrize("argv, message", [(["--skip", "compiel"], "unknown section(s) to skip: ['compiel']"),
                                           (["--no-compile"], "unrecognized arguments: --no-compile"),
                                           (["--batch-sizes", "1,x"], "--batch-sizes must be comma-separated"),
                                           (["--with", "latency"], "not opt-in: ['latency']; choose from quant"),
                                           (["--with", "quant", "--skip", "quant"], "both skipped and asked for"),
                                           (["--ks", "1,two"], "--ks must be comma-separated integers, got '1,two'"),
                                           (["--ks", "0,4"], "each >= 1, got '0,4'")])
def test_bad_arguments_name_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit):
        run.parse_args(argv)
    assert message in capsys.readouterr().err


def test_compile_time_split():
    times = {"_compile.compile_inner": 10.0, "OutputGraph.call_user_compiler": 8.5, "compile_fx_inner": 7.0,
             "bytecode_tracing": 1.0}
    split = _split(times)
    assert split["dynamo_s"] == pytest.approx(1.5) and split["backend_s"] == 8.5 and split["inductor_s"] == 7.0
    assert split["breakdown_s"] == {"bytecode_tracing": 1.0, "compile_fx_inner": 7.0}
    assert _split({})["dynamo_s"] == 0.0
