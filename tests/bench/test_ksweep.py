"""The K sweep's pooling of acceptance figures (``bench.ksweep``): rounds of several generations weighted alike."""

import torch

from bench.ksweep import _acceptance
from inkling_compiled.runtime import SpeculativeOutput


def output(per_round, emitted, rows=1, k=3):
    return SpeculativeOutput(sequences=torch.zeros(1, 1, dtype=torch.long), num_new_tokens=sum(emitted) + 1,
                             num_rounds=len(per_round), num_drafted=k * rows * len(per_round),
                             num_accepted=sum(map(sum, per_round)), acceptance_rate=0.0, mean_accepted_length=0.0,
                             num_speculative_tokens=k, accepted_per_position_per_round=per_round,
                             emitted_per_round=emitted)


def test_pooled_acceptance_per_position_and_lengths():
    batch1 = output([[1, 1, 0], [0, 0, 0], [1, 1, 1]], [3, 1, 4])
    batch2 = output([[2, 1, 0]], [4], rows=2)  # per row: one row accepted 2 drafts (3 tokens), the other 0 (1)
    pooled = _acceptance([batch1, batch2])
    assert pooled["acceptance_per_position"] == [4 / 5, 3 / 5, 1 / 5]
    assert pooled["mean_accepted_length"] == 12 / 5 and pooled["rounds"] == 4  # tokens per (row, round)
    assert abs(pooled["per_sequence_accepted_length"] - (1 + 8 / 5)) < 1e-12
