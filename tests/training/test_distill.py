"""Self-distillation (``inkling_compiled.training.distill``): the spec's alignment, a loss that falls, an acceptance
that rises, a result directory both libraries load."""

import json
import os
import shutil
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


def test_distill_refuses_a_directory_made_with_other_arguments(quick_distilled, tiny_checkpoint, tmp_path,
                                                                monkeypatch):
    """It was returned as the result of any call naming it: another preset's or other steps' distillation."""
    monkeypatch.setattr(D, "load_hf_target", lambda *args, **kwargs: pytest.fail("the target was loaded"))
    with pytest.raises(ArgumentError, match=rf"holds a distillation made otherwise: steps {QUICK['steps']} \(asked "
                                            rf"{QUICK['steps'] + 1}\); name another directory, or pass force=True"):
        D.distill(tiny_checkpoint, quick_distilled, progress=False, **{**QUICK, "steps": QUICK["steps"] + 1})
    other = shutil.copytree(tiny_checkpoint, tmp_path / "other-source")
    with pytest.raises(ArgumentError, match=r"made otherwise: the source .*other-source"):
        D.distill(other, quick_distilled, progress=False, **QUICK)


def test_distill_command_line_refuses_an_out_made_with_other_arguments(quick_distilled, capsys, monkeypatch):
    monkeypatch.setattr(D, "load_hf_target", lambda *args, **kwargs: pytest.fail("the target was loaded"))
    line = _cli_error([*QUICK_ARGV, "--out", str(quick_distilled)], capsys)
    assert f"--out {str(quick_distilled)!r} holds a distillation made otherwise: " in line
    assert f"--steps {QUICK['steps']} (asked 2)" in line and line.endswith("or pass --force to replace it")


@pytest.mark.parametrize("text, problem", [("{not json", "no JSON"), ("{}", "it lacks source, params"),
                                           ("[]", "a JSON list, not an object"), ('{"params": 3}', "it lacks source")])
def test_distill_command_line_names_a_damaged_distill_json(tmp_path, capsys, monkeypatch, text, problem):
    """It was a JSONDecodeError or KeyError traceback."""
    monkeypatch.setattr(D, "load_hf_target", lambda *args, **kwargs: pytest.fail("the target was loaded"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / D.METRICS_FILE).write_text(text)
    line = _cli_error([*QUICK_ARGV, "--out", str(tmp_path / "out")], capsys)
    assert f"{tmp_path / 'out' / D.METRICS_FILE}: not a distill.json" in line and problem in line


def test_only_the_tensor_shards_are_linked(quick_distilled, tiny_checkpoint):
    """config.json and the index were hard links too: editing the distilled config.json in place edited the
    source checkpoint's."""
    for name in os.listdir(tiny_checkpoint):
        if not name.endswith(".safetensors"):
            assert not os.path.samefile(quick_distilled / name, tiny_checkpoint / name), name
    assert {"config.json", "model.safetensors.index.json"} <= set(os.listdir(tiny_checkpoint))


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
    (dict(seed=2**64), r"seed must be in \[-2\*\*63, 2\*\*64\), got 18446744073709551616"),  # torch's overflow
    (dict(seed=-(2**63) - 1), r"seed must be in \[-2\*\*63, 2\*\*64\)"),
    (dict(prompt_len=32), r"prompt_len must be < seq_len \(32\).*got 32"),  # was refused after the target loaded
    (dict(prompt_len=40), r"prompt_len must be < seq_len \(32\).*got 40"),
    (dict(soft=1), "soft must be a bool, got 1"),
])
def test_distill_arguments_are_checked_before_anything_runs(tiny_checkpoint, tmp_path, monkeypatch, overrides,
                                                            match):
    monkeypatch.setattr(D, "load_hf_target", lambda *args, **kwargs: pytest.fail("the target was loaded"))
    with pytest.raises(ArgumentError, match=match):
        D.distill(tiny_checkpoint, tmp_path / "out", progress=False, **{**QUICK, **overrides})
    assert not (tmp_path / "out").exists()


