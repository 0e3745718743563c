"""The drafter: compiled step == eager model, no recompiles while decoding, bucketing, CUDA graphs (gpu marker)."""

import pytest
import torch
from torch._inductor import list_mode_options

from inkling_compiled import InklingMTP
from inkling_compiled.arguments import ArgumentError
from inkling_compiled.runtime import Drafter
from tests.helpers import random_mtp

PROMPT = 11
# The compiled tests of this file share one geometry, so that they share three graphs (the prefill of PROMPT rows
# padded to 16, windows of 1 and 2 rows): compiled once, then served by the FX graph cache (~20 s each, cold, on a
# 2-core CPU). Batch bucket 4, max_length 256 (64 decode steps fit).
MAX_BATCH, MAX_LENGTH = 4, 256


def stream(batch, length, seed=0, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (batch, length), generator=gen)
    hidden = torch.randn(batch, length, 64, generator=gen)
    positions = torch.arange(length)[None].expand(batch, length).contiguous()
    return ids.to(device), positions.to(device), hidden.to(device=device, dtype=dtype)


def run_decode(drafter, ids, positions, hidden, windows, temperature=0.0, seed=0):
    """Prefill PROMPT rows, then the K=1 decode pattern: windows of 1 (rejection) or 2 (acceptance) rows."""
    gen = torch.Generator(device=ids.device).manual_seed(seed)
    results = [drafter.draft(ids[:, :PROMPT], positions[:, :PROMPT], hidden[:, :PROMPT],
                             temperature=temperature, generator=gen)]
    start = PROMPT
    for rows in windows:
        sl = slice(start, start + rows)
        results.append(drafter.draft(ids[:, sl], positions[:, sl], hidden[:, sl], temperature=temperature,
                                     generator=gen, validate=False))
        start += rows
    return results


WINDOWS = [1, 2, 2, 1, 1, 2, 1, 2, 2, 2]


@torch.no_grad()
def test_compiled_drafter_matches_eager_model():
    model = random_mtp()
    ids, positions, hidden = stream(3, PROMPT + sum(WINDOWS))
    compiled = run_decode(Drafter(model, max_batch_size=MAX_BATCH, max_length=MAX_LENGTH,
                                  num_speculative_tokens=1), ids, positions, hidden, WINDOWS)
    # eager reference: the full-sequence forward's top tokens at each window's last row
    full = model(ids, positions, hidden)
    ends = [PROMPT - 1]
    for rows in WINDOWS:
        ends.append(ends[-1] + rows)
    expected = model.get_top_tokens(full)[:, ends]
    assert torch.equal(torch.stack([r.tokens for r in compiled], 1), expected)
    assert (compiled[-1].hidden - full[:, -1]).abs().max() < 1e-5


@torch.no_grad()
def test_no_recompiles_over_64_decode_steps():
    model = random_mtp()
    windows = [1, 2] * 32
    ids, positions, hidden = stream(2, PROMPT + sum(windows))
    drafter = Drafter(model, max_batch_size=MAX_BATCH, max_length=MAX_LENGTH, batch_buckets=(MAX_BATCH,),
                      num_speculative_tokens=1)
    run_decode(drafter, ids, positions, hidden, windows[:2])  # the prefill, 1-row and 2-row shapes
    with torch._dynamo.config.patch(error_on_recompile=True):
        results = run_decode(drafter, ids, positions, hidden, windows)
    assert len(results) == 65


