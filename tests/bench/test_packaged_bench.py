"""The packaged benchmark's summary (``bench.packaged``): the goal ratios from medians, the start-up rows, and a
table that names a failed part (the measurement itself runs under ``python -m bench.packaged``, not in CI)."""

from bench.packaged import format_table, ratios
from bench.records import Packaged, problems


def result(variants, startup=None, errors=None):
    stats = {name: {"median_ms": ms, "p10_ms": ms, "p90_ms": ms, "min_ms": ms, "n": 1} for name, ms in variants.items()}
    return {"preset": "tiny", "k": 1, "batch": 1, "context": 64, "device": "cpu", "dtype": "float32", "threads": 1,
            "torch": "2.13", "package": None, "startup": startup or {}, "errors": errors or {},
            "latency": {"batch": 1, "context": 64, "k": 1, "variants": stats, "same_drafts": {"packaged": True}}}


def test_ratios_are_medians_over_medians_and_skip_what_was_not_measured():
    out = result({"compiled": 0.3, "packaged": 0.1, "compiled_call": 0.2, "packaged_call": 0.05, "hf_eager": 2.0,
                  "gemm_floor": 0.04}, startup={"package": {"to_first_draft_s": 4.5}})
    found = ratios(out)
    assert found["packaged_vs_compiled_draft"] == 0.3 / 0.1 and found["packaged_vs_transformers"] == 2.0 / 0.1
    assert found["packaged_call_x_floor"] == 0.05 / 0.04 and found["startup_package_s"] == 4.5
    assert "packaged_vs_compiled_graph" not in found  # no CUDA-graph variants on CPU


def test_the_table_names_a_failed_part():
    out = result({"compiled": 0.3}, errors={"startup": "RuntimeError: probe failed"})
    out["ratios"] = ratios(out)
    assert "startup FAILED: RuntimeError: probe failed" in format_table(out)


def test_a_run_conforms_to_the_packaged_record():
    """What make bench stores under configs.<preset>.packaged (the JSON's schema, bench/records.py)."""
    out = result({"compiled": 0.3, "packaged": 0.1, "hf_eager": 2.0}, errors={"startup": "RuntimeError: probe"})
    out["ratios"] = ratios(out)
    assert problems(out, Packaged) == []
    del out["ratios"]
    assert problems(out, Packaged) == ["$: missing key 'ratios'"]
