"""The synthetic checkpoint is one directory for both libraries: transformers (target + its ``MtpModel``) and
``InklingMTP`` load it and compute the same depth outputs when fed the same raw embedding rows.

transformers feeds the raw embedding (docs/model.md §8 item 2) and applies no sliding window on its MTP path (item 10),
so both sides get the raw rows through ``inputs_embeds`` and the sliding depth is compared within its window.
"""

import pytest
import torch

from tests.helpers import both_libraries

pytestmark = pytest.mark.floor  # make test-floor: exercises a dependency at its lowest version


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    return both_libraries(tiny_checkpoint)


def raw_rows(models, batch, seq, seed=0):
    gen = torch.Generator().manual_seed(seed)
    c = models.config
    ids = torch.randint(0, c.logits_vocab_size, (batch, seq), generator=gen)
    hidden = torch.randn(batch, seq, c.hidden_size, generator=gen)
    positions = torch.arange(seq)[None].expand(batch, seq)
    return models.target.get_input_embeddings().weight[ids], positions, hidden


def test_both_libraries_load_the_same_directory(models):
    assert models.hf_mtp is not None and models.target is not None
    # shared tensors are the target's own Parameters, not copies
    assert models.mtp.lm_head_weight is models.target.lm_head.weight
    assert models.mtp.embed_weight is models.target.get_input_embeddings().weight
    assert models.mtp.config.num_depths == len(models.hf_mtp.layers)


@pytest.mark.parametrize("depth", [0, 1])
@torch.no_grad()
def test_same_depth_output_on_raw_embeddings(models, depth):
    geometry = models.config.depths[depth]
    seq = geometry.window if geometry.window else 16  # transformers has no window on its MTP path
    raw, positions, hidden = raw_rows(models, 2, seq)
    expected = models.hf_mtp.forward_layer(depth, hidden, positions, None, inputs_embeds=raw)
    got = models.mtp(None, positions, hidden, depth=depth, inputs_embeds=raw)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5
    # and the LM heads agree on those outputs (muP and the unpadded vocab included)
    logits = models.mtp.compute_logits(got)
    assert (logits - models.hf_mtp._project_to_logits(got)).abs().max().item() <= 1e-4
