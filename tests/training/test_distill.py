"""Self-distillation (``inkling_compiled.training.distill``): the spec's alignment, a loss that falls, an acceptance
that rises, a result directory both libraries load."""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from inkling_compiled import InklingMTP
from inkling_compiled.arguments import ArgumentError
from inkling_compiled.training import distill as D
from tests.helpers import QUICK_DISTILL as QUICK
from tests.helpers import both_libraries

# ------------------------------------------------------------------------------------------------ alignment

class CountingStub:
    """Stands in for InklingMTP: depth output = one-hot of (its token + 1), so on a counting sequence
    (x_{t+1} = x_t + 1) it predicts x_{t+k+2} from x_{t+k+1} exactly iff the rows are aligned as in the spec."""

    def __init__(self, depths, vocab):
        self.config = SimpleNamespace(num_depths=depths)
        self.dtype = torch.float32
        self.vocab = vocab
        self.calls = []

    def __call__(self, ids, positions, previous, depth):
        self.calls.append((depth, ids, positions, previous))
        return F.one_hot((ids + 1) % self.vocab, self.vocab).float()

    def compute_logits(self, hidden):
        return 10 * hidden


def test_depth_k_reads_token_t_plus_k_plus_1_and_predicts_t_plus_k_plus_2():
    vocab, seq = 50, 12
    tokens = (torch.arange(seq)[None] + torch.tensor([[3], [17]])) % vocab
    hidden = torch.randn(2, seq, vocab)
    stub = CountingStub(3, vocab)
    _, losses, accs = D.mtp_loss(stub, tokens, hidden, prompt_len=4)
    assert accs == [1.0, 1.0, 1.0]
    for depth, ids, positions, _previous in stub.calls:
        n = D.depth_rows(seq, depth)
        assert torch.equal(ids, tokens[:, depth + 1:depth + 1 + n])
        assert torch.equal(positions[0], torch.arange(n))
    assert torch.equal(stub.calls[0][3], hidden[:, :D.depth_rows(seq, 0)])  # depth 0 reads the target hidden h_t
    depth0_out = F.one_hot(stub.calls[0][1] + 1, vocab).float()
    assert torch.equal(stub.calls[1][3], depth0_out[:, :D.depth_rows(seq, 1)])  # depth 1 reads g^0_t


def test_rows_with_labels_inside_the_random_prompt_are_ignored():
    vocab, seq = 50, 12
    tokens = torch.arange(seq)[None] % vocab
    tokens[0, :5] = 0  # a "random" prompt: rows whose label index is < 6 are mispredicted but must not count
    stub = CountingStub(1, vocab)
    _, _, accs = D.mtp_loss(stub, tokens, torch.randn(1, seq, vocab), prompt_len=6)
    assert accs == [1.0]


# ------------------------------------------------------------------------------------------------ training

def test_distillation_lowers_the_loss_and_raises_acceptance(quick_distilled):
    m = D.load_metrics(quick_distilled)
    history = m["loss_history"]
    assert len(history) == QUICK["steps"]
    assert sum(history[-5:]) / 5 < 0.7 * sum(history[:5]) / 5
    before, after = m["agreement_before"], m["agreement_after"]
    assert before[0] < 0.05  # random MTP weights: (almost) nothing accepted
    assert after[0] > before[0] + 0.05, (before, after)


def test_distilled_directory_loads_in_both_libraries(quick_distilled, tiny_checkpoint):
    ours_src = InklingMTP.from_pretrained(tiny_checkpoint)
    models = both_libraries(quick_distilled)
    # the MTP changed, the target's tensors did not (shards are links / copies of the source's)
    trained = dict(models.mtp.named_parameters())
    assert not torch.equal(trained["layers.0.input_proj.weight"], ours_src.layers[0].input_proj.weight)
    assert torch.equal(trained["lm_head_weight"], ours_src.lm_head_weight)
    for name in os.listdir(tiny_checkpoint):
        if name.startswith("model-"):
            assert (quick_distilled / name).read_bytes() == (tiny_checkpoint / name).read_bytes()
    # transformers reads the trained depths: same depth-0 output as ours on raw embedding rows (within the window)
    c = models.config
    seq = c.depths[0].window or 16
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.logits_vocab_size, (1, seq), generator=gen)
    hidden = torch.randn(1, seq, c.hidden_size, generator=gen)
    positions = torch.arange(seq)[None]
    raw = models.target.get_input_embeddings().weight[ids]
    with torch.no_grad():
        expected = models.hf_mtp.forward_layer(0, hidden, positions, None, inputs_embeds=raw)
        got = models.mtp(None, positions, hidden, depth=0, inputs_embeds=raw)
    assert (got - expected).abs().max().item() <= 1e-5


def test_distill_reuses_a_finished_directory(quick_distilled, tiny_checkpoint):
    stamp = (quick_distilled / D.METRICS_FILE).stat().st_mtime_ns
    assert D.distill(tiny_checkpoint, quick_distilled, progress=False, **QUICK) == quick_distilled
    assert (quick_distilled / D.METRICS_FILE).stat().st_mtime_ns == stamp


def test_default_out_dir_is_keyed_by_the_arguments(tiny_checkpoint):
    a = D.default_out_dir(tiny_checkpoint, **QUICK)
    assert a == D.default_out_dir(tiny_checkpoint, **QUICK)
    assert a != D.default_out_dir(tiny_checkpoint, **{**QUICK, "steps": QUICK["steps"] + 1})
    assert a != D.default_out_dir(tiny_checkpoint, **{**QUICK, "seed": 1})


@pytest.mark.parametrize("overrides, match", [
    (dict(steps=-1), "steps must be an int >= 1, got -1"),  # was an undistilled copy written as distilled
    (dict(batch=0), "batch must be an int >= 1, got 0"),
    (dict(eval_sequences=0), "eval_sequences must be an int >= 1, got 0"),
    (dict(lr=float("nan")), "lr must be a finite number > 0, got nan"),
    (dict(seed=1.5), "seed must be an int, got 1.5"),
    (dict(soft=1), "soft must be a bool, got 1"),
])
def test_distill_arguments_are_checked_before_anything_runs(tiny_checkpoint, tmp_path, monkeypatch, overrides,
                                                            match):
    monkeypatch.setattr(D, "load_hf_target", lambda *args, **kwargs: pytest.fail("the target was loaded"))
    with pytest.raises(ArgumentError, match=match):
        D.distill(tiny_checkpoint, tmp_path / "out", progress=False, **{**QUICK, **overrides})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [(["--eval-sequences", "0"], "--eval-sequences must be an int >= 1, got 0"),
                                           (["--threads", "-1"], "argument --threads: must be an int >= 1, got '-1'")])
def test_distill_command_line_names_a_bad_option(capsys, argv, message):
    with pytest.raises(SystemExit):
        D.main(argv)
    assert message in capsys.readouterr().err
