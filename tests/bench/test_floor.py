"""The GEMM-only floor records the step's matrix multiplies with their real shapes and replays exactly those."""

import pytest
import torch

from bench.floor import GemmFloor, record_gemms, summarize
from bench.harness import time_variants
from inkling_compiled.runtime import Drafter
from tests.helpers import random_mtp

BATCH, CONTEXT, MAX_LENGTH = 2, 12, 32


@pytest.fixture(scope="module")
def recorded():
    model = random_mtp()
    drafter = Drafter(model, BATCH, MAX_LENGTH, compile=False, num_speculative_tokens=1)
    gen = torch.Generator().manual_seed(0)
    h, v = model.config.hidden_size, model.config.logits_vocab_size
    ids = torch.randint(0, v, (BATCH, CONTEXT + 1), generator=gen)
    hidden = torch.randn(BATCH, CONTEXT + 1, h, generator=gen)
    positions = torch.arange(CONTEXT + 1)[None].expand(BATCH, -1)
    with torch.no_grad():
        model(ids[:, :CONTEXT], positions[:, :CONTEXT], hidden[:, :CONTEXT], cache=drafter.cache)

    def step():
        return drafter.draft(ids[:, CONTEXT:], positions[:, CONTEXT:], hidden[:, CONTEXT:], validate=False).tokens

    gemms, tokens = record_gemms(step, model.parameters())
    return model, gemms, tokens, step


def test_weight_gemms_are_the_depth0_projections_and_the_lm_head(recorded):
    model, gemms, _, _ = recorded
    layer, c = model.layers[0], model.config
    g = c.depths[0]
    expected = sorted([(BATCH, m.weight.shape[0], m.weight.shape[1])
                       for m in layer.modules() if isinstance(m, torch.nn.Linear)]
                      + [(BATCH * g.num_heads, g.rel_extent, c.d_rel)]  # rel-bias profiles, one row per head
                      + [(BATCH, c.vocab_size, c.hidden_size)])  # the shared LM head (padded rows included)
    got = sorted(tuple(x.mnk) for x in gemms if x.weight)
    assert got == expected
    # one of them is the input projection [B, 2H] x [2H, H], another the MLP's fused gate/up
    assert (BATCH, c.hidden_size, 2 * c.hidden_size) in got
    assert (BATCH, 2 * c.intermediate_size, c.hidden_size) in got


def test_activation_gemms_are_the_attention_over_the_visible_cache_slots(recorded):
    model, gemms, _, _ = recorded
    g = model.config.depths[0]
    acts = [x for x in gemms if not x.weight]
    assert {x.name for x in acts} == {"bmm"}
    # a sliding depth reads the W slots ending at the (one-row) step; a full depth every slot + the scratch slot
    slots = g.window if g.window is not None else MAX_LENGTH + 1
    scores, values = sorted(acts, key=lambda x: x.mnk[2] == slots, reverse=True)
    group = g.num_heads // g.num_kv_heads
    assert scores.mnk == (BATCH * g.num_kv_heads, group, slots, g.head_dim)  # q . k over all slots
    assert values.mnk == (BATCH * g.num_kv_heads, group, g.head_dim, slots)  # probs @ v


def test_floor_replays_the_same_ops_shapes_and_strides(recorded):
    _, gemms, _, _ = recorded
    floor = GemmFloor(gemms, "cpu")
    assert len(floor.calls) == len(gemms)
    for (op, args, _kwargs), g in zip(floor.calls, gemms):
        assert op is g.op
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        assert [t.shape for t in tensors] == [o.shape for o in g.operands]
        assert [t.stride() for t in tensors] == [o.stride() for o in g.operands]
        assert [t.dtype for t in tensors] == [o.dtype for o in g.operands]
    floor()
    assert sum(row["count"] for row in summarize(gemms)) == len(gemms)


def test_floor_is_below_the_step(recorded):
    _, gemms, _, step = recorded
    stats = time_variants({"step": step, "floor": GemmFloor(gemms, "cpu")}, device=torch.device("cpu"), budget_s=0.6)
    assert 0 < stats["floor"].median_ms < stats["step"].median_ms


def test_recording_does_not_change_the_result(recorded):
    _, _, tokens, step = recorded
    with torch.no_grad():
        assert torch.equal(step(), tokens)
