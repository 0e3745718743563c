"""The text-trained target (``inkling_compiled.training.text_target``) on its reduced recipe (seconds): the corpus
and byte vocabulary, a checkpoint both libraries load with the trained weights, a reproducible build, lossless
speculative decoding on held-out prompts, and the generate CLI printing text."""

import argparse
import hashlib
import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from inkling_compiled import InklingMTP
from inkling_compiled.arguments import ArgumentError
from inkling_compiled.runtime import Drafter, speculative_generate
from inkling_compiled.testing.synthetic import load_hf_mtp, load_hf_target, raw_text_tensors, write_checkpoint
from inkling_compiled.training import distill as D
from inkling_compiled.training import text_target as T

# the same thread count for every build: CPU results can depend on it


@pytest.fixture(scope="module")
def corpus():
    return T.load_corpus()


@pytest.fixture(scope="module")
def built(tmp_path_factory, corpus):
    return T.build(T.REDUCED, root=tmp_path_factory.mktemp("text-a"), corpus=corpus, progress=False)


def weights_hash(path) -> str:
    """sha256 over every tensor (name, dtype, bytes) of every safetensors file in ``path``."""
    h = hashlib.sha256()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name)
                h.update(f"{file.name}/{name}/{t.dtype}".encode())
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------------- corpus

def test_corpus_reads_the_listed_modules_from_the_stdlib(corpus):
    assert list(corpus.train) == list(T.TRAIN_MODULES) and list(corpus.heldout) == list(T.HELDOUT_MODULES)
    assert corpus.train["json.decoder"] == (T.stdlib_dir() / "json" / "decoder.py").read_bytes()
    assert corpus.train["collections"] == (T.stdlib_dir() / "collections" / "__init__.py").read_bytes()
    stream = corpus.stream("heldout")
    assert int((stream == T.BOS_ID).sum()) == int((stream == T.EOS_ID).sum()) == len(T.HELDOUT_MODULES)
    assert len(stream) == sum(len(v) + 2 for v in corpus.heldout.values())