@torch.no_grad()
def test_batch_sizes_within_a_bucket_share_one_compiled_step():
    model = random_mtp()
    drafter = Drafter(model, max_batch_size=MAX_BATCH, max_length=MAX_LENGTH, batch_buckets=(1, 2, MAX_BATCH),
                      num_speculative_tokens=1)
    ids, positions, hidden = stream(4, PROMPT + 4)

    def step(batch, column):
        col = slice(column, column + 1)
        return drafter.draft(ids[:batch, col], positions[:batch, col], hidden[:batch, col]).tokens

    drafter.draft(ids[:, :PROMPT], positions[:, :PROMPT], hidden[:, :PROMPT])
    step(4, PROMPT)  # compiles the (4 sequences, 1 row) shape
    batches = (4, 3, 3)  # once left out, row 3 stays out (back, it would have skipped a position)
    with torch._dynamo.config.patch(error_on_recompile=True):
        tokens = [step(batch, PROMPT + i) for i, batch in enumerate(batches, start=1)]
    expected = model.get_top_tokens(model(ids, positions, hidden))
    for i, (batch, got) in enumerate(zip(batches, tokens), start=1):
        assert torch.equal(got, expected[:batch, PROMPT + i])


@torch.no_grad()
def test_rows_that_skip_ahead_of_what_was_written_are_refused():
    """The slots between what a sequence's validated calls wrote and its new rows would be read stale (zeros, or an
    earlier sequence's): refused by name. Rewinding (rejected drafts) and starting again at 0 are fine; an unchecked
    call forgets what was written, so the next validated call is not refused for it."""
    drafter = Drafter(random_mtp(), max_batch_size=2, max_length=64, compile=False, num_speculative_tokens=1)
    ids, positions, hidden = stream(2, 24)

    def call(*columns, validate=True):
        index = torch.tensor(columns)
        return drafter.draft(ids[:, index], positions[:, index], hidden[:, index], validate=validate)

    with pytest.raises(ArgumentError, match=r"sequence 0: its rows start at position 3, but this Drafter holds no "):
        call(3, 4)
    call(*range(11))
    with pytest.raises(ArgumentError, match=r"holds positions 0\.\.10 of it: the rows of positions 11\.\.11 are"):
        call(12)
    call(11, 12)
    call(5)  # rewound: 6.. now stale
    with pytest.raises(ArgumentError, match=r"positions 6\.\.6 are missing"):
        call(7)
    call(0, 1)  # a new sequence
    call(20, validate=False)
    call(21)
    first = (ids[:1, :2], positions[:1, :2], hidden[:1, :2])
    drafter.draft(*first, validate=False)  # forgets what sequence 0 holds, not sequence 1
    with pytest.raises(ArgumentError, match=r"sequence 1: its rows start at position 23, but this Drafter holds "
                                            r"positions 0\.\.21"):
        call(23)
    call(22)
    padded = torch.tensor([[23, 24], [-1, 9]])  # row 1 holds 0..22 and goes back to 9; row 0 skips nothing
    drafter.draft(ids[:, :2], padded, hidden[:, :2])
    with pytest.raises(ArgumentError, match=r"sequence 1: its rows start at position 11"):
        drafter.draft(ids[:, :2], torch.tensor([[25, 26], [11, -1]]), hidden[:, :2])


@torch.no_grad()
def test_a_k_depth_drafter_rewinds_one_row_at_most_and_capture_ends_the_sequences():
    """K = 2 re-runs the row before a call's first row from the last two it was given: a call starting two rows
    back re-ran a row it no longer held (wrong drafts, no error). ``capture`` re-runs each bucket's last inputs over
    the state, so a sequence in progress cannot go on after it."""
    model = random_mtp()
    drafter = Drafter(model, max_batch_size=1, max_length=64, compile=False, num_speculative_tokens=2)
    ids, positions, hidden = stream(1, 24)

    def call(*columns):
        index = torch.tensor(columns)
        return drafter.draft(ids[:, index], positions[:, index], hidden[:, index])

    call(*range(11))
    with pytest.raises(ArgumentError, match=r"its rows start at position 8, but a K = 2 drafter re-runs the 1 rows "
                                            r"before a call's first row from the last 2 it was given, which end at "
                                            r"position 10: start at 10 or 11 \(or at 0, a new sequence\)"):
        call(8, 9)
    rewound = call(10, 11)  # one row back: the fresh drafter's drafts
    fresh = Drafter(model, max_batch_size=1, max_length=64, compile=False, num_speculative_tokens=2)
    fresh.draft(ids[:, :12], positions[:, :12], hidden[:, :12])
    assert torch.equal(rewound.drafts, fresh.draft(ids[:, 11:12], positions[:, 11:12], hidden[:, 11:12]).drafts)
    drafter.capture()
    with pytest.raises(ArgumentError, match=r"its rows start at position 12, but this Drafter holds no position"):
        call(12)
    call(0, 1)
    two = Drafter(model, max_batch_size=2, max_length=64, compile=False, num_speculative_tokens=2,
                  batch_buckets=(1, 2))
    two.draft(*stream(2, 6))
    two.capture(batch_sizes=(1,))  # the batch-1 bucket re-ran: sequence 0 starts over, sequence 1 goes on
    ids, positions, hidden = stream(2, 8)
    restart, go_on = torch.tensor([[0], [6]]), torch.tensor([[0], [1]])
    two.draft(ids.gather(1, restart), positions.gather(1, restart), hidden[go_on, restart])


