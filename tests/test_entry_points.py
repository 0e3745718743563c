"""Every public argument of every entry point is checked once, at the boundary: a bad value is an error
naming the argument and the value before any model call, never a crash from inside torch or a silent
reinterpretation; what the contract accepts (every integer dtype for ids and positions) gives the int64 answer.

Eager and tiny: the tiny synthetic checkpoint (vocab 512, 2 depths), drafters with ``compile=False``.
"""

from __future__ import annotations

import gc
import json
import logging
import re
import shutil
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn

from inkling_compiled import InklingMTP
from inkling_compiled import generate as cli
from inkling_compiled.runtime import Drafter
from inkling_compiled.runtime.speculative import speculative_generate
from inkling_compiled.testing.synthetic import greedy_generation_config, load_hf_target
from inkling_compiled.training import text_target
from tests.helpers import draft_rows, random_mtp

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    """(target, its MTP sharing the target's tensors), fp32: vocab 512 (500 logits)."""
    target = load_hf_target(tiny_checkpoint).requires_grad_(False)
    return target, InklingMTP.from_pretrained(tiny_checkpoint, target=target)


def prompts(batch=2, length=6, seed=0):
    ids = torch.randint(8, 100, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, : length // 2] = 0
    return ids, mask


# ------------------------------------------------------------------------------------------------ pad and eos ids


@pytest.fixture
def uneven_drafter(pair):
    """A real eager drafter whose rows keep different numbers of tokens each round: the target's head is zeroed (it
    always emits token 0) and the draft head proposes 0 for row 0 (accepted) and 1 for the others (rejected)."""
    target, mtp = pair
    saved = target.lm_head.weight.clone()
    target.lm_head.weight.zero_()
    mtp.get_top_tokens = lambda hidden, validate=True: (torch.arange(hidden.shape[0]) > 0).long()
    yield Drafter(mtp, max_batch_size=2, max_length=64, compile=False)
    del mtp.get_top_tokens
    target.lm_head.weight.copy_(saved)


def test_the_uneven_drafter_runs_with_a_valid_pad_id(pair, uneven_drafter):
    ids, mask = prompts()
    out = speculative_generate(pair[0], uneven_drafter, ids, mask, max_new_tokens=12, pad_token_id=3)
    assert out.sequences[:, ids.shape[1]:].eq(0).all() and out.accepted_per_round[0] == 2  # row 0: both drafts


@pytest.mark.parametrize("pad", [612, 512, -5, True, 2.0, "0"])
def test_pad_token_id_is_checked_without_eos(pair, uneven_drafter, pad):
    """It is the token of the drafter's padding rows whenever rows keep different numbers of tokens."""
    ids, mask = prompts()
    with pytest.raises(ValueError, match=rf"pad_token_id .*\[0, 512\).*got {re.escape(repr(pad))}"):
        speculative_generate(pair[0], uneven_drafter, ids, mask, max_new_tokens=12, pad_token_id=pad)


@pytest.mark.parametrize("eos", [-1, 512, 2.5, True, [2, -3], torch.tensor([2.0]), "2", [[2]]])
def test_eos_token_id_is_checked(pair, uneven_drafter, eos):
    ids, mask = prompts()
    with pytest.raises(ValueError, match=r"eos_token_id .*\[0, 512\)"):
        speculative_generate(pair[0], uneven_drafter, ids, mask, max_new_tokens=4, eos_token_id=eos)


def test_eos_token_ids_in_every_accepted_form(pair, uneven_drafter):
    ids, mask = prompts()
    outs = [speculative_generate(pair[0], uneven_drafter, ids, mask, max_new_tokens=4, eos_token_id=eos).sequences
            for eos in (0, [0, 7], torch.tensor([0, 7]), torch.tensor(0, dtype=torch.int16))]
    assert all(torch.equal(outs[0], out) for out in outs)  # the target emits 0 first: every row stops at once
    assert outs[0].shape[1] == ids.shape[1] + 1


# ------------------------------------------------------------------------------------------------ tiny temperatures


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-7])
def test_a_tiny_temperature_is_refused_everywhere(pair, temperature):
    """Below MIN_TEMPERATURE a temperature is greedy decoding up to rounding and its reciprocal overflows float32:
    refused by name at every entry point that takes one (use 0)."""
    target, mtp = pair
    drafter = Drafter(mtp, max_batch_size=2, max_length=32, compile=False)
    ids, mask = prompts()
    message = rf"temperature must be 0 \(greedy\) or a finite number >= 1e-06.*got {re.escape(repr(temperature))}"
    with pytest.raises(ValueError, match=message):
        speculative_generate(target, drafter, ids, mask, max_new_tokens=4, temperature=temperature)
    rows = draft_rows(mtp)
    with pytest.raises(ValueError, match=message):
        drafter.draft(*rows, temperature=temperature)
    with pytest.raises(ValueError, match=message):
        drafter.capture((1,), temperature=temperature)
    with pytest.raises(SystemExit, match="2"):
        cli.parse_args(["--temperature", str(temperature)])