def test_corpus_digest_follows_the_content(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.py").write_text(f"x = '{name}'\n")
    one = T.load_corpus(tmp_path, train=("a",), heldout=("b",))
    assert one.digest == T.load_corpus(tmp_path, train=("a",), heldout=("b",)).digest
    (tmp_path / "b.py").write_text("x = 'changed'\n")
    assert T.load_corpus(tmp_path, train=("a",), heldout=("b",)).digest != one.digest
    assert T.load_corpus(tmp_path, train=("b",), heldout=("a",)).digest != one.digest


def test_corpus_errors_name_the_problem(tmp_path):
    (tmp_path / "a.py").write_text("pass\n")
    with pytest.raises(FileNotFoundError, match="'missing'"):
        T.load_corpus(tmp_path, train=("a", "missing"), heldout=())
    with pytest.raises(ValueError, match=r"both in train and held-out: \['a'\]"):
        T.load_corpus(tmp_path, train=("a",), heldout=("a",))


def test_bytes_round_trip_and_specials_are_named():
    text = "def f(x):\n    return 'é'\n"
    assert T.decode(T.encode(text)) == text
    ids = [T.PAD_ID, T.BOS_ID, *T.encode("ok").tolist(), T.EOS_ID, 0xFF]
    assert T.decode(torch.tensor(ids)) == "<bos>ok<eos>\ufffd"


def test_prompt_windows_start_at_line_starts_inside_one_file():
    lines = "".join(f"L{'x' * (i % 7)}\n" for i in range(40))  # every line starts with the only "L"s
    corpus = T.Corpus({"a": lines.encode(), "b": lines.encode()}, {})
    stream = corpus.stream("train")
    windows = T.line_start_windows(stream, 64, 6, seed=3)
    assert windows.shape == (64, 6)
    assert (windows[:, 0] == ord("L")).all()
    assert int(windows.max()) < T.BYTES  # no window runs over the EOS / BOS between the two files
    assert torch.equal(windows, T.line_start_windows(stream, 64, 6, seed=3))
    assert not torch.equal(windows, T.line_start_windows(stream, 64, 6, seed=4))
    with pytest.raises(ArgumentError, match="windows of 6 bytes"):
        T.line_start_windows(stream[:100], 64, 6, seed=3)


# --------------------------------------------------------------------------------------------------------- config

def test_config_has_the_byte_vocab_and_inklings_mtp_pattern():
    config = T.text_config(T.RECIPE)
    text = config["text_config"]
    assert text["unpadded_vocab_size"] == T.LOGITS_VOCAB <= text["vocab_size"] == T.VOCAB
    assert text["vocab_size"] % 64 == 0
    ids = [config[k] for k in ("image_token_id", "image_bos_token_id", "audio_bos_token_id", "audio_token_id")]
    ids += [text["bos_token_id"], text["eos_token_id"], text["pad_token_id"]]
    assert sorted(ids) == list(range(T.BYTES, T.LOGITS_VOCAB))  # every special above the bytes, all distinct
    assert config["mtp_config"]["num_nextn_predict_layers"] == 8
    assert config["mtp_config"]["local_layer_ids"] == [0, 2, 4, 5, 6, 7]
    assert set(text["mlp_layer_types"]) == {"dense"}


def test_config_rejects_sizes_it_cannot_build():
    import dataclasses

    with pytest.raises(ArgumentError, match="not a multiple of head_dim"):
        T.text_config(dataclasses.replace(T.RECIPE, hidden_size=80, head_dim=32))
    with pytest.raises(ArgumentError, match="num_layers 4 < 8"):
        T.text_config(dataclasses.replace(T.RECIPE, num_layers=4))


# -------------------------------------------------------------------------------------------- real-text agreement

class OneHotNext:
    """Target and MTP stand-in: both output one-hot(token + 1), so the MTP agrees with the target exactly when depth
    k at row t reads token x_{t+k+1} and is compared with the target's choice after that same token."""

    def __init__(self, depths, vocab):
        self.config = SimpleNamespace(num_depths=depths)
        self.dtype = torch.float32
        self.vocab = vocab
        self.model = self._target_model

    def _target_model(self, input_ids, attention_mask):
        return SimpleNamespace(last_hidden_state=self(input_ids, None, None, None))

    def __call__(self, ids, positions, previous, depth):
        return F.one_hot((ids + 1) % self.vocab, self.vocab).float()

    def compute_logits(self, hidden):
        return 10 * hidden


def test_text_agreement_compares_each_depth_with_the_targets_choice_after_its_token():
    stub = OneHotNext(3, 11)
    windows = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(0))
    assert T.text_agreement(stub, stub, windows) == [1.0, 1.0, 1.0]
    shifted = OneHotNext(3, 11)
    shifted.model = lambda input_ids, attention_mask: stub.model(input_ids.roll(-1, 1), attention_mask)
    assert max(T.text_agreement(stub, shifted, windows)) < 0.5  # off by one row: (almost) never the same byte


# ------------------------------------------------------------------------------------------------ raw checkpoint

def test_trained_weights_round_trip_through_the_raw_layout(tmp_path):
    config = T.text_config(T.REDUCED)
    model = T.new_model(config, seed=0)
    with torch.no_grad():  # no tensor left at its init value, so a mis-mapped one cannot go unnoticed
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    write_checkpoint(tmp_path, config, tensors=raw_text_tensors(model))
    target = load_hf_target(tmp_path)
    ids = T.encode("import os\nprint(os.getcwd())\n")[None]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        got = target(input_ids=ids).logits
    assert torch.equal(got, expected)


