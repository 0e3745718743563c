"""The benchmark's end-to-end section on a self-distilled tiny target: every method runs, greedy speculative
decoding is lossless, and the section's record is valid."""


from bench.e2e import E2EConfig, run_e2e
from bench.records import E2E, problems


def test_e2e_section_on_the_distilled_target(quick_distilled):
    result = run_e2e(quick_distilled, cfg=E2EConfig(prompts=1, new_tokens=8, compiled=False))
    methods = result["methods"]
    assert set(methods) == {"target", "target_loop", "hf_mtp", "ours_eager"}
    for name, m in methods.items():
        assert m["new_tokens"] == 8 and m["tokens_per_s"] > 0
        if name != "target":
            assert m["outputs_match_target"] is True, name  # greedy speculative decoding is lossless
    assert 0 <= methods["ours_eager"]["acceptance"] <= 1
    assert methods["hf_mtp"]["drafted"] > 0  # transformers' rounds were counted
    assert problems(result, E2E) == []