def test_the_smallest_temperature_samples(pair):
    target, mtp = pair
    drafter = Drafter(mtp, max_batch_size=2, max_length=32, compile=False)
    ids, mask = prompts()
    out = speculative_generate(target, drafter, ids, mask, max_new_tokens=6, temperature=1e-6,
                               generator=torch.Generator().manual_seed(0))
    greedy = speculative_generate(target, drafter, ids, mask, max_new_tokens=6)
    assert torch.equal(out.sequences, greedy.sequences)  # one-hot distributions: what greedy picks


# ------------------------------------------------------------------------------------------------ integer dtypes

SMALL_INTS = [torch.int8, torch.uint8, torch.int16, torch.int32]


@pytest.mark.parametrize("dtype", SMALL_INTS)
def test_every_integer_dtype_is_accepted_by_forward(dtype):
    """ids and positions of any integer dtype are converted to int64 once, at the boundary (a uint8 tensor is never
    taken for a boolean mask)."""
    mtp = random_mtp()
    ids, positions, hidden = draft_rows(mtp, length=4)
    ids = ids % 100  # fits int8
    for cached in (False, True):
        expected = mtp(ids, positions, hidden, cache=mtp.new_cache(2, 8) if cached else None)
        got = mtp(ids.to(dtype), positions.to(dtype), hidden, cache=mtp.new_cache(2, 8) if cached else None)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", SMALL_INTS)
def test_every_integer_dtype_is_accepted_by_the_drafter(dtype):
    mtp = random_mtp()
    ids, positions, hidden = draft_rows(mtp, length=4)
    ids = ids % 100
    results = [Drafter(mtp, 2, 8, compile=False).draft(ids.to(d), positions.to(d), hidden).drafts
               for d in (torch.long, dtype)]
    assert torch.equal(*results)


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8])
def test_every_integer_dtype_is_accepted_by_speculative_generate(pair, dtype):
    target, mtp = pair
    drafter = Drafter(mtp, max_batch_size=2, max_length=32, compile=False)
    ids, mask = prompts()
    expected = speculative_generate(target, drafter, ids, mask, max_new_tokens=4).sequences
    got = speculative_generate(target, drafter, ids.to(dtype), mask.to(dtype), max_new_tokens=4).sequences
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.complex64])
def test_non_integer_ids_and_positions_are_refused(dtype):
    mtp = random_mtp()
    ids, positions, hidden = draft_rows(mtp)
    with pytest.raises(ValueError, match=f"positions must be an integer tensor, got {dtype}"):
        mtp(ids, positions.to(dtype), hidden)
    with pytest.raises(ValueError, match=f"input_ids must be an integer tensor, got {dtype}"):
        mtp(ids.to(dtype), positions, hidden)


# ------------------------------------------------------------------------------------------------ quantized models


def _live_tensors(dtype: torch.dtype) -> list[weakref.ref]:
    gc.collect()
    return [weakref.ref(o) for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.dtype == dtype]


