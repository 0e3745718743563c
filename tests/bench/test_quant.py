"""``bench.quant``: the quantized-drafting rows (fp32 floor first, then the variants asked for) on the tiny preset,
and the benchmark's ``quant`` section built from them."""

import json

import pytest

from bench import plots, quant, run
from bench.quant import FLOOR, quant_rows


def test_rows_of_an_int8_variant_against_the_fp32_floor():
    rows = quant_rows("tiny", variants=("int8_head",), budget_s=0.3)
    floor, int8 = rows
    assert (floor["variant"], int8["variant"]) == (FLOOR, "int8_head")
    assert floor["x_fp32_floor"] == 1.0 and floor["bytes_x_fp32"] == 1.0
    assert (int8["dtype"], int8["quantized"], int8["inductor_options"]) == ("bfloat16", "depths+head", "default")
    assert int8["head_copy_bytes"] == 500 * (64 + 2)  # tiny: V' 500 rows of H 64 int8 + a bf16 scale each
    assert int8["bytes_per_step"] < floor["bytes_per_step"] / 2
    assert "_weight_int8pack_mm" in int8["extern_ops"] and int8["first_call_s"] > 0 and int8["median_ms"] > 0


def test_unknown_variants_are_refused_before_loading_anything():
    with pytest.raises(ValueError, match=r"unknown variants \['int4'\]: choose from \['fp32', 'bf16'"):
        quant_rows("tiny", variants=("bf16", "int4"))


def test_the_quant_section_of_a_run_keeps_what_built_and_names_what_failed(tmp_path, monkeypatch):
    built = quant._drafter

    def drafter(models, batch, max_length, fast):
        if models.mtp.quantization is not None:
            raise RuntimeError("no int8 kernel here")
        return built(models, batch, max_length, fast)

    monkeypatch.setattr(quant, "SCHEMES", {"fp32": "fp32", "int8_depths": "int8_depths_fast"})  # one compile
    monkeypatch.setattr(quant, "_drafter", drafter)
    path = tmp_path / "result.json"
    result = run.run(["--quick", "--only", "quant", "--with", "quant", "--json", str(path)])
    on_disk = json.loads(path.read_text())
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
    def quant_rows(*args, **kwargs):
        raise RuntimeError("broken")

    monkeypatch.setattr(quant, "quant_rows", quant_rows)
    result = run.run(["--quick", "--only", "quant", "--with", "quant", "--json", str(tmp_path / "result.json")])
    assert result["configs"]["tiny"]["quant"] == {"error": "RuntimeError: broken"}
    assert "quant: FAILED: RuntimeError: broken" in run.format_table(result)


def test_the_float8_scheme_is_benchmarked_on_cuda_only():
    """torchao's float8 GEMMs exist on sm89+ GPUs: the CPU run leaves its row out instead of recording a failure."""
    assert "torchao_float8_depths_head" not in quant.schemes("cpu")
    assert quant.schemes("cuda") == {**quant.SCHEMES, "torchao_float8_depths_head": "torchao_float8_head_fast"}
    variants = {v[0] for v in quant.VARIANTS}
    assert set(quant.schemes("cuda").values()) <= variants
    assert set(quant.device_variants("cpu")) == variants - {"torchao_float8_head_fast"}
    assert set(quant.device_variants("cuda")) == variants
