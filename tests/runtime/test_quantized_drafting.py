"""Drafting with int8 weight-only depths and head (``from_pretrained(..., quantize="int8")``): accuracy against bf16
drafts on a self-distilled tiny checkpoint, lossless speculative generation with the compiled drafter, the fast
path's Inductor options kept inside our own compile, and (gpu marker) CUDA graphs."""

import pytest
import torch
from torch import nn

from inkling_compiled import InklingMTP
from inkling_compiled.model import torchao_schemes
from inkling_compiled.model.int8 import Int8Linear
from inkling_compiled.runtime import Drafter, speculative_generate
from inkling_compiled.runtime.drafter import FAST_PATH_OFF
from inkling_compiled.testing.synthetic import cached_checkpoint, load_hf_target
from inkling_compiled.training.distill import distill, greedy_data
from tests.helpers import random_mtp, tiny_text_config

BF16 = torch.bfloat16
NO_FAST_PATH = {"options": FAST_PATH_OFF["cpu"]}  # default Inductor options


@pytest.fixture(scope="module")
def distilled():
    # The arguments of tests/runtime/test_lossless_compiled.py: one cached distillation for both.
    return distill(cached_checkpoint("tiny"), steps=120, num_sequences=256, eval_sequences=16, progress=False)


@pytest.fixture(scope="module")
def target(distilled):
    target = load_hf_target(distilled)
    target.generation_config.eos_token_id = None  # compare full-length continuations
    return target


def _chained_logits(mtp: InklingMTP, tokens: torch.Tensor, hidden: torch.Tensor) -> list[torch.Tensor]:
    """Every depth over every row of the sequences (stateless), each depth fed the previous one's output."""
    batch, seq = tokens.shape
    logits, previous = [], hidden.to(mtp.dtype)
    for k in range(mtp.config.num_depths):
        rows = seq - 2 - k  # depth k, row t: (g^{k-1}_t, x_{t+k+1}) -> x_{t+k+2}
        positions = torch.arange(rows)[None].expand(batch, rows)
        previous = mtp(tokens[:, k + 1:k + 1 + rows], positions, previous[:, :rows], depth=k)
        logits.append(mtp.compute_logits(previous).float())
    return logits


@torch.no_grad()
def test_int8_drafts_agree_with_bf16_drafts(distilled, target):
    """Measured (torch 2.13 CPU): top-1 agreement with bf16 drafts 0.970 / 0.962 (depth 0 / 1, depths + head) and
    0.975 / 0.963 (depths only), torchao's int8 depths + our head 0.971 / 0.966; max logit error 0.18-0.20 on
    logits up to 9.0; bf16 itself agrees with fp32 on 0.983. Accuracy against the target's greedy tokens moves by
    < 0.005. Bounds below leave margin."""
    data = greedy_data(target, num_sequences=64, seq_len=40, prompt_len=8, seed=1234)
    reference = _chained_logits(InklingMTP.from_pretrained(distilled, dtype=BF16), data.tokens, data.hidden)
    torchao_int8 = torchao_schemes.import_quantization().Int8WeightOnlyConfig()
    for scheme, head in (("int8", True), ("int8", False), (torchao_int8, True)):
        quantized = InklingMTP.from_pretrained(distilled, quantize=scheme, quantize_head=head)
        for k, (got, want) in enumerate(zip(_chained_logits(quantized, data.tokens, data.hidden), reference)):
            drafts, expected = got.argmax(-1), want.argmax(-1)
            labels = data.tokens[:, k + 2:]
            assert drafts.numel() >= 2000
            assert (drafts == expected).float().mean() >= 0.93, (head, k)
            assert (got - want).abs().max() <= 0.35, (head, k)
            accuracy = [(d == labels).float().mean() for d in (drafts, expected)]
            assert abs(accuracy[0] - accuracy[1]) <= 0.02, (head, k)


@pytest.mark.parametrize("scheme, k, compile", [pytest.param("int8", 1, True, marks=pytest.mark.slow),
                                                ("int8", 2, False),
                                                pytest.param("torchao", 1, True, marks=pytest.mark.slow)])
