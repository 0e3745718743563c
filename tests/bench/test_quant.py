"""``bench.quant``: the quantized-drafting rows (fp32 floor first, then the variants asked for) on the tiny preset."""

import pytest

from bench.quant import FLOOR, format_rows, quant_rows


def test_rows_of_an_int8_variant_against_the_fp32_floor():
    rows = quant_rows("tiny", variants=("int8_head",), warmup=1, rounds=2, per_round=2)
    floor, int8 = rows
    assert (floor["variant"], int8["variant"]) == (FLOOR, "int8_head")
    assert floor["x_fp32_floor"] == 1.0 and floor["bytes_x_fp32"] == 1.0
    assert (int8["dtype"], int8["quantized"], int8["inductor_options"]) == ("bfloat16", "depths+head", "default")
    assert int8["head_copy_bytes"] == 500 * (64 + 2)  # tiny: V' 500 rows of H 64 int8 + a bf16 scale each
    assert int8["bytes_per_step"] < floor["bytes_per_step"] / 2
    assert "_weight_int8pack_mm" in int8["extern_ops"] and int8["first_call_s"] > 0 and int8["median_ms"] > 0
    table = format_rows(rows)
    assert table.count("\n") == 3 and "| int8_head | bfloat16, int8 depths+head | default |" in table


def test_unknown_variants_are_refused_before_loading_anything():
    with pytest.raises(ValueError, match=r"unknown variants \['int4'\]: choose from \['fp32', 'bf16'"):
        quant_rows("tiny", variants=("bf16", "int4"))
