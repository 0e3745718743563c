"""The packaged section's summary (``bench.packaged``): the goal ratios from medians, and a table that names a failed
part (the measurement itself runs in ``make bench``, not in CI)."""

import dataclasses

from bench.harness import plain, ratios
from bench.packaged import RATIOS, Packaged, lines


def record(medians, startup=None, errors=None) -> dict:
    stats = {name: {"median_ms": ms, "p10_ms": ms, "p90_ms": ms, "min_ms": ms, "n": 1} for name, ms in medians.items()}
    found = Packaged("tiny", 1, 1, 64, "cpu", "float32", 1, startup=startup or {}, errors=errors or {},
                     latency={"batch": 1, "context": 64, "k": 1, "variants": stats, "same_drafts": {"packaged": True}})
    found.ratios = ratios(medians, RATIOS)
    return plain(found)


def test_ratios_are_medians_over_medians_and_skip_what_was_not_measured():
    found = ratios({"compiled": 0.3, "packaged": 0.1, "compiled_call": 0.2, "packaged_call": 0.05, "hf_eager": 2.0,
                    "gemm_floor": 0.04}, RATIOS)
    assert found["packaged_vs_compiled_draft"] == 0.3 / 0.1 and found["packaged_vs_transformers"] == 2.0 / 0.1
    assert found["packaged_call_x_floor"] == 0.05 / 0.04
    assert "packaged_vs_compiled_graph" not in found  # no CUDA-graph variants on CPU


def test_the_table_names_a_failed_part_and_every_ratio():
    out = record({"compiled": 0.3, "packaged": 0.1, "hf_eager": 2.0}, errors={"startup": "RuntimeError: probe"})
    assert set(out) == {f.name for f in dataclasses.fields(Packaged)}
    text = "\n".join(lines(out))
    assert "startup FAILED: RuntimeError: probe" in text and "packaged_vs_transformers" in text
    assert "same drafts as compiled: {'packaged': True}" in text
