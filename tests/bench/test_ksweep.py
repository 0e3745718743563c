"""The K sweep (``bench.ksweep``, the benchmark's depths section): pooled acceptance figures, transformers' rounds
per position, the lockstep batch, and a whole sweep on the reduced text target (eager drafters) whose record
is the section's dataclass and whose tokens equal the target's."""

import pytest
import torch

from bench.harness import plain
from bench.ksweep import Depths, KSweepConfig, hf_acceptance, left_padded_batch, lines, pooled_acceptance, run_ksweep
from inkling_compiled.runtime import SpeculativeOutput
from inkling_compiled.training import text_target as T


def output(per_round, emitted, rows=1, k=3):
    return SpeculativeOutput(sequences=torch.zeros(1, 1, dtype=torch.long), num_new_tokens=sum(emitted) + 1,
                             num_rounds=len(per_round), num_drafted=k * rows * len(per_round),
                             num_accepted=sum(map(sum, per_round)), acceptance_rate=0.0, mean_accepted_length=0.0,
                             num_speculative_tokens=k, accepted_per_position_per_round=per_round,
                             emitted_per_round=emitted)


def test_pooled_acceptance_per_position_and_lengths():
    batch1 = output([[1, 1, 0], [0, 0, 0], [1, 1, 1]], [3, 1, 4])
    batch2 = output([[2, 1, 0]], [4], rows=2)  # per row: one row accepted 2 drafts (3 tokens), the other 0 (1)
    pooled = pooled_acceptance([batch1, batch2])
    assert pooled["acceptance_per_position"] == [4 / 5, 3 / 5, 1 / 5]
    assert pooled["mean_accepted_length"] == 12 / 5 and pooled["rounds"] == 4  # tokens per (row, round)
    assert abs(pooled["per_sequence_accepted_length"] - (1 + 8 / 5)) < 1e-12


def test_transformers_rounds_per_position():
    rounds = [[3, 2], [3, 0], [0, 0], [2, 2]]  # [drafted, accepted]; a round that drafted nothing does not count
    assert hf_acceptance(rounds, 3) == ([2 / 3, 2 / 3, 0.0], 1 + 4 / 3)
    assert hf_acceptance([], 2) == ([0.0, 0.0], 1.0)


def test_left_padded_batch_pads_each_row_more():
    prompts = torch.arange(30).reshape(5, 6)
    ids, mask = left_padded_batch(prompts, pad_token_id=99)
    assert mask.tolist() == [[1] * 6, [0] + [1] * 5, [0, 0] + [1] * 4, [0, 0, 0] + [1] * 3]
    assert torch.equal(ids[mask == 1], prompts[:4][mask == 1]) and (ids[mask == 0] == 99).all()


def test_sweep_on_the_reduced_text_target(tmp_path):
    built = T.build(T.REDUCED, root=tmp_path, progress=False)
    prompts = T.heldout_prompts(4, 12)
    cfg = KSweepConfig(ks=(1, 2, 16), prompts=2, new_tokens=8, round_seconds=0.05, compiled=False)
    record = run_ksweep(built, cfg, prompts=prompts)
    assert isinstance(record, Depths)
    result = plain(record)
    assert list(result["ours"]) == ["1", "2"]  # K = 16 is beyond the 8 depths
    assert (result["prompts"], result["prompt_len"], result["hf_mtp"]["k"]) == (2, 12, 8)
    for point in [*result["ours"].values(), result["hf_mtp"]]:
        assert point["outputs_match_target"] is True  # greedy speculative decoding is lossless
        assert 1 <= point["mean_accepted_length"] <= 1 + point["k"]
        assert len(point["acceptance_per_position"]) == point["k"]
    for point in result["ours"].values():
        assert point["batch4"]["outputs_match_target"] is True
        assert point["batch4"]["mean_accepted_length"] <= point["batch4"]["per_sequence_accepted_length"]
        assert list(point["draft_round_ms"]) == ["1"] and point["draft_round_ms"]["1"]["n"] >= 1
        assert point["speedup_vs_hf_mtp"] > 0 and point["cold_compile"] is None
    table = lines(result)
    assert len(table) == 2 + 3 + 3 + 1  # header, baselines; 2 rows under each of the two headings; a note
    with pytest.raises(ValueError, match=r"none of K = \(16,\) fits the checkpoint's 8 MTP depth"):
        run_ksweep(built, KSweepConfig(ks=(16,)), prompts=prompts)