def test_non_finite_inputs_embeds_in_real_rows_are_refused():
    drafter = Drafter(random_mtp(), max_batch_size=2, max_length=64, compile=False, num_speculative_tokens=1)
    ids, positions, hidden = stream(2, 4)
    embeds = torch.zeros_like(hidden)
    embeds[1, 2] = float("nan")
    with pytest.raises(ArgumentError, match=r"inputs_embeds holds a NaN or inf in a real row of sequence 1"):
        drafter.draft(ids, positions, hidden, inputs_embeds=embeds)
    positions = positions.clone()
    positions[1, 2:] = -1  # padding rows may hold anything
    drafter.draft(ids, positions, hidden, inputs_embeds=embeds)
    # not the model's "pass exactly one of input_ids and inputs_embeds", though one was passed
    with pytest.raises(ArgumentError, match=r"input_ids are needed \(also when inputs_embeds is given\)"):
        drafter.draft(None, positions, hidden, inputs_embeds=embeds)


@torch.no_grad()
def test_batch_sizes_share_a_bucket_and_large_batches_fall_back():
    model = random_mtp()
    drafter = Drafter(model, max_batch_size=6, max_length=64, compile=False, batch_buckets=(1, 2, 4),
                      num_speculative_tokens=1)
    assert drafter.bucket(3, 1) == (4, 1) and drafter.bucket(5, 2) == (6, 2) and drafter.bucket(1, 11) == (1, 16)
    for batch in (3, 4, 3, 5):  # 4 then 3 shares one bucket's buffers
        ids, positions, hidden = stream(batch, PROMPT)
        result = drafter.draft(ids, positions, hidden)
        assert torch.equal(result.tokens, model.get_top_tokens(model(ids, positions, hidden))[:, -1])


def rows_at(ids, hidden, layout):
    """The call whose row t of sequence b is that sequence's stream row at ``layout[b][t]`` (-1: a padding row)."""
    positions = torch.tensor(layout)
    index, seq = positions.clamp(min=0), torch.arange(positions.shape[0])[:, None]
    return ids[seq, index], positions, hidden[seq, index]


