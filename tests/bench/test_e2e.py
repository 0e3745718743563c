"""The benchmark's end-to-end section (``bench.e2e``): the acceptance pooling of ours and of transformers' rounds,
the left-padded groups, and whole runs with eager drafters: every method lossless, the K sweep's and the batched
part's figures within their bounds, the rollback timed, and the table printed from the JSON record."""

import dataclasses

import pytest
import torch

from bench.e2e import E2E, E2EConfig, hf_pooled, lines, padded_groups, pooled, run_e2e
from bench.harness import plain
from inkling_compiled.runtime import SpeculativeOutput
from inkling_compiled.training import text_target as T

pytestmark = pytest.mark.floor  # make test-floor: exercises a dependency at its lowest version


def output(per_round, emitted, rows=1, k=3):
    return SpeculativeOutput(sequences=torch.zeros(1, 1, dtype=torch.long), num_new_tokens=sum(emitted) + 1,
                             num_rounds=len(per_round), num_drafted=k * rows * len(per_round),
                             num_accepted=sum(map(sum, per_round)), acceptance_rate=0.0, mean_accepted_length=0.0,
                             num_speculative_tokens=k, accepted_per_position_per_round=per_round,
                             emitted_per_round=emitted)


def test_pooled_acceptance_per_position_and_lengths():
    batch1 = output([[1, 1, 0], [0, 0, 0], [1, 1, 1]], [3, 1, 4])
    batch2 = output([[2, 1, 0]], [4], rows=2)  # per row: one row accepted 2 drafts (3 tokens), the other 0 (1)
    p = pooled([batch1, batch2])
    assert p["acceptance_per_position"] == [4 / 5, 3 / 5, 1 / 5]
    assert p["accepted_length"] == 12 / 5 and p["rounds"] == 4  # tokens per (row, round)
    assert abs(p["per_sequence_accepted_length"] - (1 + 8 / 5)) < 1e-12
    assert (p["drafted"], p["accepted"]) == (15, 8) and p["acceptance"] == 8 / 15


def test_transformers_rounds_per_position():
    rounds = [[3, 2], [3, 0], [0, 0], [2, 2]]  # [drafted, accepted]; a round that drafted nothing does not count
    p = hf_pooled(rounds, 3)
    assert (p["acceptance_per_position"], p["accepted_length"]) == ([2 / 3, 2 / 3, 0.0], 1 + 4 / 3)
    assert (p["drafted"], p["accepted"], p["rounds"], p["acceptance"]) == (8, 4, 3, 0.5)
    empty = hf_pooled([], 2)
    assert (empty["acceptance_per_position"], empty["accepted_length"], empty["acceptance"]) == ([0.0, 0.0], 1.0, None)


def test_padded_groups_shorten_each_row_and_pad_left():
    prompts = torch.arange(48).reshape(8, 6)
    groups = padded_groups(prompts, 4, pad_token_id=99)
    assert len(groups) == 2
    for g, (ids, mask) in enumerate(groups):
        assert mask.tolist() == [[1] * 6, [0] + [1] * 5, [0, 0] + [1] * 4, [0, 0, 0] + [1] * 3]
        rows = prompts[4 * g:4 * g + 4]
        assert torch.equal(ids[mask == 1], rows[mask == 1]) and (ids[mask == 0] == 99).all()


def test_batch1_methods_on_the_distilled_target(quick_distilled):
    result = run_e2e(quick_distilled, E2EConfig(ks=(1,), prompts=1, new_tokens=8, compiled=False))
    assert isinstance(result, E2E) and dataclasses.asdict(result)["new_tokens"] == 8
    methods = result.methods
    assert set(methods) == {"target", "target_loop", "hf_mtp", "ours_eager_k1"}
    for name, m in methods.items():
        assert m["new_tokens"] == 8 and m["tokens_per_s"] > 0
        if name != "target":
            assert m["outputs_match_target"] is True, name  # greedy speculative decoding is lossless
    ours = methods["ours_eager_k1"]
    assert 0 <= ours["acceptance"] <= 1 and ours["k"] == 1 and ours["acceptance_per_position"] == [ours["acceptance"]]
    assert methods["hf_mtp"]["drafted"] > 0 and ours["speedup_vs_hf_mtp"] > 0  # transformers' rounds were counted
    assert result.rounds == {} and result.batched is None


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    return T.build(T.REDUCED, root=tmp_path_factory.mktemp("text"), progress=False)


def test_sweep_rounds_and_batches_on_the_reduced_text_target(reduced):
    cfg = E2EConfig(ks=(1, 2, 16), prompts=2, new_tokens=8, compiled=False, target_loop=False, round_seconds=0.05,
                    batches=(2, 4), contexts=(16,))
    result = plain(run_e2e(reduced, cfg, prompts=T.heldout_prompts(8, 12)))
    methods = result["methods"]
    assert list(methods) == ["target", "hf_mtp", "ours_eager_k1", "ours_eager_k2"]  # K = 16: beyond the 8 depths
    assert (result["prompts"], result["prompt_len"], methods["hf_mtp"]["k"]) == (2, 12, 8)
    for m in list(methods.values())[1:]:
        assert m["outputs_match_target"] is True  # greedy speculative decoding is lossless
        assert 1 <= m["accepted_length"] <= 1 + m["k"] and len(m["acceptance_per_position"]) == m["k"]
    assert list(result["rounds"]) == ["1", "2"]
    for r in result["rounds"].values():
        assert r["one_row_ms"]["n"] >= 1 and r["all_rows_cpu_ms"] > 0 and r["cold_compile"] is None
    batched = result["batched"]
    assert list(batched["target"]) == ["2", "4"] and list(batched["ks"]) == ["1", "2"]
    for k, entry in batched["ks"].items():
        for row in entry.values():
            for mode in ("lockstep", "per_row"):
                m = row[mode]
                assert m["same_tokens"] is True and 1.0 <= m["accepted_length"] <= int(k) + 1
                assert m["vs_batch1"] > 0 and m["tokens_per_s"] > 0
            assert row["per_row"]["accepted_length"] <= row["per_row"]["per_sequence_accepted_length"] + 1e-9
            assert row["rollback"]["rounds"] > 0 and row["rollback"]["forward_ms"] > 0
    assert batched["rollback_vs_context"][0]["context"] == 16 and batched["rollback_vs_context"][0]["rollback_ms"] > 0
    table = lines(result)
    assert len(table) == 1 + 5 + 1 + (1 + 3) + (1 + 5 + 1)  # header, methods, note; rounds; batches, rollback
    with pytest.raises(ValueError, match=r"none of K = \(16,\) fits the checkpoint's 8 MTP depth"):
        run_e2e(reduced, E2EConfig(ks=(16,)))
