"""Fixtures shared by the runtime tests."""

import pytest
import torch

from inkling_compiled import InklingMTP, passes
from inkling_compiled.runtime import Drafter
from inkling_compiled.testing.synthetic import cached_checkpoint, load_hf_target
from inkling_compiled.training.distill import distill
from tests.helpers import make_target

K8_MAX_BATCH, K8_MAX_LENGTH = 4, 640


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="session")
def tiny8_distilled():
    """The tiny8 preset (Inkling's eight MTP depths) self-distilled so that drafts are accepted (about a minute;
    cached on disk)."""
    return distill(cached_checkpoint("tiny8"), steps=80, seq_len=32, num_sequences=128, eval_sequences=16,
                   progress=False)


@pytest.fixture(scope="session")
def tiny8_target_and_mtp(tiny8_distilled):
    """The distilled tiny8 target (no default EOS: each case passes its own or none) and its drafter model."""
    target = load_hf_target(tiny8_distilled)
    target.generation_config.eos_token_id = None
    return target, InklingMTP.from_pretrained(tiny8_distilled, target=target)


@pytest.fixture(scope="session")
def compiled_k8(tiny8_target_and_mtp):
    """The tiny8 drafter at K = 8, compiled once for the session, and the pass match counts of that compile.

    Its compile is most of what the K = 8 compiled tests cost, so they share it (test_drafter_depths.py,
    test_lossless_compiled_depths.py). One batch bucket of 4, windows of 8 and 9 rows (a prefill of at most K rows or
    a round of up to K + 1 verified rows): the prologue and both geometries' depth steps at each window size, all
    compiled here by a K-row and a (K + 1)-row call, with the FX graph cache off so that
    our passes run whatever the cache holds (a hit would skip them and count nothing). A Drafter keeps its cache and
    committed rows between calls and is reused by starting new sequences at position 0 (what speculative_generate
    does per call; tests/model/test_nan_isolation.py), so each test starts its own sequences there."""
    _, mtp = tiny8_target_and_mtp
    k = 8
    drafter = Drafter(mtp, K8_MAX_BATCH, K8_MAX_LENGTH, num_speculative_tokens=k, batch_buckets=(K8_MAX_BATCH,),
                      compile_options={"options": {"fx_graph_cache": False}})
    gen = torch.Generator().manual_seed(0)
    rows = 2 * k + 1
    ids = torch.randint(0, mtp.config.logits_vocab_size, (1, rows), generator=gen)
    hidden = torch.randn(1, rows, mtp.config.hidden_size, generator=gen)
    positions = torch.arange(rows)[None]
    passes.reset_match_counts()
    with torch.no_grad():
        for window in (slice(0, k), slice(k, rows)):  # random rows, not accepted drafts: unchecked, as the loop
            drafter.draft(ids[:, window], positions[:, window], hidden[:, window], validate=window.start == 0)
    return drafter, passes.match_counts()