# one prefill, then ragged two-row windows: right padding, left padding, padding between real rows, no padding
PADDED_CALLS = [
    [list(range(11)), list(range(7)) + [-1] * 4, [-1, -1] + list(range(9))],
    [[11, 12], [7, -1], [-1, 9]],
    [[13, -1], [8, 9], [10, 11]],
    [[14, 15], [-1, 10], [12, -1]],
]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@torch.no_grad()
def test_padding_anywhere_drafts_from_each_sequences_last_real_row(compile):
    """Right-, left- and mixed-padded sequences in one call: each one's draft and hidden equal those of its own
    unpadded calls (the draft comes from the row at its largest position, not from the last column)."""
    model = random_mtp()
    ids, _, hidden = stream(3, 16)
    drafter = Drafter(model, max_batch_size=MAX_BATCH, max_length=MAX_LENGTH, compile=compile,
                      batch_buckets=(MAX_BATCH,), num_speculative_tokens=1)  # 3 sequences, a fourth of padding
    alone = [Drafter(model, max_batch_size=1, max_length=64, compile=False, num_speculative_tokens=1) for _ in range(3)]
    for layout in PADDED_CALLS:
        result = drafter.draft(*rows_at(ids, hidden, layout))
        for b, rows in enumerate(layout):
            real = [p for p in rows if p >= 0]
            want = alone[b].draft(ids[b:b + 1, real], torch.tensor([real]), hidden[b:b + 1, real])
            assert int(result.tokens[b]) == int(want.tokens[0]), (layout, b)
            torch.testing.assert_close(result.hidden[b], want.hidden[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_batch_size=0), "max_batch_size must be an int >= 1, got 0"),
    (dict(max_batch_size=-3), "max_batch_size must be an int >= 1, got -3"),
    (dict(max_batch_size=True), "max_batch_size must be an int >= 1, got True"),
    (dict(max_batch_size=2.0), "max_batch_size must be an int >= 1, got 2.0"),
    (dict(max_length=0), "max_length must be an int >= 1, got 0"),
    (dict(max_length=64.5), "max_length must be an int >= 1, got 64.5"),
    (dict(batch_buckets=(0, 2)), "each of batch_buckets must be an int >= 1, got 0"),
    (dict(batch_buckets=(1, 2.5)), "each of batch_buckets must be an int >= 1, got 2.5"),
    (dict(batch_buckets=()), r"batch_buckets must name at least one batch size, got \(\)"),
    (dict(batch_buckets=4), "batch_buckets must be a tuple of ints >= 1, got 4"),
    (dict(batch_buckets="12"), "batch_buckets must be a tuple of ints >= 1, got '12'"),
    (dict(graph_rows=(0, 1)), "each of graph_rows must be an int >= 1, got 0"),
    (dict(graph_rows=(True,)), "each of graph_rows must be an int >= 1, got True"),
    (dict(compile_options="max-autotune"), "compile_options must be a dict of torch.compile arguments"),
    (dict(compile_options={"bogus": 1}), r"compile_options \['bogus'\] are not torch.compile arguments"),
    (dict(compile_options={"options": 3}), r"compile_options\['options'\] must be a dict of Inductor options"),
    (dict(compile_options={"mode": "fastest"}), r"compile_options\['mode'\] must be one of \['default', .* 'fastest'"),
    (dict(compile_options={"mode": "max-autotune", "options": {"max_autotune": False}}),
     "compile_options: give 'mode' or 'options', not both"),
    (dict(compile_options={"mode": "reduce-overhead"}), r"'reduce-overhead' turns on Inductor's CUDA graphs, which "
     r"break chained depths \(docs/compile.md §8\): use the Drafter's own \(cuda_graphs=True\)"),
    *[(dict(compile_options={"mode": mode}), rf"'{mode}' turns off Inductor's post-grad passes, ours among them")
      for mode, options in list_mode_options().items() if options.get("use_post_grad_passes") is False],  # 'lite'
    (dict(compile_options={"dynamic": "x"}), r"compile_options\['dynamic'\] must be a bool or None, got 'x'"),
    (dict(compile_options={"fullgraph": 1}), r"compile_options\['fullgraph'\] must be a bool, got 1"),
    (dict(compile_options={"backend": "nope"}), r"compile_options\['backend'\] must be a callable or one of \[.*"
     r"'inductor'.*\], got 'nope'"),
    (dict(compile_options={"options": {"max_autotun": True}}), r"compile_options\['options'\] names no Inductor "
     r"option 'max_autotun' \(close: max_autotune"),
    (dict(compile_options={"options": {"freezing": "yes"}}), r"compile_options\['options'\]\['freezing'\] must be "
     r"a bool, got 'yes'"),
    (dict(compile="yes"), "compile must be a bool, got 'yes'"),
    (dict(cuda_graphs=1), "cuda_graphs must be a bool or None, got 1"),
])
def test_drafter_arguments_are_checked(kwargs, match):
    args = {"max_batch_size": 2, "max_length": 64, **kwargs}
    with pytest.raises(ArgumentError, match=match):
        Drafter(random_mtp(), **args, num_speculative_tokens=1)


