"""The per-row vs lockstep comparison (``bench.perrow``) on the undistilled tiny8 checkpoint, eager drafter, a few
tokens: every configuration reproduces the target's greedy tokens, and the table shows each (K, batch)."""

from bench.harness import plain
from bench.perrow import PerRowConfig, lines, run_perrow
from inkling_compiled.testing.synthetic import cached_checkpoint


def test_perrow_figures_and_table():
    cfg = PerRowConfig(batches=(1, 2), ks=(1, 2), prompt_len=6, new_tokens=5, compile=False, contexts=(16,))
    result = run_perrow(cached_checkpoint("tiny8"), cfg)
    assert set(result.ks) == {1, 2} and set(result.target) == {1, 2}
    for k, entry in result.ks.items():
        assert set(entry) == {1, 2}
        for batch, row in entry.items():
            for mode in ("lockstep", "per_row"):
                figures = row[mode]
                assert figures["same_tokens"] and 1.0 <= figures["tokens_per_forward"] <= k + 1
                assert figures["vs_batch1"] > 0 and (batch > 1 or figures["vs_batch1"] == 1.0)
            assert row["rollback"]["rounds"] > 0 and row["rollback"]["forward_ms"] > 0
        # batch 1 has one row: lockstep and per row are the same run
        assert entry[1]["lockstep"]["tokens_per_forward"] == entry[1]["per_row"]["tokens_per_forward"]
    assert result.rollback_vs_context[0]["rollback_ms"] > 0 and result.rollback_vs_context[0]["context"] == 16
    table = lines(plain(result))  # what make bench stores under "perrow", printed
    assert len(table) == 2 + 4 + 1 and "per-row vs lockstep" in table[0]
