"""fuse_draft_input (a depth's input block -> one kernel): what fires, what the kernel count becomes, and that
nothing changes numerically (bitwise equal to the unfused compile)."""

import itertools

import pytest
import torch

from inkling_compiled.model.depth_input import concat_normed, normed_embedding
from inkling_compiled.model.norm import rms_norm
from inkling_compiled.passes import fuse_draft_input
from inkling_compiled.testing.kernel_stats import compile_fresh
from inkling_compiled.torch_version import BEFORE_2_13

H, V = 64, 96
EPS = 1e-6


def _inputs(dtype, lead, weight_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    wdt = weight_dtype or dtype
    hidden = (3 * torch.randn(*lead, H, generator=g)).to(dtype)
    table = torch.randn(V, H, generator=g).to(dtype)
    ids = torch.randint(0, V, lead, generator=g)
    w_pre, w_h, w_e = ((torch.rand(H, generator=g) + 0.5).to(wdt) for _ in range(3))
    embeds = torch.randn(*lead, H, generator=g).to(dtype)
    return hidden, table, ids, w_pre, w_h, w_e, embeds


def _depth_input(hidden_first, pre_norm=True):
    """One depth's input block exactly as the model calls it (ids path)."""

    def block(hidden, table, ids, w_pre, w_h, w_e):
        e = normed_embedding(table, ids, w_pre if pre_norm else None, EPS)
        return concat_normed(hidden, e, w_h, w_e, EPS, hidden_first)

    return block


def _fired(run, **expected):
    return {k: v for k, v in run.matches.items() if v} == {k: v for k, v in expected.items() if v}


# --- the replacement is the pattern (eager, every variant: cheap) --------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden_first", [True, False])
@pytest.mark.parametrize("lead", [(5,), (2, 3)])
def test_replacements_equal_patterns_eagerly(dtype, hidden_first, lead):
    hidden, table, ids, w_pre, w_h, w_e, embeds = _inputs(dtype, lead)
    full = fuse_draft_input._embed_search(hidden_first)(hidden, table, ids, w_pre, w_h, w_e, EPS)
    full_one = fuse_draft_input._embed_replace(hidden_first)(hidden, table, ids, w_pre, w_h, w_e, EPS)
    assert torch.equal(full, full_one)
    bare = fuse_draft_input._bare_search(hidden_first)(hidden, embeds, w_h, w_e, EPS)
    bare_one = fuse_draft_input._bare_replace(hidden_first)(hidden, embeds, w_h, w_e, EPS)
    assert torch.equal(bare, bare_one)


def test_recomputed_norm_is_the_model_norm():
    x = torch.randn(4, 2, H).to(torch.bfloat16)
    w = torch.rand(2, H) + 0.5
    assert torch.equal(fuse_draft_input._rms_norm_recomputed(lambda: x, w, EPS), rms_norm(x, w, EPS))


# --- compiled: matches, kernel count, bitwise equality ----------------------------------------------------------

CASES = [
    # (dtype, weight dtype, lead, hidden_first, shared gain tensor, stock loop nests)
    (torch.float32, None, (2, 7), True, False, 2),  # one pass over memory per half
    (torch.bfloat16, None, (7,), False, False, 2),
    (torch.bfloat16, None, (1, 1), True, False, 5),  # the decode step: stock splits one row into 5 passes
    # both halves reading one gain tensor: the CPU scheduler already fuses them (a shared read is what it fuses on)
    (torch.bfloat16, torch.float32, (2, 7), True, True, 1),
]


@pytest.mark.parametrize("dtype, wdt, lead, hidden_first, shared, stock_nests", CASES)
def test_ids_path_becomes_one_loop_nest(dtype, wdt, lead, hidden_first, shared, stock_nests):
    hidden, table, ids, w_pre, w_h, w_e, _ = _inputs(dtype, lead, wdt)
    if shared:
        w_e = w_h  # one Parameter behind both depth norms still matches (a placeholder may have many readers)
    args = (hidden, table, ids, w_pre, w_h, w_e)
    block = _depth_input(hidden_first)
    stock = compile_fresh(block, *args, passes=False)
    fused = compile_fresh(block, *args, passes=True)
    assert _fired(fused, fuse_draft_input_embed=1)
    assert (stock.stats.cpp_kernels, stock.stats.loop_nests) == (1, stock_nests)
    assert (fused.stats.cpp_kernels, fused.stats.loop_nests) == (1, 1)
    assert fused.stats.extern_calls == stock.stats.extern_calls == []
    assert torch.equal(fused.output, stock.output)
    eager = block(*args)
    if dtype == torch.float32:
        torch.testing.assert_close(fused.output, eager, rtol=1e-5, atol=1e-5)
    else:  # compile keeps the bf16 rounding between the norms but fuses the rest: within a bf16 step or two
        torch.testing.assert_close(fused.output.float(), eager.float(), rtol=2e-2, atol=2e-2)


def _assert_two_norm_fusion_makes_one_nest(block, *args):
    """The two-norm fusion fires once, turns stock's 2 loop nests into 1, and changes no bit of the output."""
    stock = compile_fresh(block, *args, passes=False)
    fused = compile_fresh(block, *args, passes=True)
    assert _fired(fused, fuse_draft_input=1)
    assert (stock.stats.loop_nests, fused.stats.loop_nests) == (2, 1)
    assert torch.equal(fused.output, stock.output)


@pytest.mark.parametrize("dtype, lead, hidden_first", [(torch.bfloat16, (2, 7), True), (torch.float32, (7,), False)])
def test_inputs_embeds_path_becomes_one_loop_nest(dtype, lead, hidden_first):
    hidden, _, _, _, w_h, w_e, embeds = _inputs(dtype, lead)

    def block(hidden, embeds, w_h, w_e):  # multimodal: the embedding is an input, only the depth norms remain
        return concat_normed(hidden, embeds, w_h, w_e, EPS, hidden_first)

    _assert_two_norm_fusion_makes_one_nest(block, hidden, embeds, w_h, w_e)


def test_gather_without_backbone_norm_uses_the_two_norm_fusion():
    hidden, table, ids, w_pre, w_h, w_e, _ = _inputs(torch.float32, (2, 7))
    block = _depth_input(True, pre_norm=False)  # use_embed_norm=False: raw gather, inlined into the kernel
    _assert_two_norm_fusion_makes_one_nest(block, hidden, table, ids, w_pre, w_h, w_e)


def test_symbolic_lengths_still_fire():
    hidden, table, ids, w_pre, w_h, w_e, _ = _inputs(torch.bfloat16, (2, 7))
    for t in (hidden, ids):
        torch._dynamo.mark_dynamic(t, 1)  # what a recompile for a new length does
    args = (hidden, table, ids, w_pre, w_h, w_e)
    stock = compile_fresh(_depth_input(True), *args, passes=False)
    fused = compile_fresh(_depth_input(True), *args, passes=True)
    assert _fired(fused, fuse_draft_input_embed=1)
    assert fused.stats.loop_nests < stock.stats.loop_nests
    assert torch.equal(fused.output, stock.output)


# --- must not fire ---------------------------------------------------------------------------------------------


def test_eps_as_a_graph_input_does_not_fire():
    # dynamic=True also turns Python floats into graph inputs: eps is then a runtime tensor, equal or not to the
    # other norms' eps for all the compiler knows (the drafter compiles with dynamic=False; see passes/__init__)
    hidden, table, ids, w_pre, w_h, w_e, _ = _inputs(torch.float32, (2, 7))
    args = (hidden, table, ids, w_pre, w_h, w_e)
    run = compile_fresh(_depth_input(True), *args, passes=True, dynamic=True)
    assert _fired(run)
    torch.testing.assert_close(run.output, _depth_input(True)(*args), rtol=1e-5, atol=1e-5)



@pytest.mark.usefixtures("tests_count_as_model")
def test_depth_norms_with_different_eps_do_not_fire():
    hidden, _, _, _, w_h, w_e, embeds = _inputs(torch.float32, (7,))

    def block(hidden, embeds, w_h, w_e):
        return torch.cat([rms_norm(hidden, w_h, 1e-6), rms_norm(embeds, w_e, 1e-5)], dim=-1)

    run = compile_fresh(block, hidden, embeds, w_h, w_e, passes=True)
    assert _fired(run)
    torch.testing.assert_close(run.output, block(hidden, embeds, w_h, w_e), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(BEFORE_2_13, reason="torch 2.11 drops the bf16 rounding between the norms before our pass")
def test_backbone_eps_differing_from_depth_eps_leaves_only_the_two_norm_fusion():
    hidden, table, ids, w_pre, w_h, w_e, _ = _inputs(torch.bfloat16, (7,))

    def block(hidden, table, ids, w_pre, w_h, w_e):
        e = normed_embedding(table, ids, w_pre, 1e-5)
        return concat_normed(hidden, e, w_h, w_e, EPS, True)

    args = (hidden, table, ids, w_pre, w_h, w_e)
    stock = compile_fresh(block, *args, passes=False)
    run = compile_fresh(block, *args, passes=True)
    assert _fired(run, fuse_draft_input=1)
    assert stock.stats.loop_nests == run.stats.loop_nests == 2  # the backbone norm keeps its own pass
    assert torch.equal(run.output, stock.output)


def test_backbone_norm_read_elsewhere_is_not_swallowed():
    hidden, table, ids, w_pre, w_h, w_e, _ = _inputs(torch.float32, (7,))

    def block(hidden, table, ids, w_pre, w_h, w_e):
        e = normed_embedding(table, ids, w_pre, EPS)
        return concat_normed(hidden, e, w_h, w_e, EPS, True), e  # e has a second reader

    args = (hidden, table, ids, w_pre, w_h, w_e)
    run = compile_fresh(block, *args, passes=True)
    assert run.matches["fuse_draft_input_embed"] == 0
    for got, want in zip(run.output, block(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("tests_count_as_model")
def test_norm_with_unshared_input_does_not_fire():
    hidden, _, _, _, w_h, w_e, embeds = _inputs(torch.float32, (7,))

    def not_a_norm(x, y, w):  # the variance of one tensor scaling another: not rms_norm
        return (x * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS) * w)

    def block(hidden, embeds, w_h, w_e):
        return torch.cat([not_a_norm(hidden, embeds, w_h), rms_norm(embeds, w_e, EPS)], dim=-1)

    run = compile_fresh(block, hidden, embeds, w_h, w_e, passes=True)
    assert _fired(run)


def test_mixed_dtype_halves_do_not_fire():
    hidden, _, _, _, w_h, w_e, embeds = _inputs(torch.float32, (7,))
    embeds = embeds.to(torch.bfloat16)  # cat promotes the bf16 half: one [.., 2, H] tensor cannot hold both

    def block(hidden, embeds, w_h, w_e):
        return concat_normed(hidden, embeds, w_h, w_e, EPS, True)

    run = compile_fresh(block, hidden, embeds, w_h, w_e, passes=True)
    assert _fired(run)


@pytest.mark.skipif(BEFORE_2_13, reason="torch 2.11 cannot skip duplicate patterns: 2-D and 3-D both register")
def test_registered_variants():
    """Every dtype pair x order traces to its own pattern; 2-D and 3-D coincide (no reshapes in this block). The
    gather chain also registers each low-precision pair without its norm-to-norm rounding (torch 2.11's graph)."""
    low_precision = sum(act != torch.float32 for act, _ in fuse_draft_input._DTYPES)
    dtype_pairs = len(fuse_draft_input._DTYPES)
    expected = {"fuse_draft_input_embed": (dtype_pairs + low_precision) * 2, "fuse_draft_input": dtype_pairs * 2}
    for fusion in fuse_draft_input.FUSIONS:
        fusion.ensure_registered()
        entries = list(itertools.chain.from_iterable(fusion.patterns.patterns.values()))
        assert len(entries) == expected[fusion.name], fusion.name