@pytest.mark.parametrize("size", ["num_speculative_tokens", "max_batch_size", "max_length"])
def test_the_drafters_sizes_are_read_only(size):
    """The cache, the buffers and the compiled round are sized by them: a K set after construction was an IndexError
    inside the loop (smaller) or statistics of K entries that drafted fewer (larger)."""
    drafter = Drafter(random_mtp(), 2, 16, compile=False)
    with pytest.raises(AttributeError, match=f"property '{size}' of 'Drafter' object has no setter"):
        setattr(drafter, size, 1)


def test_drafter_model_must_be_an_inkling_mtp():
    with pytest.raises(ArgumentError, match="model must be an InklingMTP, got Linear"):
        Drafter(torch.nn.Linear(2, 2), 1, 8)


def test_drafter_buckets_are_deduplicated_and_caller_compile_options_win():
    drafter = Drafter(random_mtp(), max_batch_size=6, max_length=64, batch_buckets=(4, 1, 4, 2, 2, 16),
                      graph_rows=(2, 1, 2), compile_options={"dynamic": None, "fullgraph": False},
                      num_speculative_tokens=1)
    assert drafter.batch_buckets == (1, 2, 4, 6) and drafter.graph_rows == (1, 2) and drafter.graph_batch_limit == 16
    assert not drafter.uses_graph(1, 1)  # no CUDA here


def test_a_compile_mode_is_applied_as_its_inductor_options_beside_ours():
    """torch.compile refuses a mode together with options, and the step always has options on CPU (the C++ wrapper):
    the mode was accepted here and then failed the first draft inside torch."""
    drafter = Drafter(random_mtp(), 1, 64, num_speculative_tokens=1,
                      compile_options={"mode": "max-autotune-no-cudagraphs"})
    assert "mode" not in drafter._compile_options
    assert drafter._inductor_options["max_autotune"] and drafter._inductor_options["cpp_wrapper"]
    assert callable(drafter._depth_step)  # torch.compile took the options (it checks them here, compiling nothing)


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch_sizes=(0,)), "each of batch_sizes must be an int >= 1, got 0"),
    (dict(batch_sizes=(1, 3)), r"batch_sizes must be at most the drafter's max_batch_size 2, got \(1, 3\)"),
    (dict(temperature=-1.0), r"temperature must be 0 \(greedy\) or a finite number >= 1e-06 .*got -1.0"),
])
def test_capture_arguments_are_checked(kwargs, match):
    drafter = Drafter(random_mtp(), max_batch_size=2, max_length=64, compile=False, num_speculative_tokens=1)
    with pytest.raises(ArgumentError, match=match):
        drafter.capture(**kwargs)
    assert not drafter._shapes  # refused before anything ran


@pytest.mark.parametrize("batch, rows, match", [(3, 1, r"batch must be an int in \[1, 2\], got 3"),
                                               (0, 1, r"batch must be an int in \[1, 2\], got 0"),
                                               (1, 0, "rows must be an int >= 1, got 0"),
                                               (1.0, 1, r"batch must be an int in \[1, 2\], got 1.0")])
def test_bucket_and_static_step_check_their_sizes(batch, rows, match):
    """A batch past max_batch_size was a static step over buffers larger than the cache (a size-mismatch error from
    inside torch when called); zero or negative sizes were silently the smallest bucket."""
    drafter = Drafter(random_mtp(), max_batch_size=2, max_length=64, compile=False, num_speculative_tokens=1)
    for method in (drafter.bucket, drafter.static_step, drafter.uses_graph):
        with pytest.raises(ArgumentError, match=match):
            method(batch, rows)
    assert not drafter._shapes