def test_write_checkpoint_rejects_foreign_tensors(tmp_path):
    config = T.text_config(T.REDUCED)
    tensors = raw_text_tensors(T.new_model(config, seed=0))
    with pytest.raises(KeyError, match="model.llm.nope"):
        write_checkpoint(tmp_path / "a", config, tensors={**tensors, "model.llm.nope": torch.zeros(1)})
    bad = {**tensors, "model.llm.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="model.llm.norm.weight"):
        write_checkpoint(tmp_path / "b", config, tensors=bad)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---------------------------------------------------------------------------------------------------------- build

def test_build_is_reproducible(built, corpus, tmp_path):
    again = T.build(T.REDUCED, root=tmp_path, corpus=corpus, progress=False)
    assert again.name == built.name  # keyed by corpus + recipe, not by where it lives
    assert weights_hash(again) == weights_hash(built)
    assert D.load_metrics(again)["agreement_after"] == D.load_metrics(built)["agreement_after"]


def test_build_is_cached_and_keyed_by_corpus_and_recipe(built, corpus, tmp_path):
    import dataclasses

    stamp = (built / T.METRICS_FILE).stat().st_mtime_ns
    assert T.build(T.REDUCED, root=built.parent, corpus=corpus, progress=False) == built
    assert (built / T.METRICS_FILE).stat().st_mtime_ns == stamp
    assert T.target_dir(dataclasses.replace(T.REDUCED, seed=1), root=built.parent, corpus=corpus) != built
    (tmp_path / "a.py").write_text("pass\n")
    other = T.load_corpus(tmp_path, train=("a",), heldout=())
    assert T.target_dir(T.REDUCED, root=built.parent, corpus=other) != built
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # the temporary target directory is gone


def test_built_directory_loads_in_both_libraries_with_8_depths(built):
    metrics = T.load_metrics(built)
    assert metrics["corpus"] == T.load_corpus().digest and metrics["recipe"]["steps"] == T.REDUCED.steps
    assert 0 < metrics["heldout_bits_per_byte"] < 9
    assert len(metrics["distill"]["agreement_after"]) == len(metrics["heldout_text_agreement"]) == 8
    assert all(0 <= a <= 1 for a in metrics["heldout_text_agreement"])
    target = load_hf_target(built)
    assert len(load_hf_mtp(target).layers) == 8
    mtp = InklingMTP.from_pretrained(built, target=target)
    assert [d.sliding for d in mtp.config.depths] == [True, False, True, False, True, True, True, True]
    config = json.loads((built / "config.json").read_text())
    assert config["text_config"]["unpadded_vocab_size"] == T.LOGITS_VOCAB


def test_distill_takes_given_prompts_and_checks_them(built):
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ArgumentError, match="both prompts and eval_prompts"):
        D.distill(built, built.parent / "x", prompts=ids, progress=False)
    with pytest.raises(ArgumentError, match=r"\[N, P\] and \[M, P\]"):
        D.distill(built, built.parent / "x", prompts=ids, eval_prompts=ids[:, :3], progress=False)
    target = load_hf_target(built)
    with pytest.raises(ArgumentError, match=r"prompt ids must lie in \[0, 263\)"):
        D.greedy_continuations(target, ids + 300, seq_len=8)


# ------------------------------------------------------------------------------------------------------- lossless

@pytest.fixture(scope="module")
def heldout_cases(built):
    """(target, [(prompt, mask, target.generate's greedy output)]): three held-out prompts alone and a left-padded
    batch of three of different lengths, 24 new tokens each, no EOS stop."""
    target = load_hf_target(built)
    target.generation_config.eos_token_id = None  # full-length continuations
    ids = T.heldout_prompts(6, 16, seed=0)
    cases = [(ids[i:i + 1], torch.ones(1, 16, dtype=torch.long)) for i in range(3)]
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[1, :5] = mask[2, :9] = 0  # left padding: rows of different lengths
    cases.append((ids[3:].masked_fill(mask == 0, T.PAD_ID), mask))
    with torch.no_grad():
        return target, [(prompt, m, target.generate(prompt, attention_mask=m, do_sample=False, max_new_tokens=24,
                                                    pad_token_id=T.PAD_ID)) for prompt, m in cases]


@pytest.mark.parametrize("k", [1, 8])
def test_speculative_greedy_is_token_identical_on_heldout_prompts(built, heldout_cases, k):
    target, cases = heldout_cases
    distilled = InklingMTP.from_pretrained(built, target=target)
    scrambled = InklingMTP.from_pretrained(built, target=target)
    # The reduced target continues with spaces only, which its distilled MTP always drafts right: a scrambled copy
    # takes the rejection path.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in scrambled.named_parameters():
            if name.startswith("layers."):
                p.add_(torch.randn(p.shape, generator=gen))
    accepted, rejected = 0, 0
    for mtp in (distilled, scrambled):
        drafter = Drafter(mtp, max_batch_size=3, max_length=64, num_speculative_tokens=k, compile=False)
        for prompt, m, expected in cases:
            ours = speculative_generate(target, drafter, prompt, m, max_new_tokens=24, pad_token_id=T.PAD_ID)
            assert torch.equal(ours.sequences, expected)
            accepted, rejected = accepted + ours.num_accepted, rejected + ours.num_drafted - ours.num_accepted
    assert accepted > 0 and rejected > 0  # both paths of the loop ran