def test_quantize_releases_the_replaced_weights():
    """After quantize_ no bf16 depth-linear weight is alive anywhere, and the bytes the model reports are the bytes
    its modules hold."""
    mtp = random_mtp(dtype=BF16)
    linears = [m.weight for m in mtp.modules() if isinstance(m, nn.Linear)]
    replaced = [weakref.ref(w) for w in linears]
    depth_bytes_before = sum(w.nbytes for w in linears)
    del linears
    # other tests' (session fixtures') int8 tensors, held so that no new tensor can take one's id
    int8_before = {id(t): t for t in (r() for r in _live_tensors(torch.int8)) if t is not None}
    mtp.quantize_("int8", head=False)
    gc.collect()
    alive = [r for r in replaced if r() is not None]
    assert not alive, f"{len(alive)} of {len(replaced)} replaced bf16 weights are still alive"
    assert mtp.quantization.depth_bytes_before == depth_bytes_before
    held = sum(p.nbytes for name, p in mtp.named_parameters() if name.startswith("layers.")
               and (p.dtype == torch.int8 or name.endswith(".scale")))
    assert mtp.quantization.depth_bytes == held
    int8_alive = sum(t.nbytes for t in (r() for r in _live_tensors(torch.int8)) if t is not None
                     and id(t) not in int8_before)
    assert int8_alive == sum(p.nbytes for p in mtp.parameters() if p.dtype == torch.int8)


def test_a_quantized_model_validates_its_current_parameters():
    """check_parameters reads the modules the model holds now (not those of construction time)."""
    mtp = random_mtp(dtype=BF16).quantize_("int8")
    mtp.layers[0].input_proj.scale.data = mtp.layers[0].input_proj.scale.data.float()
    with pytest.raises(ValueError, match=r"layers\.0\.input_proj\.scale"):
        Drafter(mtp, 2, 8, compile=False)


def test_a_quantized_model_converted_to_float32_names_the_int8_reason():
    mtp = random_mtp(dtype=BF16).quantize_("int8").to(torch.float32)
    with pytest.raises(ValueError, match="int8 weight-only drafting runs with bfloat16 activations") as info:
        Drafter(mtp, 2, 8, compile=False)
    assert "target" not in str(info.value).split(":")[0]
    with pytest.raises(ValueError, match="int8 weight-only drafting runs with bfloat16 activations"):
        mtp(*draft_rows(mtp))