def test_capture_static_step_and_save_refuse_a_model_converted_after_construction(tmp_path):
    """capture and static_step met the old cache inside a kernel; save_compiled wrote a package of mixed dtypes."""
    model = random_mtp()
    drafter = Drafter(model, max_batch_size=1, max_length=16, compile=False, num_speculative_tokens=1)
    model.to(torch.bfloat16)
    for call in (drafter.capture, lambda: drafter.static_step(1, 1), lambda: drafter.save_compiled(tmp_path / "p")):
        with pytest.raises(ValueError, match="the model is now torch.bfloat16 on cpu, but this Drafter was built"):
            call()
    assert not (tmp_path / "p").exists()


def test_a_compiled_drafter_refuses_a_model_quantized_after_construction_and_an_eager_one_follows_it():
    """The compiled drafter's options (and on CUDA its captured graphs) were made for the weights before quantize_,
    which swaps the depth linears; the eager drafter runs the model's modules as they are at each call."""
    ids, positions, hidden = stream(1, 2, dtype=torch.bfloat16)
    compiled_model, eager_model = random_mtp(dtype=torch.bfloat16), random_mtp(dtype=torch.bfloat16)
    compiled = Drafter(compiled_model, max_batch_size=1, max_length=16, num_speculative_tokens=1)
    eager = Drafter(eager_model, max_batch_size=1, max_length=16, compile=False, num_speculative_tokens=1)
    compiled_model.quantize_("int8")
    eager_model.quantize_("int8")
    with pytest.raises(ValueError, match="quantization is now int8 head=True, but this Drafter was built for it with "
                                         "none: .* build a new Drafter after quantizing the model"):
        compiled.draft(ids, positions, hidden)
    fresh = Drafter(eager_model, max_batch_size=1, max_length=16, compile=False, num_speculative_tokens=1)
    assert torch.equal(eager.draft(ids, positions, hidden).drafts, fresh.draft(ids, positions, hidden).drafts)


@pytest.mark.parametrize("k", [1, 2])
def test_a_drafter_built_or_used_under_inference_mode_works_outside_it(k):
    """Its cache and buffers stay normal tensors: made under ``torch.inference_mode()`` they refused the in-place
    updates of every later call outside it."""
    model = random_mtp()
    ids, positions, hidden = stream(2, PROMPT + 3)
    calls = [(ids[:, :PROMPT], positions[:, :PROMPT], hidden[:, :PROMPT])] + [
        (ids[:, t:t + 1], positions[:, t:t + 1], hidden[:, t:t + 1]) for t in range(PROMPT, PROMPT + 3)]
    reference = Drafter(model, 2, 32, compile=False, num_speculative_tokens=k)
    expected = [reference.draft(*call, temperature=0.0).drafts for call in calls]
    with torch.inference_mode():
        built_inside = Drafter(model, 2, 32, compile=False, num_speculative_tokens=k)
    used_inside = Drafter(model, 2, 32, compile=False, num_speculative_tokens=k)
    for i, call in enumerate(calls):
        assert torch.equal(built_inside.draft(*call).drafts, expected[i])
        with torch.inference_mode(i % 2 == 0):  # in and out of it, call by call
            drafts = used_inside.draft(*call).drafts
        assert torch.equal(drafts, expected[i]) and not drafts.is_inference()


def test_draft_inputs_that_require_grad_leave_no_history():
    """A hidden straight from a target forward run with grad enabled: the static buffers stay inference state."""
    model = random_mtp()
    drafter = Drafter(model, max_batch_size=1, max_length=64, compile=False, num_speculative_tokens=1)
    ids, positions, hidden = stream(1, PROMPT)
    result = drafter.draft(ids, positions, hidden.requires_grad_() * 1.0)
    for shape in drafter._shapes.values():
        assert all(not t.requires_grad and t.grad_fn is None for t in shape.args())
    assert not result.hidden.requires_grad
    with torch.no_grad():
        assert torch.equal(result.tokens, model.get_top_tokens(model(ids, positions, hidden)[:, -1]))