def test_speculative_generation_with_an_int8_drafter_is_lossless(distilled, target, scheme, k, compile):
    """Quantization changes drafts only: the int8 drafter's generation equals the fp32 target's greedy one, compiled
    at K = 1 (two-token prompts make the prefill the 2-row decode shape: two compiled graphs in all) and with both
    depths chained (K = 2, eager: the compiled K-depth round is tested in test_drafter_depths.py); and so with
    torchao's int8 depth linears (a tensor subclass through Dynamo, our passes and Inductor)."""
    if scheme == "torchao":
        scheme = torchao_schemes.import_quantization().Int8WeightOnlyConfig()
    mtp = InklingMTP.from_pretrained(distilled, quantize=scheme)
    drafter = Drafter(mtp, max_batch_size=1, max_length=64, compile=compile, num_speculative_tokens=k,
                      compile_options=NO_FAST_PATH if compile else None)
    accepted = drafted = 0
    for seed in range(8):
        ids = torch.randint(8, 500, (1, 2), generator=torch.Generator().manual_seed(seed))
        ours = speculative_generate(target, drafter, ids, torch.ones_like(ids), max_new_tokens=16)
        expected = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16)
        assert torch.equal(ours.sequences, expected), seed
        accepted, drafted = accepted + ours.num_accepted, drafted + ours.num_drafted
    assert 0.1 * drafted < accepted < drafted  # both the accept and the reject paths ran


def _config_snapshot() -> tuple[dict, dict]:
    return torch._inductor.config.get_config_copy(), torch._dynamo.config.get_config_copy()


@pytest.mark.slow
@torch.no_grad()
def test_fast_path_options_stay_inside_our_compile(distilled):
    """Freezing + max-autotune (the quantized drafter's CPU default) change nothing for a model compiled after."""
    before = _config_snapshot()
    mtp = InklingMTP.from_pretrained(distilled, quantize="int8")
    drafter = Drafter(mtp, max_batch_size=1, max_length=32, graph_rows=(1,), num_speculative_tokens=1)
    ids, positions = torch.tensor([[17]]), torch.tensor([[0]])
    hidden = torch.randn(1, 1, mtp.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(BF16)
    result = drafter.draft(ids, positions, hidden)
    eager = mtp(ids, positions, hidden, cache=mtp.new_cache(1, 32))[:, -1]
    assert (result.hidden.float() - eager.float()).abs().max() <= 0.02 * eager.float().abs().max()
    logits = mtp.compute_logits(eager)[0].float()
    assert logits[result.tokens[0]] >= logits.max() - 0.1  # the eager top token, or a near-tie of it
    assert _config_snapshot() == before

    unrelated = nn.Linear(8, 8).requires_grad_(False)
    compiled = torch.compile(unrelated)
    x = torch.randn(2, 8)
    compiled(x)
    unrelated.weight.mul_(2)  # not frozen: the compiled module reads the weight it has now
    torch.testing.assert_close(compiled(x), unrelated(x))
    assert _config_snapshot() == before


@pytest.mark.slow
@torch.no_grad()
def test_frozen_weights_of_one_depth_never_serve_another():
    """With freezing (the fast path) a depth's weights are compiled into its step's code, so two depths of one
    geometry cannot share a step as they do without it: each compiles its own (a regression: depth 1 once ran with
    depth 0's frozen weights, drafting wrong tokens without an error). Freezing alone, float32, without autotuning:
    the mechanism, at a fraction of the compile time."""
    model = random_mtp(tiny_text_config(num_mtp_layers=2, mtp_local_layer_ids=[0, 1]))  # one geometry
    model.lm_head_weight.mul_(30.0)  # peaked logits: a draft from the wrong weights is not a near-tie
    frozen = {"options": {"freezing": True, "max_autotune": False}}
    compiled = Drafter(model, 1, 64, num_speculative_tokens=2, compile_options=frozen)
    eager = Drafter(model, 1, 64, compile=False, num_speculative_tokens=2)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.logits_vocab_size, (1, 40), generator=gen)
    hidden = torch.randn(1, 39, model.config.hidden_size, generator=gen)
    # three verified rows a round (both drafts accepted): one window width, so three compiles (the prologue and one
    # step per depth); the other width compiles the same way
    for i, start in enumerate(range(0, 36, 3)):
        window = slice(start, start + 3)
        args = tokens[:, window.start + 1:window.stop + 1], torch.arange(start, start + 3)[None], hidden[:, window]
        got, want = compiled.draft(*args), eager.draft(*args)
        assert torch.equal(got.drafts, want.drafts), i


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.no_grad()
def test_int8_step_on_cuda_never_casts_a_whole_weight():
    """The compiled CUDA step reads the int8 weights as they are: no bf16 buffer shaped like a weight."""
    import re

    from bench.step import generated_code

    mtp = InklingMTP.from_pretrained(cached_checkpoint("tiny"), quantize="int8", device="cuda")
    drafter = Drafter(mtp, max_batch_size=1, max_length=32, graph_rows=(1,), cuda_graphs=False,
                      num_speculative_tokens=1)
    hidden = torch.randn(1, 1, mtp.config.hidden_size, device="cuda", dtype=BF16)
    with generated_code() as code:
        drafter.draft(torch.tensor([[17]], device="cuda"), torch.tensor([[5]], device="cuda"), hidden)
    shapes = {tuple(m.weight.shape) for m in mtp.modules() if isinstance(m, Int8Linear)}
    found = re.findall(r"empty_strided_cuda\(\((\d+), (\d+)\), \(\d+, \d+\), torch\.bfloat16\)", "\n".join(code))
    assert code and not [s for s in found if tuple(map(int, s)) in shapes]


