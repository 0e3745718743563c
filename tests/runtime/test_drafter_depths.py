"""The K-depth drafter (docs/protocol.md §6.3-6.6): every depth's cache and output after a round equal a clean
full-sequence recompute whatever the number of rejections, depths >= 1 see their full history, any padding layout,
the per-depth draft distributions, the CUDA-graph contract (CPU stand-in), and no recompiles at K = 8 (compiled)."""

import pytest
import torch

from inkling_compiled.arguments import ArgumentError
from inkling_compiled.runtime import Drafter
from tests.helpers import random_mtp, tiny_text_config
from tests.runtime.test_drafter import cuda, emulate_graphs

H, VOCAB = 64, 250
SLIDING = [0, 2, 4, 5, 6, 7]  # Inkling's pattern: depths 1 and 3 full attention


@pytest.fixture(scope="module")
def model():
    model = random_mtp(tiny_text_config(num_mtp_layers=8, mtp_local_layer_ids=SLIDING))
    model.lm_head_weight.mul_(30.0)  # peaked logits: drafts are not near-ties, so a wrong input changes them
    return model


def committed_stream(length, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length + 1), generator=gen), torch.randn(batch, length, H, generator=gen)


def recompute(model, tokens, hidden, k):
    """Clean full-sequence recompute of every depth over rows 0..F-1 (docs/protocol.md §6.3), into a fresh cache:
    ``tokens`` x_0..x_F, ``hidden`` h_0..h_{F-1}. Returns (drafts [B, K], each depth's output [B, F, H], cache)."""
    batch, rows = hidden.shape[:2]
    cache = model.new_cache(batch, 64)
    positions = torch.arange(rows).expand(batch, rows)
    stream, previous, drafts, outputs = tokens[:, 1:], hidden, [], []
    for depth in range(k):
        previous = model(stream, positions, previous, cache=cache, depth=depth)
        drafts.append(model.get_top_tokens(previous[:, -1]))
        outputs.append(previous)
        stream = torch.cat([stream[:, 1:], drafts[-1][:, None]], dim=1)
    return torch.stack(drafts, dim=1), outputs, cache


def assert_state_matches(drafter, result, model, tokens, hidden, k):
    drafts, outputs, cache = recompute(model, tokens, hidden, k)
    rows = hidden.shape[1]
    assert torch.equal(result.drafts, drafts)
    torch.testing.assert_close(result.hidden, outputs[-1][:, -1], atol=1e-5, rtol=0)
    for depth in range(k):  # K, V and all four conv streams of every depth, at every position written so far
        for got, want in zip(drafter.cache.depths[depth].tensors(), cache.depths[depth].tensors()):
            torch.testing.assert_close(got[:, :rows], want[:, :rows], atol=1e-5, rtol=0)


def verified_round(drafter, result, tokens, hidden, start, accepted, wrong=True):
    """Emulate a verification that accepted ``accepted`` drafts and corrected the next one to a different token
    (``wrong``), then feed the drafter the verified rows. Returns the new result and the committed stream."""
    k = drafter.num_speculative_tokens
    correction = (result.drafts[:, accepted] + 1) % VOCAB if wrong and accepted < k else tokens[:, start + accepted + 1]
    committed = torch.cat([tokens[:, :start + 1], result.drafts[:, :accepted], correction[:, None]], dim=1)
    rows = slice(start, start + accepted + 1)
    positions = torch.arange(start, start + accepted + 1).expand(tokens.shape[0], -1)
    return drafter.draft(committed[:, rows.start + 1:], positions, hidden[:, rows]), committed