def test_an_out_dir_a_forced_run_would_wrongly_delete_is_refused(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(D, "load_hf_target", lambda *args, **kwargs: pytest.fail("the target was loaded"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("not ours")
    for out, match in ((tmp_path / "other", r"holds files but no distill\.json"),
                       (tiny_checkpoint, "holds the checkpoint distilled"),
                       (tiny_checkpoint.parent, "holds the checkpoint distilled"),
                       ("", "out_dir must name a path, got ''")):
        with pytest.raises(ArgumentError, match=match):
            D.distill(tiny_checkpoint, out, force=True, progress=False, **QUICK)
    assert (tmp_path / "other" / "keep.txt").read_text() == "not ours" and tiny_checkpoint.is_dir()


def test_the_top_seed_trains_as_torch_wraps_it(tiny_checkpoint):
    """The batch sampler's seed is seed + 1: at 2**64 - 1, a seed torch takes, that overflowed; wrapped modulo 2**64
    as torch wraps seeds, 2**64 - 1 and -1 sample the same batches."""
    tokens = torch.randint(3, 100, (4, 10), generator=torch.Generator().manual_seed(0))

    def losses(seed: int) -> list[float]:
        mtp = InklingMTP.from_pretrained(tiny_checkpoint)
        data = D.GreedyData(tokens, torch.randn(4, 10, mtp.config.hidden_size, generator=torch.Generator()
                                                .manual_seed(1)), prompt_len=2)
        return D.train(mtp, data, steps=2, batch=2, lr=1e-3, seed=seed)

    assert losses(2**64 - 1) == losses(-1)


@pytest.fixture
def cli_paths(tmp_path):
    """The paths the command-line cases name: a file, an empty directory, a directory of other files, a directory
    whose config.json is no Inkling config."""
    (tmp_path / "a-file").write_text("")
    for name in ("empty", "other", "bad-config"):
        (tmp_path / name).mkdir()
    (tmp_path / "other" / "notes.txt").write_text("")
    (tmp_path / "bad-config" / "config.json").write_text('{"model_type": 3}')
    return tmp_path


QUICK_ARGV = ["--steps", "2", "--num-sequences", "4", "--eval-sequences", "2", "--batch", "2", "--seq-len", "12"]


def _cli_error(argv, capsys) -> str:
    """The one stderr line of a distill command line that exits with status 2 (its progress lines aside)."""
    try:
        code = D.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[distill] ")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"{D.PROG}: error: "), err
    return lines[0]


@pytest.mark.parametrize("argv, message", [
    (["--eval-sequences", "0"], "--eval-sequences must be an int >= 1, got 0"),
    (["--threads", "-1"], "argument --threads: must be an int >= 1, got '-1'"),
    (["--threads", str(10**20)], "argument --threads: must be an int in [1, 1024]"),  # torch's OverflowError
    (["--config", "bogus"], "argument --config: invalid choice: 'bogus'"),  # was a ValueError traceback
    (["--config", ""], "argument --config: invalid choice: ''"),
    (["--checkpoint", "{tmp}/nowhere"], "--checkpoint '{tmp}/nowhere': no such directory"),  # transformers' OSErrors
    (["--checkpoint", "{tmp}/a-file"], "--checkpoint '{tmp}/a-file' is not a directory"),
    (["--checkpoint", "{tmp}/empty"], "--checkpoint '{tmp}/empty' holds no config.json"),
    (["--checkpoint", ""], "--checkpoint must name a path, got ''"),
    (["--checkpoint", "{tmp}/bad-config"], "{tmp}/bad-config/config.json: model_type 3 is not an Inkling config"),
    (["--out", "{tmp}/a-file"], "argument --out: '{tmp}/a-file' is not a directory"),  # was NotADirectoryError
    (["--out", "{tmp}/a-file/sub"], "argument --out: '{tmp}/a-file/sub' cannot be a directory: '{tmp}/a-file' is "
                                    "not one"),
    pytest.param(["--out", "/proc/nope"], "argument --out: '/proc/nope' is not writable",  # FileNotFoundError
                 marks=pytest.mark.skipif(not os.path.isdir("/proc"), reason="no /proc")),
    (["--out", ""], "argument --out: must name a path, got ''"),
    (["--out", "{tmp}/other"], "--out '{tmp}/other' holds files but no distill.json"),  # --force deleted it
    (["--prompt-len", "12"], "--prompt-len must be < --seq-len (12), the length each prompt is continued to, got 12"),
    (["--prompt-len", "20"], "--prompt-len must be < --seq-len (12), the length each prompt is continued to, got 20"),
    (["--seed", "99999999999999999999999"], "--seed must be in [-2**63, 2**64), got 99999999999999999999999"),
    (["--seed", "-9223372036854775809"], "--seed must be in [-2**63, 2**64), got -9223372036854775809")])
def test_distill_command_line_names_a_bad_option(cli_paths, capsys, monkeypatch, argv, message):
    """One line, exit status 2, naming the option and the value, before the target is loaded."""
    monkeypatch.setattr(D, "load_hf_target", lambda *args, **kwargs: pytest.fail("the target was loaded"))
    argv = [*QUICK_ARGV, *(arg.format(tmp=cli_paths) for arg in argv)]
    assert message.format(tmp=cli_paths) in _cli_error(argv, capsys)


def test_distill_command_line_reports_a_damaged_shard_in_one_line(tiny_checkpoint, tmp_path, capsys):
    """A truncated target shard passes the library's checks (config, index, MTP headers): safetensors' error as
    transformers loads the target was a traceback."""
    damaged = shutil.copytree(tiny_checkpoint, tmp_path / "damaged")
    sorted(damaged.glob("model-*.safetensors"))[0].write_bytes(b"\x08")
    line = _cli_error([*QUICK_ARGV, "--checkpoint", str(damaged), "--out", str(tmp_path / "out")], capsys)
    assert "deserializing header" in line and not (tmp_path / "out").exists()


def test_distill_command_line_reports_a_target_config_field_in_one_line(tiny_checkpoint, tmp_path, capsys):
    """A field only the target reads (more experts per token than experts) was transformers' RuntimeError from the
    first forward."""
    edited = shutil.copytree(tiny_checkpoint, tmp_path / "edited")
    config = json.loads((edited / "config.json").read_text())
    config["text_config"]["num_experts_per_tok"] = 9
    (edited / "config.json").write_text(json.dumps(config))
    line = _cli_error([*QUICK_ARGV, "--checkpoint", str(edited), "--out", str(tmp_path / "out")], capsys)
    assert f"{edited / 'config.json'}: transformers cannot build the target from it: " in line
    assert "num_experts_per_tok must be an int in [1, 4], got 9" in line and not (tmp_path / "out").exists()
