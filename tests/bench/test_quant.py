"""``bench.quant``: the benchmark's ``quant`` section on the tiny preset: an int8 scheme against the fp32 GEMM floor,
a scheme that fails recorded by name, float8 on CUDA only."""

import json

import pytest
import torch

from bench import plots, quant, run
from bench.models import load_models
from bench.step import step_bytes
from inkling_compiled.runtime import Drafter


def _run(tmp_path, monkeypatch, names: tuple[str, ...]) -> tuple[dict, dict]:
    monkeypatch.setattr(quant, "SCHEMES", {name: quant.SCHEMES[name] for name in names})
    path = tmp_path / "result.json"
    result = run.run(["--quick", "--only", "quant", "--with", "quant", "--json", str(path)])
    return result, json.loads(path.read_text())


def _eager_drafter(models, batch, max_length):
    return Drafter(models.mtp, batch, max_length, compile=False, num_speculative_tokens=1)


# The int8 step's compile is most of a minute on 2 cores (its caches off: bench/quant.py). The section's figures (bytes,
# the first call's seconds, the ratio to the floor) do not depend on it: the default run takes them from the eager
# step, CI from the compiled one too; test_the_quant_section_of_a_run_keeps_what_built_and_names_what_failed compiles
# a scheme in the default run, tests/model/test_int8.py the int8 step's kernels.
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_an_int8_scheme_reads_less_than_half_the_fp32_bytes(tmp_path, monkeypatch, compiled):
    if not compiled:
        monkeypatch.setattr(quant, "_drafter", _eager_drafter)
    _, on_disk = _run(tmp_path, monkeypatch, ("int8_depths_head",))
    q = on_disk["configs"]["tiny"]["quant"]
    int8 = q["schemes"]["int8_depths_head"]
    fp32_bytes = step_bytes(load_models("tiny", peer=False), 1, 64)["total"]
    assert q["errors"] == {} and 0 < int8["step_bytes"] < fp32_bytes / 2
    assert int8["x_fp32_floor"] == int8["step"]["median_ms"] / q["fp32_floor_ms"] > 0 and int8["compile_s"] > 0


def test_the_quant_section_of_a_run_keeps_what_built_and_names_what_failed(tmp_path, monkeypatch):
    built = quant._drafter

    def drafter(models, batch, max_length):
        if models.mtp.quantization is not None:
            raise RuntimeError("no int8 kernel here")
        return built(models, batch, max_length)

    monkeypatch.setattr(quant, "_drafter", drafter)
    result, on_disk = _run(tmp_path, monkeypatch, ("fp32", "int8_depths"))  # one compile
    assert on_disk["completed"] == ["tiny/quant"] and set(on_disk["configs"]["tiny"]["quant"]) == {
        "batch", "fp32_floor_ms", "schemes", "errors"}
    assert on_disk["settings"]["opt_in"] == ["quant"]
    q = on_disk["configs"]["tiny"]["quant"]
    assert (q["batch"], list(q["schemes"]), q["errors"]) == (1, ["fp32"], {"int8_depths": "RuntimeError: no int8 "
                                                                            "kernel here"})
    fp32 = q["schemes"]["fp32"]
    assert fp32["x_fp32_floor"] == fp32["step"]["median_ms"] / q["fp32_floor_ms"] and fp32["compile_s"] > 0
    assert fp32["step_bytes"] > 0 and fp32["step"]["n"] > 0
    table = run.format_table(result)
    assert "quantized step, batch 1 (ms)" in table and "int8_depths: FAILED: RuntimeError: no int8 kernel" in table
    panels, _ = plots.plan(result)
    assert [p.title for p in panels] == ["tiny: weight-only quantized step (batch 1)"]


def test_a_section_that_raises_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    def models(*args, **kwargs):
        raise RuntimeError("broken")

    monkeypatch.setattr(quant, "_models", models)
    result = run.run(["--quick", "--only", "quant", "--with", "quant", "--json", str(tmp_path / "result.json")])
    assert result["configs"]["tiny"]["quant"] == {"error": "RuntimeError: broken"}
    assert "quant: FAILED: RuntimeError: broken" in run.format_table(result)


def test_the_float8_scheme_is_benchmarked_on_cuda_only():
    """torchao's float8 GEMMs exist on sm89+ GPUs: the CPU run leaves its row out instead of recording a failure."""
    assert quant.schemes("cpu") == quant.SCHEMES
    assert set(quant.schemes("cuda")) == {*quant.SCHEMES, "torchao_float8_depths_head"}
    assert quant.schemes("cuda")["torchao_float8_depths_head"][0] == torch.bfloat16