def test_num_speculative_tokens_defaults_to_every_loaded_depth_and_is_checked(model):
    assert Drafter(model, 1, 8, compile=False).num_speculative_tokens == 8
    assert Drafter(model, 1, 8, compile=False, num_speculative_tokens=None).num_speculative_tokens == 8
    assert Drafter(model, 1, 8, compile=False, num_speculative_tokens=1).num_speculative_tokens == 1
    for bad in (0, 9, -1, True, 2.0, "3"):
        with pytest.raises(ArgumentError, match=rf"num_speculative_tokens must be an int in \[1, 8\] \(the model has 8 "
                                             rf"loaded MTP depth\(s\).*got {bad!r}"):
            Drafter(model, 1, 8, compile=False, num_speculative_tokens=bad)


@pytest.mark.parametrize("k", [3, 8])
def test_every_depth_equals_a_full_recompute_after_any_number_of_rejections(model, k):
    """Draft, reject with a deliberately wrong correction after 0..K accepted drafts, feed the verified rows (the
    drafter re-runs its stale rows), twice in a row: every depth's cache and the drafts equal a clean recompute."""
    prompt = 6
    tokens, hidden = committed_stream(prompt + 2 * (k + 1))
    for accepted in range(k + 1):
        drafter = Drafter(model, max_batch_size=2, max_length=64, compile=False, num_speculative_tokens=k)
        result = drafter.draft(tokens[:, 1:prompt + 1], torch.arange(prompt).expand(2, -1), hidden[:, :prompt])
        assert_state_matches(drafter, result, model, tokens[:, :prompt + 1], hidden[:, :prompt], k)
        start, stream = prompt, tokens
        for rejected_round in (accepted, k - accepted):
            result, committed = verified_round(drafter, result, stream, hidden, start, rejected_round)
            start += rejected_round + 1
            stream = torch.cat([committed, tokens[:, start + 1:]], dim=1)
            assert_state_matches(drafter, result, model, committed, hidden[:, :start], k)


