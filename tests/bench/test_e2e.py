"""The benchmark's end-to-end section on a self-distilled tiny target: every method runs, greedy speculative
decoding is lossless, and the record is the section's dataclass."""

import dataclasses

import pytest

from bench.e2e import E2E, run_e2e

pytestmark = pytest.mark.floor  # make test-floor: exercises a dependency at its lowest version


def test_e2e_section_on_the_distilled_target(quick_distilled):
    result = run_e2e(quick_distilled, count=1, new_tokens=8, compiled=False)
    assert isinstance(result, E2E) and dataclasses.asdict(result)["new_tokens"] == 8
    methods = result.methods
    assert set(methods) == {"target", "target_loop", "hf_mtp", "ours_eager"}
    for name, m in methods.items():
        assert m["new_tokens"] == 8 and m["tokens_per_s"] > 0
        if name != "target":
            assert m["outputs_match_target"] is True, name  # greedy speculative decoding is lossless
    assert 0 <= methods["ours_eager"]["acceptance"] <= 1 and methods["ours_eager"]["k"] == 1
    assert methods["hf_mtp"]["drafted"] > 0  # transformers' rounds were counted