def _float8_gemms() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.no_grad()
@pytest.mark.parametrize("scheme, tolerance", [
    ("int8", 0.05),
    ("Int8WeightOnlyConfig", 0.05),
    pytest.param("Float8DynamicActivationFloat8WeightConfig", 0.1,
                 marks=pytest.mark.skipif(not _float8_gemms(), reason="float8 GEMMs need sm89+")),
])
def test_quantized_drafter_with_cuda_graphs_matches_its_compiled_step(scheme, tolerance):
    """CUDA, ours and torchao's schemes (the H200's float8 GEMM among them): the fast path (coordinate-descent
    tuning) under CUDA graphs drafts what the same compiled step drafts without graphs, and the hidden state stays
    near the bf16 model's (float8 also rounds the activations)."""
    if scheme != "int8":
        scheme = getattr(torchao_schemes.import_quantization(), scheme)()
    reference = InklingMTP.from_pretrained(cached_checkpoint("tiny"), dtype=BF16, device="cuda")
    mtp = InklingMTP.from_pretrained(cached_checkpoint("tiny"), quantize=scheme, device="cuda")
    graphs = Drafter(mtp, max_batch_size=2, max_length=64, batch_buckets=(2,), num_speculative_tokens=1)
    plain = Drafter(mtp, max_batch_size=2, max_length=64, batch_buckets=(2,), cuda_graphs=False,
                    num_speculative_tokens=1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(8, 500, (2, 6), generator=gen).cuda()
    hidden = torch.randn(2, 6, mtp.config.hidden_size, generator=gen).to(device="cuda", dtype=BF16)
    positions = torch.arange(6, device="cuda")[None].expand(2, 6).contiguous()
    # the two decode shapes only; the second drafter's compiles are FX graph cache hits of the first's
    for start, rows in ((0, 2), (2, 1), (3, 2), (5, 1)):
        window = slice(start, start + rows)
        a = graphs.draft(ids[:, window], positions[:, window], hidden[:, window])
        b = plain.draft(ids[:, window], positions[:, window], hidden[:, window])
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.hidden, b.hidden)
    assert graphs.uses_graph(2, 1) and graphs._shapes[(2, 1, False)].graph is not None
    want = reference(ids, positions, hidden, cache=reference.new_cache(2, 64))[:, -1].float()
    assert (a.hidden.float() - want).abs().max() <= tolerance * want.abs().max()