@pytest.mark.parametrize("towers, calls", [
    ((9, 11), ((0, 8, False), (8, 10, True), (10, 11, False), (11, 12, False), (12, 13, False))),
    # a 3-row chunk pads to an 8-row bucket, which the window fills with one more stored row: a tower row
    ((5, 6), ((0, 5, True), (5, 8, False), (8, 11, False))),
    ((7, 9), ((0, 6, True), (6, 8, True), (8, 9, False))),  # a row chunk: never taken for accepted drafts
])
def test_a_sequence_may_switch_between_token_and_row_calls(model, towers, calls):
    """Validated calls, K = 4: token rows, then two given as ``inputs_embeds`` (tower rows, say), then tokens again.
    A round re-runs the three rows before its first from the history, which held row embeddings only of rows given
    as rows: the row call re-ran the token rows as zeros, and the token calls re-ran the tower rows as their ids'
    embeddings (wrong drafts and cache, no error). Each call equals the recompute over the merged rows."""
    k, gen = 4, torch.Generator().manual_seed(3)
    tokens, hidden = committed_stream(13, batch=1)
    merged = model.embed_tokens(tokens).detach().clone()  # row t of the stream reads merged row t + 1
    merged[:, slice(*towers)] = torch.randn(1, towers[1] - towers[0], H, generator=gen)
    drafter = Drafter(model, max_batch_size=1, max_length=64, num_speculative_tokens=k, compile=False)
    result = None
    for start, stop, rows in calls:
        if rows and start:  # the lead row's id is the last draft, its row a tower row: not an accepted draft
            tokens[:, start + 1] = result.drafts[:, 0]
        positions = torch.arange(start, stop)[None]
        given = {"inputs_embeds": merged[:, start + 1:stop + 1]} if rows else {}
        result = drafter.draft(tokens[:, start + 1:stop + 1], positions, hidden[:, start:stop], **given)
        stream, previous, drafts = merged[:, 1:stop + 1], hidden[:, :stop], []
        for depth in range(k):  # the recompute over the merged rows
            previous = model(None, torch.arange(stop)[None], previous, depth=depth, inputs_embeds=stream)
            drafts.append(model.get_top_tokens(previous[:, -1]))
            stream = torch.cat([stream[:, 1:], model.embed_tokens(drafts[-1][:, None])], dim=1)
        assert torch.equal(result.drafts, torch.stack(drafts, dim=1)), (start, stop)
        torch.testing.assert_close(result.hidden, previous[:, -1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("k", [2, 8])
def test_a_prompt_given_in_chunks_equals_one_prefill(model, k):
    """The window alone re-runs only the rows the loop's contract leaves stale (new rows led by the last call's
    accepted drafts): a second chunk of prompt left the first chunk's last rows of deeper depths reading drafts. A
    validated call re-runs the K - 1 rows before its first whatever they hold."""
    tokens, hidden = committed_stream(24)
    drafter = Drafter(model, max_batch_size=2, max_length=64, num_speculative_tokens=k, compile=False)
    for start, stop in ((0, 6), (6, 12), (12, 14)):
        positions = torch.arange(start, stop).expand(2, -1)
        result = drafter.draft(tokens[:, start + 1:stop + 1], positions, hidden[:, start:stop])
        assert_state_matches(drafter, result, model, tokens[:, :stop + 1], hidden[:, :stop], k)
    before = set(drafter._shapes)
    result, committed = verified_round(drafter, result, tokens, hidden, 14, min(2, k - 1))  # the contract: as is
    assert all(rows <= k + 1 for _, rows, _ in set(drafter._shapes) - before)
    assert_state_matches(drafter, result, model, committed, hidden[:, :14 + min(2, k - 1) + 1], k)


def test_k1_reruns_nothing(model):
    drafter = Drafter(model, max_batch_size=2, max_length=64, compile=False, num_speculative_tokens=1)
    assert drafter.history is None and drafter.bucket(2, 1) == (2, 1) and drafter.graph_rows == (1, 2)


def test_later_depths_see_their_full_history(model):
    """Depth 1 (full attention) and depth 2 (sliding) at a late position: the drafter's output equals the
    full-history recompute and differs from running that depth with an empty cache on the same row."""
    rows = 20
    tokens, hidden = committed_stream(rows)
    drafter = Drafter(model, max_batch_size=2, max_length=64, compile=False, num_speculative_tokens=3)
    result = drafter.draft(tokens[:, 1:rows + 1], torch.arange(rows).expand(2, -1), hidden)
    drafts, outputs, _ = recompute(model, tokens, hidden, 3)
    torch.testing.assert_close(result.hidden, outputs[2][:, -1], atol=1e-5, rtol=0)
    last = torch.full((2, 1), rows - 1)
    for depth in (1, 2):
        token = drafts[:, depth - 1:depth]  # depth k at the last row reads draft d_k
        alone = model(token, last, outputs[depth - 1][:, -1:], cache=model.new_cache(2, 64), depth=depth)
        assert (alone[:, 0] - outputs[depth][:, -1]).abs().max() > 1e-2


def test_any_padding_layout_drafts_from_the_last_real_row(model):
    """Right-, left- and mixed-padded rows give the drafts of the unpadded rows (K = 3, a decode round)."""
    tokens, hidden = committed_stream(9)
    results = []
    for layout in ("none", "left", "right", "mixed"):
        drafter = Drafter(model, max_batch_size=2, max_length=64, compile=False, num_speculative_tokens=3)
        prefill = drafter.draft(tokens[:, 1:7], torch.arange(6).expand(2, -1), hidden[:, :6])
        # two drafts accepted, the third corrected: the padded layouts re-run more stored rows, to the same values
        ids = torch.cat([prefill.drafts[:, :2], tokens[:, 9:10]], dim=1)
        positions, rows = torch.arange(6, 9).expand(2, -1).clone(), hidden[:, 6:9]
        pad = torch.full((2, 2), -1)
        if layout == "left":
            ids, positions = torch.cat([ids[:, :2], ids], 1), torch.cat([pad, positions], 1)
            rows = torch.cat([rows[:, :2], rows], 1)
        if layout == "right":
            ids, positions = torch.cat([ids, ids[:, :2]], 1), torch.cat([positions, pad], 1)
            rows = torch.cat([rows, rows[:, :2]], 1)
        if layout == "mixed":  # sequence 0 right-padded, sequence 1 left-padded
            positions = torch.cat([positions, pad], 1)
            positions[1] = torch.tensor([-1, -1, 6, 7, 8])
            ids = torch.stack([torch.cat([ids[0], ids[0, :2]]), torch.cat([ids[1, :2], ids[1]])])
            rows = torch.stack([torch.cat([rows[0], rows[0, :2]]), torch.cat([rows[1, :2], rows[1]])])
        results.append(drafter.draft(ids, positions, rows))
    for other in results[1:]:
        assert torch.equal(other.drafts, results[0].drafts)
        torch.testing.assert_close(other.hidden, results[0].hidden, atol=1e-5, rtol=0)


@pytest.mark.parametrize("k", [1, 3])
def test_ragged_rows_per_sequence_equal_each_sequences_recompute(model, k):
    """Per-row acceptance: in one call every sequence brings its own number of verified rows (padding after them,
    a finished sequence none at all) from its own frontier; each sequence's drafts and every depth's cache equal a
    clean recompute of that sequence alone, over two rounds with different accepted counts per sequence."""
    batch, length = 4, 40
    tokens, hidden = committed_stream(length, batch=batch, seed=3)
    prompts = [6, 9, 4, 7]  # left-padded prefill: the sequences' frontiers differ from the start
    width = max(prompts)
    positions = torch.stack([torch.arange(width) - (width - n) for n in prompts])
    ids = torch.stack([torch.cat([tokens[b, :width - n], tokens[b, 1:n + 1]]) for b, n in enumerate(prompts)])
    rows = torch.stack([torch.cat([hidden[b, :width - n], hidden[b, :n]]) for b, n in enumerate(prompts)])
    drafter = Drafter(model, max_batch_size=batch, max_length=64, compile=False, num_speculative_tokens=k)
    result = drafter.draft(ids, torch.where(positions >= 0, positions, -1), rows)
    streams = [tokens[b, :n + 1] for b, n in enumerate(prompts)]  # each sequence's committed tokens x_0..x_F
    for accepted in ([0, k, None, 1 % (k + 1)], [k, 1 % (k + 1), None, 0]):  # None: the sequence has finished
        keep = [0 if a is None else a + 1 for a in accepted]
        new_ids = torch.zeros(batch, max(keep), dtype=torch.long)
        new_pos = torch.full((batch, max(keep)), -1)
        new_hidden = torch.zeros(batch, max(keep), H)
        for b, a in enumerate(accepted):
            if a is None:
                continue
            start = len(streams[b]) - 1
            correction = (result.drafts[b, a] + 1) % VOCAB if a < k else tokens[b, start + a + 1]
            streams[b] = torch.cat([streams[b], result.drafts[b, :a], correction[None]])
            new_ids[b, :a + 1] = streams[b][start + 1:]
            new_pos[b, :a + 1] = torch.arange(start, start + a + 1)
            new_hidden[b, :a + 1] = hidden[b, start:start + a + 1]
        result = drafter.draft(new_ids, new_pos, new_hidden, validate=False)  # as the loop calls it
        for b in range(batch):
            if accepted[b] is None:
                continue
            rows_b = len(streams[b]) - 1
            drafts, outputs, cache = recompute(model, streams[b][None], hidden[b:b + 1, :rows_b], k)
            assert torch.equal(result.drafts[b:b + 1], drafts), b
            torch.testing.assert_close(result.hidden[b], outputs[-1][0, -1], atol=1e-5, rtol=0)
            for depth in range(k):
                for got, want in zip(drafter.cache.depths[depth].tensors(), cache.depths[depth].tensors()):
                    torch.testing.assert_close(got[b, :rows_b], want[0, :rows_b], atol=1e-5, rtol=0)


def test_sampled_round_returns_every_depths_distribution(model):
    tokens, hidden = committed_stream(8)
    drafter = Drafter(model, max_batch_size=2, max_length=64, compile=False, num_speculative_tokens=3)
    temperature = 0.7
    result = drafter.draft(tokens[:, 1:], torch.arange(8).expand(2, -1), hidden, temperature=temperature,
                           generator=torch.Generator().manual_seed(0))
    stream, previous = tokens[:, 1:], hidden
    for depth in range(3):  # the chain with the sampled drafts: depth k's q given d_1..d_k
        previous = model(stream, torch.arange(8).expand(2, -1), previous, depth=depth)
        q = torch.softmax(model.compute_logits(previous[:, -1]) / temperature, dim=-1)
        # cached (slot-addressed keys) vs full-sequence attention round differently in fp32; softmax at T = 0.7
        # turns ~1e-6 in the logits into up to ~4e-5 in a probability
        torch.testing.assert_close(result.draft_probs[:, depth], q, atol=1e-4, rtol=1e-4)
        stream = torch.cat([stream[:, 1:], result.drafts[:, depth:depth + 1]], dim=1)
    assert torch.equal(result.tokens, result.drafts[:, 0]) and torch.equal(result.probs, result.draft_probs[:, 0])


@torch.no_grad()
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_graph_path_replays_the_whole_round(monkeypatch, model, temperature):
    """The CUDA-graph contract with K = 3 (CPU stand-in graph): a round captured once and replayed gives the same
    drafts, distributions and cache as without graphs; the capture's extra runs leave the stored rows intact."""
    k, prompt = 3, 5
    tokens, hidden = committed_stream(prompt + 16)
    graphs = emulate_graphs(monkeypatch, Drafter(model, max_batch_size=2, max_length=64, compile=False,
                                                 num_speculative_tokens=k))
    plain = Drafter(model, max_batch_size=2, max_length=64, compile=False, num_speculative_tokens=k)
    outcomes = []
    for drafter in (graphs, plain):
        gen = torch.Generator().manual_seed(0)
        results = [drafter.draft(tokens[:, 1:prompt + 1], torch.arange(prompt).expand(2, -1), hidden[:, :prompt],
                                 temperature=temperature, generator=gen)]
        start = prompt
        for rows in (1, 4, 2, 3, 1, 4):  # verified rows a + 1 of successive rounds: windows of K and K + 1 rows
            sl = slice(start, start + rows)
            positions = torch.arange(sl.start, sl.stop).expand(2, -1)
            results.append(drafter.draft(tokens[:, sl.start + 1:sl.stop + 1], positions, hidden[:, sl],
                                         temperature=temperature, generator=gen, validate=False))
            start += rows
        outcomes.append(results)
    assert {shape.rows for shape in graphs._shapes.values() if shape.graph is not None} == {3, 4}
    for a, b in zip(*outcomes):
        assert torch.equal(a.drafts, b.drafts) and torch.equal(a.hidden, b.hidden)
        assert (a.draft_probs is None) == (temperature == 0)
        assert a.draft_probs is None or torch.equal(a.draft_probs, b.draft_probs)
    for got, want in zip(graphs.cache.depths, plain.cache.depths):  # every slot but the scratch one (padding)
        assert all(torch.equal(x[:, :-1], y[:, :-1]) for x, y in zip(got.tensors(), want.tensors()))


@torch.no_grad()
def test_compiled_k8_matches_eager_without_recompiles_and_the_passes_fire(compiled_k8):
    """K = 8 compiled (the session's distilled tiny8 drafter, compiled once in tests/runtime/conftest.py): one graph
    per depth geometry and window size (the passes fire in each), then a prefill and 65 rounds at advancing positions
    with every accepted count 0..8 and no recompile; drafts equal the eager drafter's."""
    compiled, matches = compiled_k8
    # two geometries x two window sizes, each graph with its embedding + norms + concat and its muP head fused
    assert matches == {"fuse_draft_input_embed": 4, "fuse_draft_input": 0, "fold_mup_scale": 4}
    k, prompt = 8, 8
    tokens, hidden = committed_stream(prompt + 64 * (k + 1))
    eager = Drafter(compiled.model, 1, compiled.max_length, compile=False, num_speculative_tokens=k)
    tokens, hidden = tokens[:1], hidden[:1]

    def feed(drafter, start, rows, **kwargs):
        sl = slice(start, start + rows)
        return drafter.draft(tokens[:, sl.start + 1:sl.stop + 1], torch.arange(sl.start, sl.stop)[None], hidden[:, sl],
                             **kwargs)

    with torch._dynamo.config.patch(error_on_recompile=True):
        first = [feed(d, 0, prompt) for d in (compiled, eager)]  # a new sequence: a K-row window; then K + 1 rows
        second = [feed(d, prompt, k + 1, validate=False) for d in (compiled, eager)]  # random rows: as the loop
        for a, b in (first, second):
            assert torch.equal(a.drafts, b.drafts)
        start = prompt + k + 1
        for i in range(64):
            rows = i % (k + 2) or 1  # 1..9 verified rows: 0..8 accepted drafts
            a, b = feed(compiled, start, rows, validate=False), feed(eager, start, rows, validate=False)
            assert torch.equal(a.drafts, b.drafts), i
            torch.testing.assert_close(a.hidden, b.hidden, atol=1e-4, rtol=0)
            start += rows


@pytest.mark.gpu
@cuda
@torch.no_grad()
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cuda_graph_of_the_whole_round_equals_the_compiled_round(temperature):
    """K = 8 on CUDA: each decode bucket (8 and 9 rows) is one CUDA graph spanning the prologue and all eight depth
    steps; replaying it gives the drafts, distributions, hiddens and caches of the same compiled round run without
    graphs (the warm-up and capture runs left the stored rows and caches as one call would)."""
    model = random_mtp(tiny_text_config(num_mtp_layers=8, mtp_local_layer_ids=SLIDING), dtype=torch.bfloat16).cuda()
    model.lm_head_weight.mul_(30.0)
    k, prompt = 8, 8
    tokens, hidden = committed_stream(prompt + 40)
    tokens, hidden = tokens.cuda(), hidden.to(device="cuda", dtype=torch.bfloat16)
    graphs = Drafter(model, max_batch_size=2, max_length=64, num_speculative_tokens=k, cuda_graphs=True)
    plain = Drafter(model, max_batch_size=2, max_length=64, num_speculative_tokens=k, cuda_graphs=False)
    outcomes = []
    for drafter in (graphs, plain):
        gen = torch.Generator(device="cuda").manual_seed(0)
        start, results = 0, []
        for rows in (prompt, 1, 9, 3, 9, 1, 5, 9):  # the prefill (8 rows: a K-row window), then verified rows
            sl = slice(start, start + rows)
            positions = torch.arange(sl.start, sl.stop, device="cuda").expand(2, -1)
            results.append(drafter.draft(tokens[:, sl.start + 1:sl.stop + 1], positions, hidden[:, sl],
                                         temperature=temperature, generator=gen))
            start += rows
        outcomes.append(results)
    assert graphs.uses_graph(2, 1) and graphs.uses_graph(2, 9)
    assert {shape.rows for shape in graphs._shapes.values() if shape.graph is not None} == {8, 9}
    for a, b in zip(*outcomes):
        assert torch.equal(a.drafts, b.drafts) and torch.equal(a.hidden, b.hidden)
        assert a.draft_probs is None or torch.equal(a.draft_probs, b.draft_probs)
    for got, want in zip(graphs.cache.depths, plain.cache.depths):  # every slot but the scratch one (padding)
        assert all(torch.equal(x[:, :-1], y[:, :-1]) for x, y in zip(got.tensors(), want.tensors()))