@torch.no_grad()
def test_an_eager_drafter_with_validate_false_checks_nothing(monkeypatch):
    """validate=False is the whole switch: the eager step calls the model's unvalidated path (no host syncs)."""
    model = random_mtp()
    drafter = Drafter(model, max_batch_size=2, max_length=64, compile=False, num_speculative_tokens=1)
    ids, positions, hidden = stream(2, PROMPT + 1)

    def refuse(*args, **kwargs):
        raise AssertionError("validated although validate=False")

    for name in ("check_inputs", "check_parameters"):
        monkeypatch.setattr(InklingMTP, name, refuse)
    monkeypatch.setattr(Drafter, "check", refuse)
    drafter.draft(ids[:, :PROMPT], positions[:, :PROMPT], hidden[:, :PROMPT], validate=False)
    result = drafter.draft(ids[:, PROMPT:], positions[:, PROMPT:], hidden[:, PROMPT:], validate=False)
    full = model.forward_unchecked(ids, positions, hidden)
    assert torch.equal(result.tokens, model.get_top_tokens(full[:, -1]))


def test_cuda_graph_options_are_checked():
    model = random_mtp()
    with pytest.raises(ArgumentError, match="cuda_graphs=True needs a CUDA model"):
        Drafter(model, 1, 8, cuda_graphs=True, num_speculative_tokens=1)
    assert not Drafter(model, 1, 8, compile=False, num_speculative_tokens=1).cuda_graphs


@torch.no_grad()
def test_sampling_returns_the_muP_correct_distribution():
    model = random_mtp()
    model.lm_head_weight.mul_(300.0)  # random weights give near-uniform logits; make them peaked
    ids, positions, hidden = stream(2, PROMPT)
    drafter = Drafter(model, max_batch_size=2, max_length=64, compile=False, num_speculative_tokens=1)
    temperature, draws = 0.7, 400
    result = drafter.draft(ids, positions, hidden, temperature=temperature, generator=torch.Generator().manual_seed(0))
    logits = model.compute_logits(model(ids, positions, hidden)[:, -1])
    torch.testing.assert_close(result.probs, torch.softmax(logits / temperature, -1))
    # the exponential race samples from probs: every token's frequency is within 4 sigma of its probability
    counts = torch.zeros_like(result.probs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(draws):
        tokens = drafter.draft(ids, positions, hidden, temperature=temperature, generator=gen, validate=False).tokens
        counts[torch.arange(2), tokens] += 1
    p = result.probs
    assert p.max() > 0.2  # the check below is meaningful only for a peaked distribution
    assert ((counts / draws - p).abs() <= 4 * (p * (1 - p) / draws).sqrt() + 1 / draws).all()


class ReplayGraph:
    """A CPU stand-in with a CUDA graph's contract: ``replay()`` re-runs the captured step on the very tensors it was
    captured with (new inputs reach it only through those buffers) and writes into the same output storage (outputs
    handed out earlier are overwritten unless the caller copied them)."""

    def __init__(self, step, args):
        self.step, self.args = step, args
        self.outputs = step(*args)

    def replay(self):
        for static, fresh in zip(self.outputs, self.step(*self.args)):
            static.copy_(fresh)


def emulate_graphs(monkeypatch, drafter):
    """Run ``drafter``'s graph path on CPU: every shape it would capture gets a ReplayGraph instead."""

    def capture(self, shape, step):
        shape.graph = ReplayGraph(step, shape.args())
        shape.outputs = shape.graph.outputs
        shape.graph.replay()
        return shape.outputs

    monkeypatch.setattr(Drafter, "_capture", capture)
    drafter.cuda_graphs = True
    return drafter


@torch.no_grad()
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_graph_path_copies_inputs_in_and_hands_out_outputs_that_stay_valid(monkeypatch, temperature):
    """The drafter's side of the CUDA-graph contract, on CPU: the same tokens, probabilities and hiddens as without
    graphs, and every result still intact after later replays (a missed input copy or output clone fails here)."""
    model = random_mtp()
    model.lm_head_weight.mul_(300.0)  # peaked draft distributions: a wrong sample is visible in the tokens
    ids, positions, hidden = stream(3, PROMPT + sum(WINDOWS))
    graphs = emulate_graphs(monkeypatch, Drafter(model, max_batch_size=4, max_length=64, compile=False,
                                                 num_speculative_tokens=1))
    plain = Drafter(model, max_batch_size=4, max_length=64, compile=False, num_speculative_tokens=1)
    with_graphs = run_decode(graphs, ids, positions, hidden, WINDOWS, temperature)
    without = run_decode(plain, ids, positions, hidden, WINDOWS, temperature)
    replayed = [key for key, shape in graphs._shapes.items() if shape.graph is not None]
    assert {rows for _, rows, _ in replayed} == {1, 2}  # the decode windows ran as graphs, the prefill did not
    for a, b in zip(with_graphs, without):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.hidden, b.hidden)
        assert (a.probs is None) == (temperature == 0) and (a.probs is None or torch.equal(a.probs, b.probs))