# ------------------------------------------------------------------------------------------------ the command line


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if the CLI loads anything."""
    def refuse(*args, **kwargs):
        raise AssertionError("the CLI loaded a model before validating its arguments")

    monkeypatch.setattr("inkling_compiled.testing.synthetic.load_hf_target", refuse)
    monkeypatch.setattr(InklingMTP, "from_pretrained", refuse)


def _cli_error(argv, capsys) -> str:
    """The one stderr line of a CLI run that exits with status 2."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    captured = capsys.readouterr()
    # transformers' progress bar aside
    lines = [line for line in captured.err.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(lines) == 1 and lines[0].startswith(f"{cli.PROG}: error: "), captured.err
    return lines[0]


def test_cli_refuses_a_missing_checkpoint_directory(tmp_path, capsys, no_loading):
    line = _cli_error(["--checkpoint", str(tmp_path / "nowhere")], capsys)
    assert "--checkpoint" in line and "nowhere" in line and "no such directory" in line


def test_cli_refuses_a_file_as_checkpoint(tmp_path, capsys, no_loading):
    file = tmp_path / "weights.bin"
    file.write_bytes(b"\x80\x04junk")
    line = _cli_error(["--checkpoint", str(file)], capsys)
    assert "--checkpoint" in line and "weights.bin" in line and "not a directory" in line


def test_cli_refuses_a_directory_without_a_config(tmp_path, capsys, no_loading):
    line = _cli_error(["--checkpoint", str(tmp_path)], capsys)
    assert "--checkpoint" in line and "config.json" in line


def test_cli_checks_the_checkpoint_itself_before_transformers_reads_it(tmp_path, capsys, no_loading):
    """A config.json that is no Inkling config was transformers' error about a missing model.safetensors."""
    (tmp_path / "config.json").write_text("{}")
    line = _cli_error(["--checkpoint", str(tmp_path)], capsys)
    assert "config.json" in line and "is not an Inkling config" in line


@pytest.mark.parametrize("argv, message", [
    (["--preset", ""], "argument --preset: invalid choice: ''"),  # was the tiny preset
    (["--preset", "bogus"], "argument --preset: invalid choice: 'bogus'"),  # was refused without naming --preset
    (["--checkpoint", ""], "--checkpoint must name a path, got ''")])  # was the current directory
def test_cli_refuses_an_empty_or_unknown_choice_of_checkpoint(argv, message, capsys, no_loading):
    assert message in _cli_error(argv, capsys)


def test_cli_a_damaged_shard_is_one_line(tiny_checkpoint, tmp_path, capsys):
    """A truncated target shard passes the library's checks (config, index, MTP headers): safetensors' error,
    raised as transformers loads the target, was a traceback."""
    damaged = shutil.copytree(tiny_checkpoint, tmp_path / "damaged")
    sorted(damaged.glob("model-*.safetensors"))[0].write_bytes(b"\x08")
    assert "deserializing header" in _cli_error(["--checkpoint", str(damaged), "--no-compile"], capsys)


@pytest.mark.parametrize("device", ["banana", "cuda:0" if not torch.cuda.is_available() else "cuda:99", "meta"])
def test_cli_refuses_an_unusable_device(device, capsys, no_loading):
    line = _cli_error(["--device", device], capsys)
    assert f"--device {device!r}" in line or f"--device={device!r}" in line


@pytest.mark.parametrize("argv, name", [(["-k", "0"], "--num-speculative-tokens"), (["--top-p", "0"], "--top-p"),
                                        (["--top-p", "nan"], "--top-p"), (["--temperature", "-1"], "--temperature"),
                                        (["--temperature", "inf"], "--temperature"), (["--batch", "0"], "--batch"),
                                        (["--seed", str(2**70)], "--seed")])
def test_cli_refuses_bad_numbers_before_loading(argv, name, capsys, no_loading):
    assert name in _cli_error(argv, capsys)


@pytest.mark.parametrize("flag", ["--max-new-tokens", "--batch"])
def test_cli_a_cache_too_large_is_one_line(flag, capsys):
    """The drafter's MemoryError naming the sizes was a traceback."""
    assert cli.main(["--no-compile", flag, str(10**11)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1].startswith(f"{cli.PROG}: error: the MTP cache for batch_")


def test_cli_media_take_every_seed_it_accepts(tiny_checkpoint):
    """The media's seed is --seed + 1: at the top of the accepted range that overflowed torch's seed."""
    target = load_hf_target(tiny_checkpoint)

    def media(seed: int) -> dict:
        args = cli.parse_args(["--seed", str(seed), "--image", "2", "--audio", "1"])
        return cli.add_media(args, target, *cli.make_prompts(args, 100))[2]

    top, wrapped = media(2**64 - 1), media(-1)  # both media seeds are (seed + 1) % 2**64 = 0: the same media
    assert top.keys() == wrapped.keys() and all(torch.equal(top[k], wrapped[k]) for k in top)


def test_cli_on_cpu_prints_no_note_about_a_cuda_kernel_package(tiny_checkpoint):
    """transformers notes once per process that the causal_conv1d kernels (CUDA only) are missing: no concern of a
    CPU run, so held back; the run's own lines are all that reach the terminal."""
    command = [sys.executable, "-m", "inkling_compiled.generate", "--checkpoint", str(tiny_checkpoint), "--device",
               "cpu", "--no-compile", "--no-warmup", "--prompt-len", "4", "--max-new-tokens", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "causal_conv1d" not in done.stderr + done.stdout


@pytest.mark.parametrize("argv, flag", [(["--text-target", "--preset", "tiny8"], "--preset"),
                                        (["--text-target", "--distilled"], "--distilled"),
                                        (["--checkpoint", "{ckpt}", "--preset", "tiny8"], "--preset"),
                                        (["--checkpoint", "{ckpt}", "--distilled"], "--distilled"),
                                        (["--checkpoint", "{ckpt}", "--text-target"], "--text-target")])
def test_cli_refuses_two_choices_of_checkpoint(argv, flag, tiny_checkpoint, capsys, no_loading):
    """--preset / --distilled choose the synthetic checkpoint: beside another choice they were silently ignored."""
    line = _cli_error([a.format(ckpt=tiny_checkpoint) for a in argv], capsys)
    assert flag in line


def test_the_greedy_reference_without_eos_runs_past_the_eos_id(tiny_checkpoint):
    """generate() fills a None EOS from the model's generation config: "no EOS" must not stop the reference there."""
    target = load_hf_target(tiny_checkpoint)
    eos = target.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos

    def always_eos(module, inputs, logits):
        logits[..., eos] += 1e4

    target.lm_head.register_forward_hook(always_eos)  # every greedy token is the EOS id
    ids = torch.full((1, 4), 5)
    out = target.generate(ids, attention_mask=torch.ones_like(ids),
                          generation_config=greedy_generation_config(target, 6))
    assert out[0, 4:].tolist() == [eos] * 6


def test_cli_reports_a_library_refusal_in_one_line(tiny_checkpoint, capsys):
    """An argument only the checkpoint can judge (more drafts than depths) is one line too, after loading."""
    line = _cli_error(["--checkpoint", str(tiny_checkpoint), "-k", "9", "--no-compile"], capsys)
    assert "num_speculative_tokens" in line and "9" in line


def edited_checkpoint(source, directory, section: str, **fields):
    """A copy of the checkpoint ``source`` in ``directory`` with ``fields`` of its config.json's ``section`` set."""
    edited = shutil.copytree(source, directory)
    config = json.loads((edited / "config.json").read_text())
    config[section].update(fields)
    (edited / "config.json").write_text(json.dumps(config))
    return edited


TARGET_ONLY_FIELDS = [  # config.json fields only the target reads, and transformers' failure on each
    ("vision_config", dict(patch_size=0), "vision_config.patch_size must be an int >= 1, got 0"),  # a hang
    ("text_config", dict(num_experts_per_tok=9), r"num_experts_per_tok must be an int in \[1, 4\], got 9"),
    ("text_config", dict(pad_token_id=100000), r"pad_token_id must be an int in \[0, 511\], got 100000"),
    ("audio_config", dict(n_mel_bins=-1), "negative dimension"),
    ("text_config", dict(layer_types=["bogus", "hybrid"]), "layer_types` entries must be in"),
    ("text_config", dict(num_hidden_layers=3), r"`num_hidden_layers` \(3\) must be equal to the number of")]


@pytest.mark.parametrize("section, fields, message", TARGET_ONLY_FIELDS)
def test_the_target_s_config_fields_are_one_line_naming_the_file(tiny_checkpoint, tmp_path, capsys, section, fields,
                                                                 message):
    """They pass the library's checks (the MTP's fields): transformers' own exceptions, from building the target or
    its first forward, were tracebacks, and a patch size of 0 hung; an out-of-vocabulary pad id came after
    transformers' warning of it (its log handler writes to the terminal, which capsys does not see)."""
    edited = edited_checkpoint(tiny_checkpoint, tmp_path / "edited", section, **fields)
    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warned.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        line = _cli_error(["--checkpoint", str(edited), "--no-compile", "--max-new-tokens", "2"], capsys)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not warned, [record.getMessage() for record in warned]
    assert f"{edited / 'config.json'}: transformers cannot build the target from it: " in line
    assert re.search(message, line), line


def test_cli_reports_the_loops_refusal_of_a_checkpoint_eos_id_in_one_line(tiny_checkpoint, tmp_path, capsys):
    """An EOS id outside the vocabulary in config.json is refused by speculative_generate, after build(): that was
    a traceback."""
    edited = edited_checkpoint(tiny_checkpoint, tmp_path / "bad-eos", "text_config", eos_token_id=100000)
    line = _cli_error(["--checkpoint", str(edited), "--no-compile", "--max-new-tokens", "2"], capsys)
    assert str(edited) in line and "eos_token_id" in line and "100000" in line


# ------------------------------------------------------------------------------------------------ text-target helpers


@pytest.mark.parametrize("count, length", [(0, 8), (-1, 8), (2, 0), (2, -3), (2.0, 8), (True, 8), (2, "8")])
def test_text_target_prompt_sizes_are_checked(count, length):
    with pytest.raises(ValueError, match=r"(count|length) must be an int >= 1"):
        text_target.heldout_prompts(count, length)


def test_text_target_seed_and_ids_are_checked():
    with pytest.raises(ValueError, match="seed must be an int"):
        text_target.heldout_prompts(2, 8, seed=1.5)
    with pytest.raises(ValueError, match=r"ids must be an integer tensor, got torch\.float32"):
        text_target.decode(torch.tensor([65.0, 66.0]))
    with pytest.raises(ValueError, match="text must be a str or bytes"):
        text_target.encode(65)
    with pytest.raises(ValueError, match=r"ids must be integer token ids, got \[72, 1\.5\]"):
        text_target.decode([72, 1.5])
    assert text_target.decode(torch.tensor([72, 105], dtype=torch.uint8)) == "Hi"


# ------------------------------------------------------------------------------------------------ found beyond the list


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_the_loop_names_a_target_or_drafter_of_the_wrong_kind(pair, which):
    target, mtp = pair
    drafter = Drafter(mtp, max_batch_size=2, max_length=32, compile=False)
    args = {"target": target, "drafter": drafter, which: "model.safetensors"}
    with pytest.raises(ValueError, match=rf"^{which} must .*got str"):
        speculative_generate(args["target"], args["drafter"], *prompts(), max_new_tokens=3)


@pytest.mark.parametrize("size", [dict(batch_size=10**9, max_length=64), dict(batch_size=2, max_length=10**12),
                                  dict(batch_size=10**9, max_length=10**9)])  # the last overflows torch's size
def test_a_cache_too_large_to_allocate_names_its_sizes(size):
    mtp = random_mtp()
    with pytest.raises(MemoryError, match=rf"batch_size={size['batch_size']}, max_length={size['max_length']} needs "):
        mtp.new_cache(**size)
    with pytest.raises(MemoryError, match="could not be allocated"):
        Drafter(mtp, size["batch_size"], size["max_length"], compile=False)


def test_token_ids_take_every_integer_type_a_count_takes(pair, uneven_drafter):
    """A NumPy integer (or a 0-d integer tensor) is an id wherever an int is, as it is a count."""
    np = pytest.importorskip("numpy")
    ids, mask = prompts()
    expected = speculative_generate(pair[0], uneven_drafter, ids, mask, max_new_tokens=6, pad_token_id=3,
                                    eos_token_id=[7]).sequences
    got = speculative_generate(pair[0], uneven_drafter, ids, mask, max_new_tokens=np.int64(6),
                               pad_token_id=np.int32(3), eos_token_id=[np.int64(7)]).sequences
    assert torch.equal(got, expected)
    got = speculative_generate(pair[0], uneven_drafter, ids, mask, max_new_tokens=6, pad_token_id=torch.tensor(3),
                               eos_token_id=torch.tensor(7)).sequences
    assert torch.equal(got, expected)


@pytest.mark.parametrize("validate", ["no", 0, None])
def test_draft_validate_must_be_a_bool(validate):
    """``validate=0`` used to skip every check silently (falsy), ``"no"`` to run them (truthy)."""
    mtp = random_mtp()
    with pytest.raises(ValueError, match=f"validate must be a bool, got {re.escape(repr(validate))}"):
        Drafter(mtp, 2, 8, compile=False).draft(*draft_rows(mtp), validate=validate)


# ------------------------------------------------------------------------------------------------ packages, loading


def test_package_arguments_are_checked_before_reading_anything(tmp_path):
    """A directory of the wrong type was a TypeError from pathlib; ``fallback`` was never checked (a missing package
    answered first)."""
    mtp = random_mtp()
    with pytest.raises(ValueError, match=r"^directory must be a str or os\.PathLike, got int 3"):
        Drafter.load_compiled(3, mtp)
    with pytest.raises(ValueError, match=r"^fallback must be a bool, got 'yes'"):
        Drafter.load_compiled(tmp_path / "none", mtp, fallback="yes")
    with pytest.raises(ValueError, match=r"^directory must be a str or os\.PathLike, got NoneType None"):
        Drafter(mtp, 1, 8, compile=False).save_compiled(None)


def test_from_pretrained_takes_every_integer_type_for_num_depths(tiny_checkpoint):
    np = pytest.importorskip("numpy")
    assert InklingMTP.from_pretrained(tiny_checkpoint, num_depths=np.int64(1)).config.num_depths == 1


def test_text_target_build_arguments_are_checked():
    """Checked before the corpus is read or anything is trained."""
    for kwargs, message in ((dict(recipe="reduced"), "recipe must be a Recipe, got str"),
                            (dict(force=1), "force must be a bool, got 1"),
                            (dict(progress="no"), "progress must be a bool, got 'no'"),
                            (dict(root=7), "root must be a str or os.PathLike, got int 7")):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            text_target.build(**{"recipe": text_target.REDUCED, **kwargs})


@pytest.mark.parametrize("hidden, message", [
    (torch.randn(2, 65), r"hidden has shape \(2, 65\), expected \(\.\.\., 64\)"),
    (torch.ones(2, 64, dtype=torch.long), "hidden has dtype torch.int64, the model runs in torch.float32"),
    ([0.0] * 64, "hidden must be a torch.Tensor, got list"),
    (torch.randn(0, 64).reshape(0), r"hidden has shape \(0,\), expected \(\.\.\., 64\)"),
])
@pytest.mark.parametrize("method", ["compute_logits", "get_top_tokens"])
def test_the_head_names_a_bad_hidden(method, hidden, message):
    """The head's public methods check their hidden as forward does: not a matmul error or an integer hidden taken."""
    with pytest.raises(ValueError, match=message):
        getattr(random_mtp(), method)(hidden)


@pytest.mark.parametrize("method", ["compute_logits", "get_top_tokens", "embed_tokens"])
def test_validate_must_be_a_bool(method):
    """A truthy "no" validated all the same, and 0 skipped the checks."""
    model = random_mtp()
    value = torch.zeros(2, dtype=torch.long) if method == "embed_tokens" else torch.randn(2, 64)
    for validate in ("no", 0):
        with pytest.raises(ValueError, match=f"validate must be a bool, got {validate!r}"):
            getattr(model, method)(value, validate=validate)


@pytest.mark.parametrize("ids, message", [
    (torch.tensor([[3, 256]]), r"input_ids hold token id 256, outside the embedding table's rows \[0, 256\)"),
    (torch.tensor([-1]), r"input_ids hold token id -1, outside the embedding table's rows"),
    (torch.tensor([1.0]), "input_ids must be an integer tensor, got torch.float32"),
    ([1, 2], "input_ids must be a torch.Tensor, got list"),
    (torch.zeros(2, dtype=torch.long, device="meta"), "input_ids is on meta, the model on cpu"),
])
def test_embed_tokens_names_bad_ids(ids, message):
    """It indexed the table unchecked: torch's IndexError (on CUDA a device assert) or its indices dtype error."""
    with pytest.raises(ValueError, match=message):
        random_mtp().embed_tokens(ids)
    assert random_mtp().embed_tokens(torch.tensor([[3, 255]], dtype=torch.int16)).shape == (1, 2, 64)


def test_a_float64_target_is_refused_naming_its_dtype(tiny_checkpoint):
    """A float64 target used to fail inside a matmul of the first round (the drafter runs fp32 / bf16 / fp16)."""
    target = load_hf_target(tiny_checkpoint, dtype=torch.float64).requires_grad_(False)
    drafter = Drafter(InklingMTP.from_pretrained(tiny_checkpoint), 2, 32, compile=False)
    with pytest.raises(ValueError, match="the target runs in torch.float64"):
        speculative_generate(target, drafter, *prompts(), max_new_tokens=2)
