"""Both passes on the real model graph: InklingMTP loaded from the synthetic tiny checkpoint, one depth step plus
its head, compiled with and without the passes."""

import pytest
import torch

from inkling_compiled import InklingMTP
from inkling_compiled.testing.kernel_stats import compile_fresh
from inkling_compiled.testing.synthetic import cached_checkpoint
from tests.helpers import hidden_and_logits_step


@pytest.fixture(scope="module")
def checkpoint():
    return cached_checkpoint("tiny")


def _rows(mtp, dtype, batch=2, length=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, mtp.config.vocab_size, (batch, length), generator=g)
    positions = torch.arange(length).expand(batch, length)
    previous = torch.randn(batch, length, mtp.config.hidden_size, generator=g).to(dtype)
    return ids, positions, previous


@pytest.mark.floor  # make test-floor: one compile of the real step with both passes, on the lowest torch
def test_ids_step_and_top_tokens_fp32(checkpoint):
    mtp = InklingMTP.from_pretrained(checkpoint, dtype=torch.float32)
    ids, positions, previous = _rows(mtp, torch.float32)

    step = hidden_and_logits_step(mtp)

    stock = compile_fresh(step, ids, positions, previous, passes=False)
    fused = compile_fresh(step, ids, positions, previous, passes=True)
    assert fused.matches == {"fuse_draft_input_embed": 1, "fuse_draft_input": 0, "fold_mup_scale": 1}
    assert fused.stats.loop_nests == stock.stats.loop_nests - 1  # the input block: 2 passes -> 1
    assert stock.stats.extern_calls.count("addmm") == 0 and fused.stats.extern_calls.count("addmm") == 1
    assert len(fused.stats.extern_calls) == len(stock.stats.extern_calls)  # mm -> addmm, nothing added
    assert torch.equal(fused.output[0], stock.output[0])  # the depth's hidden: bitwise
    eager = step(ids, positions, previous)
    for got, want in zip(fused.output, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    top = compile_fresh(lambda h: mtp.get_top_tokens(h), eager[0], passes=True)
    assert top.matches["fold_mup_scale"] == 1 and top.stats.extern_calls == ["addmm"]
    assert torch.equal(top.output, eager[1].argmax(-1))


def test_inputs_embeds_step_bf16(checkpoint):
    mtp = InklingMTP.from_pretrained(checkpoint, dtype=torch.bfloat16)
    ids, positions, previous = _rows(mtp, torch.bfloat16)
    embeds = mtp.embed_tokens(ids)  # multimodal rows arrive already backbone-normed

    def step(embeds, positions, previous):
        hidden = mtp(None, positions, previous, depth=1, inputs_embeds=embeds)
        return hidden, mtp.compute_logits(hidden)

    stock = compile_fresh(step, embeds, positions, previous, passes=False)
    fused = compile_fresh(step, embeds, positions, previous, passes=True)
    assert fused.matches == {"fuse_draft_input_embed": 0, "fuse_draft_input": 1, "fold_mup_scale": 1}
    assert fused.stats.loop_nests == stock.stats.loop_nests - 1
    assert torch.equal(fused.output[0], stock.output[0])
    exact = fused.output[0].double() @ mtp.lm_head_weight.double().T / mtp.config.mup
    exact = exact[..., : mtp.config.logits_vocab_size]
    err_fused = (fused.output[1].double() - exact).abs().max()
    err_stock = (stock.output[1].double() - exact).abs().max()
    assert err_fused <= err_stock