@torch.no_grad()
def test_graph_path_falls_back_beyond_the_largest_graph_bucket(monkeypatch):
    model = random_mtp()
    drafter = emulate_graphs(monkeypatch, Drafter(model, max_batch_size=6, max_length=64, compile=False,
                                                  batch_buckets=(1, 2, 4), num_speculative_tokens=1))
    drafter.capture()
    assert {key for key, shape in drafter._shapes.items() if shape.graph is not None} == {
        (batch, rows, False) for batch in (1, 2, 4) for rows in (1, 2)}  # 6 exceeds the largest graph bucket
    ids, positions, hidden = stream(5, PROMPT + 1)
    drafter.draft(ids[:, :PROMPT], positions[:, :PROMPT], hidden[:, :PROMPT])
    result = drafter.draft(ids[:, PROMPT:], positions[:, PROMPT:], hidden[:, PROMPT:])
    assert not drafter.uses_graph(5, 1) and drafter._shapes[(6, 1, False)].graph is None
    assert torch.equal(result.tokens, model.get_top_tokens(model(ids, positions, hidden))[:, -1])


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@torch.no_grad()
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cuda_graph_replay_equals_compiled_step(temperature):
    model = random_mtp(dtype=torch.bfloat16).cuda()
    ids, positions, hidden = stream(3, PROMPT + sum(WINDOWS), device="cuda", dtype=torch.bfloat16)
    graphs = Drafter(model, max_batch_size=4, max_length=64, cuda_graphs=True, num_speculative_tokens=1)
    plain = Drafter(model, max_batch_size=4, max_length=64, cuda_graphs=False, num_speculative_tokens=1)
    with_graphs = run_decode(graphs, ids, positions, hidden, WINDOWS, temperature)
    without = run_decode(plain, ids, positions, hidden, WINDOWS, temperature)
    assert graphs.uses_graph(3, 1) and any(s.graph is not None for s in graphs._shapes.values())
    for a, b in zip(with_graphs, without):
        assert torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.hidden, b.hidden)


@pytest.mark.gpu
@cuda
@torch.no_grad()
def test_cuda_graph_path_falls_back_beyond_the_largest_bucket_on_cuda():
    """Compared with a drafter that never captures: the same compiled step, so the same bits (an eager bf16
    reference could flip a near-tie argmax of the random model)."""
    model = random_mtp(dtype=torch.bfloat16).cuda()
    ids, positions, hidden = stream(5, PROMPT + 1, device="cuda", dtype=torch.bfloat16)
    results = []
    for cuda_graphs in (True, False):
        drafter = Drafter(model, max_batch_size=6, max_length=64, batch_buckets=(1, 2, 4), cuda_graphs=cuda_graphs,
                          num_speculative_tokens=1)
        drafter.draft(ids[:, :PROMPT], positions[:, :PROMPT], hidden[:, :PROMPT])
        results.append(drafter.draft(ids[:, PROMPT:], positions[:, PROMPT:], hidden[:, PROMPT:]))
        assert not drafter.uses_graph(5, 1)
    assert torch.equal(results[0].tokens, results[1].tokens) and torch.equal(results[0].hidden, results[1].hidden)