# ------------------------------------------------------------------------------------------------------------ CLI

def test_generate_cli_prints_decoded_text(built, monkeypatch, capsys):
    from inkling_compiled.generate import main

    monkeypatch.setattr(T, "RECIPE", T.REDUCED)
    monkeypatch.setenv("INKLING_COMPILED_CACHE", str(built.parent))
    code = main(["--text-target", "--check", "--no-compile", "--no-warmup", "--prompt-len", "24",
                 "--max-new-tokens", "8", "--ignore-eos"])
    out = capsys.readouterr().out
    assert code == 0 and "greedy generate() match: True" in out
    prompt = T.decode(T.heldout_prompts(1, 24, seed=0)[0])
    assert f"[0] prompt (24 bytes):\n{prompt}\n[0] generated (8 tokens):\n" in out


@pytest.mark.parametrize("threads, message", [
    ("0", "must be an int >= 1, got '0'"),
    (str(10**20), "must be an int in [1, 1024] (torch intra-op threads), got '100000000000000000000'")])
def test_build_command_line_refuses_a_thread_count_out_of_range(capsys, threads, message):
    """--threads 0 was ignored, -1 a RuntimeError from torch.set_num_threads, 10**20 its OverflowError."""
    with pytest.raises(SystemExit):
        T.main(["--threads", threads])
    assert f"argument --threads: {message}" in capsys.readouterr().err


def test_a_root_holding_files_is_not_probed_for_writing(tmp_path, monkeypatch):
    """A directory with files in it (a built target, read not written) is left to the command: a read-only cache
    holding the target must still serve it."""
    from inkling_compiled import arguments

    def unwritable(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(arguments.tempfile, "mkdtemp", unwritable)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "built").write_text("")
    assert arguments.writable_directory_option(str(tmp_path / "full")) == tmp_path / "full"
    (tmp_path / "empty").mkdir()
    for new_or_empty in ("new", "empty"):  # something is to be written there: probed
        with pytest.raises(argparse.ArgumentTypeError, match="is not writable"):
            arguments.writable_directory_option(str(tmp_path / new_or_empty))


@pytest.mark.parametrize("root, message", [
    ("{tmp}/a-file", "argument --root: '{tmp}/a-file' is not a directory"),  # was NotADirectoryError
    ("{tmp}/a-file/sub", "argument --root: '{tmp}/a-file/sub' cannot be a directory: '{tmp}/a-file' is not one"),
    pytest.param("/proc/nope", "argument --root: '/proc/nope' is not writable",  # was FileNotFoundError
                 marks=pytest.mark.skipif(not os.path.isdir("/proc"), reason="no /proc")),
    ("", "argument --root: must name a path, got ''")])  # was the current directory
def test_build_command_line_refuses_a_root_it_cannot_build_in(tmp_path, capsys, monkeypatch, root, message):
    monkeypatch.setattr(T, "build", lambda *args, **kwargs: pytest.fail("built"))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as exit_:
        T.main(["--reduced", "--root", root.format(tmp=tmp_path)])
    lines = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and len(lines) == 1
    prog = "python -m inkling_compiled.training.text_target"
    assert lines[0].startswith(f"{prog}: error: {message.format(tmp=tmp_path)}")


def test_build_command_line_takes_a_root_still_to_be_made(tmp_path, monkeypatch):
    """--root may name a directory that build makes; the check that it can leaves nothing behind."""
    def build(recipe, *, root, force):
        raise LookupError(root)  # what build was given, before anything is built

    monkeypatch.setattr(T, "build", build)
    with pytest.raises(LookupError) as given:
        T.main(["--reduced", "--root", str(tmp_path / "new" / "sub")])
    assert given.value.args == (tmp_path / "new" / "sub",) and list(tmp_path.iterdir()) == []
