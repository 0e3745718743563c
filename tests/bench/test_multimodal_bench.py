"""The image-prompt section (``bench.multimodal``) on the tiny synthetic checkpoint, eager drafter, a few tokens:
both drafter prefills reproduce the target's greedy tokens, the figures are in range, and the table prints them."""

import torch

from bench.harness import plain
from bench.multimodal import lines, run_multimodal
from inkling_compiled.testing.synthetic import cached_checkpoint


def test_multimodal_figures_and_table():
    gen = torch.Generator().manual_seed(0)
    text = [torch.randint(8, 500, (n,), generator=gen) for n in (6, 5)]
    result = run_multimodal(cached_checkpoint("tiny"), text, k=2, new_tokens=4, patches=3, compile=False,
                            budget_s=0.5)
    assert result.same_tokens and result.k == 2 and len(result.acceptance["merged"]) == 2
    assert all(1.0 <= result.mean_accepted_length[name] <= 3.0 for name in ("merged", "placeholder"))
    assert all(result.tokens_per_s[name] > 0 for name in ("generate", "speculative")) and result.wrapper_cost > -1
    table = lines(plain(result))
    assert len(table) == 1 + 3 + 1 and "merged rows (ours)" in table[2] and "wrapper cost" in table[-1]
