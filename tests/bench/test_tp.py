"""The ``tp`` section on the tiny preset: the measured collective bytes of a draft round are what the plan says, the
sharded ranks draft what the unsharded model drafts, and the section prints."""

import dataclasses

from bench import tp
from inkling_compiled.testing.synthetic import cached_checkpoint


def test_measured_communication_is_the_plan():
    path = cached_checkpoint("tiny")
    (run,) = tp.measure_runs(path, (2,), batch=1, rounds=2)
    config_h, depths = 64, 2
    # K = 2: a decode round's window is 2 rows; per depth two [1, 2, H] fp32 all-reduces and the head's [2, 1, 2]
    assert run.greedy_round_bytes == depths * (2 * 2 * config_h * 4 + 2 * 1 * 2 * 4)
    assert run.greedy_collectives == depths * 3
    # sampled: the head gathers the [1, V / 2] logits of both ranks instead of the pairs
    assert run.sampled_round_bytes == depths * (2 * 2 * config_h * 4 + 2 * 1 * 256 * 4)
    assert run.same_drafts and run.parameter_bytes < run.unsharded_bytes
    full = tp.full_size()
    assert full.head_ratio >= 1000 and full.transformers_bytes == full.sglang_bytes
    record = {"preset": "tiny", "batch": 1, "num_speculative_tokens": 2,
              "runs": [dataclasses.asdict(run)], "full": dataclasses.asdict(full)}
    assert any("transformers" in line for line in tp.lines(record))
