"""Image and audio prompts (docs/model.md §7): ``generate(custom_generate=...)`` and ``speculative_generate`` with
``pixel_values`` / ``audio_input_ids`` equal greedy ``generate`` with the same inputs, with eager drafters (K = 2 on
the tiny checkpoint, K = 8 on tiny8, whose re-run rows reach back into the prompt) and the session's compiled K = 8
drafter (a second image prompt compiles nothing); the drafter's prefill reads the target's merged rows, shifted one
ahead, not the placeholder ids' embeddings.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from inkling_compiled import InklingMTP
from inkling_compiled.arguments import ArgumentError
from inkling_compiled.generate import main as generate_cli
from inkling_compiled.runtime import Drafter, custom_generate, speculative_generate
from inkling_compiled.runtime.multimodal import merged_rows
from inkling_compiled.testing import synthetic
from tests.helpers import StandInDrafter

IMAGE, IMAGE_BOS, AUDIO, AUDIO_BOS = 4, 5, 7, 6  # the synthetic checkpoints' special ids
PATCH = (2, 2, 2, 3)  # one vision patch (temporal, height, width, channels): one merged row
MAX_NEW = 10


def image_prompt(seed: int, batch: int = 1, patches: int = 3, text: int = 3):
    """(input_ids, attention_mask, pixel_values): text, an image of ``patches`` placeholder rows, text; row b has
    ``b`` fewer leading text tokens (left-padded), and the image ends ``text`` tokens before the prompt's end."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batch):
        words = torch.randint(8, 500, (2 + text,), generator=gen).tolist()
        rows.append(words[b % 2:2] + [IMAGE_BOS] + [IMAGE] * patches + words[2:])
    return (*left_pad(rows), torch.randn(batch * patches, *PATCH, generator=gen))


def audio_prompt(seed: int, batch: int = 1, frames: int = 3):
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(8, 500, (3,), generator=gen).tolist()[:2 + b % 2] + [AUDIO_BOS] + [AUDIO] * frames + [9]
            for b in range(batch)]
    return (*left_pad(rows), torch.randint(0, 8, (batch, frames, 4), generator=gen))


def left_pad(rows):
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row):], mask[b, width - len(row):] = torch.tensor(row), 1
    return ids, mask


@pytest.fixture(scope="module")
def tiny_mm():
    path = synthetic.cached_checkpoint("tiny")
    target = synthetic.load_hf_target(path).requires_grad_(False)
    return target, InklingMTP.from_pretrained(path, target=target)


def greedy(target, ids, mask, **inputs):
    return target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None,
                           **inputs)


@pytest.mark.floor  # make test-floor: the towers and generate's image handling on the lowest transformers
@pytest.mark.parametrize("batch", [1, 2])
def test_image_and_audio_prompts_match_generate(tiny_mm, batch):
    target, mtp = tiny_mm
    drafter = Drafter(mtp, max_batch_size=2, max_length=32, compile=False)
    ids, mask, pixels = image_prompt(batch, batch)
    reference = greedy(target, ids, mask, pixel_values=pixels)
    ours = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None,
                           pixel_values=pixels, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(ours, reference)
    assert not torch.equal(reference, greedy(target, ids, mask, pixel_values=pixels.flip(0)))  # the image matters
    out = speculative_generate(target, drafter, ids, mask, max_new_tokens=MAX_NEW, pixel_values=pixels)
    assert torch.equal(out.sequences, reference)
    ids, mask, audio = audio_prompt(batch, batch)
    reference = greedy(target, ids, mask, audio_input_ids=audio)
    ours = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None,
                           audio_input_ids=audio, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(ours, reference)
    out = speculative_generate(target, drafter, ids, mask, max_new_tokens=MAX_NEW, audio_input_ids=audio)
    assert torch.equal(out.sequences, reference)


class Recording:
    """Wraps a drafter and records the keyword arguments of every ``draft`` call."""

    def __init__(self, drafter):
        self.drafter, self.calls = drafter, []

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def draft(self, input_ids, positions, hidden, **kwargs):
        self.calls.append((input_ids.clone(), {k: v for k, v in kwargs.items() if k == "inputs_embeds"}))
        return self.drafter.draft(input_ids, positions, hidden, **kwargs)


def target_rows(target, call):
    """The rows the target's language model read in the first (prefill) forward of ``call()``."""
    seen = []
    hook = target.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["inputs_embeds"].clone()), with_kwargs=True)
    try:
        call()
    finally:
        hook.remove()
    return seen[0]


@pytest.mark.floor
def test_the_drafters_prefill_reads_the_targets_merged_rows(tiny_mm):
    target, mtp = tiny_mm
    drafter = Recording(Drafter(mtp, max_batch_size=2, max_length=32, compile=False))
    ids, mask, pixels = image_prompt(5, 2)
    theirs = target_rows(target, lambda: greedy(target, ids, mask, pixel_values=pixels))
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None,
                          pixel_values=pixels, custom_generate=custom_generate, drafter=drafter)
    prefill_ids, prefill = drafter.calls[0]
    rows = prefill["inputs_embeds"]
    assert torch.equal(rows[:, :-1], theirs[:, 1:])  # depth 0 at row t reads the target's row of t + 1
    first = out[:, ids.shape[1]:ids.shape[1] + 1]
    assert torch.equal(rows[:, -1:], target.get_input_embeddings()(first))  # then x_L, a text token
    image = prefill_ids[:, :-1] == IMAGE
    assert image.sum() == pixels.shape[0]
    placeholder = target.get_input_embeddings()(torch.tensor(IMAGE))
    assert not torch.isclose(rows[:, :-1][image], placeholder, atol=1e-3).all(dim=-1).any()  # not the id's row
    assert torch.equal(merged_rows(target, ids, pixel_values=pixels), theirs)
    assert all(not kwargs for _, kwargs in drafter.calls[1:])  # K = 2: decode rounds feed token ids


def test_k8_rerun_rows_that_reach_back_into_the_prompt(tiny8_target_and_mtp):
    """K = 8: the first rounds re-run up to seven stored rows, some reading image rows of the prompt; those rounds
    are given rows too, the stored rows' from the drafter's own history (eager, same output as generate)."""
    target, mtp = tiny8_target_and_mtp
    drafter = Recording(Drafter(mtp, max_batch_size=2, max_length=40, compile=False))
    ids, mask, pixels = image_prompt(2, 2, patches=4, text=1)
    reference = greedy(target, ids, mask, pixel_values=pixels)
    ours = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None,
                           pixel_values=pixels, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(ours, reference)
    with_rows = [bool(kwargs) for _, kwargs in drafter.calls]
    assert with_rows[:2] == [True, True] and not with_rows[-1]


@pytest.mark.slow  # the rows' steps compile (~40 s on 2 cores); the K = 8 drafter is the session's
def test_compiled_drafter_takes_image_prompts_without_a_recompile(compiled_k8, tiny8_target_and_mtp):
    drafter, _ = compiled_k8
    target, _ = tiny8_target_and_mtp
    frames = torch._dynamo.utils.counters["frames"]
    for seed in (0, 1):
        ids, mask, pixels = image_prompt(seed, 2, patches=3, text=7)  # the rounds re-run no image row
        reference = greedy(target, ids, mask, pixel_values=pixels)
        before = dict(frames)
        ours = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None,
                               pixel_values=pixels, custom_generate=custom_generate, drafter=drafter)
        assert torch.equal(ours, reference)
    assert dict(frames) == before  # the second prompt ran the graphs the first one compiled


def test_rows_are_given_while_a_rerun_row_reads_a_tower_row(tiny8_target_and_mtp):
    """How long the decode rounds get rows: never when K - 2 text tokens follow the image, else until the frontier
    has moved past it."""
    target, mtp = tiny8_target_and_mtp
    for text, expected in ((6, [True, False]), (1, [True, True])):
        drafter = Recording(Drafter(mtp, max_batch_size=1, max_length=40, compile=False))
        ids, mask, pixels = image_prompt(3, 1, patches=2, text=text)
        target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None,
                        pixel_values=pixels, custom_generate=custom_generate, drafter=drafter)
        assert [bool(kwargs) for _, kwargs in drafter.calls[:2]] == expected, text


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # its patches in the vision tower's dtype
def test_cli_decodes_an_image_and_audio_prompt(capsys, dtype):
    code = generate_cli(["--no-compile", "--no-warmup", "--check", "--batch", "2", "--ragged", "--prompt-len", "6",
                         "--max-new-tokens", "4", "--ignore-eos", "--image", "3", "--audio", "2", "--dtype", dtype])
    printed = capsys.readouterr().out
    assert code == 0 and "greedy generate() match: True" in printed and "image patches 3, audio frames 2" in printed


@pytest.mark.parametrize("inputs, match", [
    (dict(pixel_values=torch.randn(3, *PATCH).double()), r"pixel_values must be a torch.float32 tensor on cpu of "
                                                         r"shape \[patches, 2, 2, 2, 3\].*got a torch.float64"),
    (dict(pixel_values=torch.randn(3, 2, 4, 2, 3)), r"pixel_values must be .* got .* of shape \[3, 2, 4, 2, 3\]"),
    (dict(pixel_values=[1.0]), r"pixel_values must be .* got list"),
    (dict(pixel_values=torch.full((3, *PATCH), float("nan"))), "pixel_values hold a NaN or inf"),
    (dict(audio_input_ids=torch.full((1, 3, 4), 8)), r"audio_input_ids hold id 8, outside the codebook \[0, 8\)"),
    (dict(audio_input_ids=torch.zeros(1, 3, 4)), "audio_input_ids must be an integer tensor, got torch.float32"),
    (dict(audio_input_ids=torch.zeros(1, 3, 5, dtype=torch.long)), r"shape \[audios, frames, 4\]"),
    (dict(audio_input_ids=torch.zeros(1, 3, 4, dtype=torch.long), audio_input_ids_mask=torch.ones(1, 2)),
     r"audio_input_ids_mask must be a 0 / 1 tensor of shape \[1, 3\]"),
    (dict(audio_input_ids_mask=torch.ones(1, 3)), "audio_input_ids_mask was given without audio_input_ids"),
    (dict(mm_encoder_outputs="image"), "mm_encoder_outputs must be a dict"),
    (dict(mm_encoder_outputs={"image": torch.randn(3, 64)}), r"mm_encoder_outputs\['image'\] must be the target's "
                                                            r"vision output.* got a torch.float32 tensor on cpu of "
                                                            r"shape \[3, 64\]"),
    (dict(mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=torch.randn(6, 1, 32))}),
     r"pooler_output a floating-point tensor \[patches, 1, 64\]\), got one whose pooler_output is a torch.float32 "
     r"tensor on cpu of shape \[6, 1, 32\]"),
    (dict(mm_encoder_outputs={"audio": torch.randn(3, 64)}), r"mm_encoder_outputs takes only the key 'image' .*got "
                                                            r"\['audio'\]"),
    (dict(mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=torch.full((6, 1, 64), math.nan))}),
     r"the image features \(mm_encoder_outputs\['image'\]\.pooler_output, which generate encodes from "
     r"pixel_values\) hold a NaN or inf"),
    (dict(pixel_values=torch.randn(0, *PATCH)), r"pixel_values hold no patches \(shape \[0, \.\.\.\]\)"),  # a reshape
])
def test_media_the_towers_cannot_take_are_refused_by_name(tiny_mm, inputs, match):
    """Each was an error from inside the towers (an index error; a CUDA device assert) or the merge (an
    AttributeError for a bare image tensor), garbage tokens (a NaN patch), or silently ignored (a mask alone, an
    audio key in mm_encoder_outputs). generate hands mm_encoder_outputs to custom_generate as given."""
    target, mtp = tiny_mm
    ids, mask, _ = image_prompt(0)
    drafter = Drafter(mtp, 1, 64, compile=False)
    with pytest.raises(ArgumentError, match=match):
        speculative_generate(target, drafter, ids, mask, max_new_tokens=2, **inputs)
    if "mm_encoder_outputs" in inputs:
        with pytest.raises(ArgumentError, match=match):
            target.generate(ids, attention_mask=mask, max_new_tokens=2, custom_generate=custom_generate,
                            drafter=drafter, **inputs)


def test_a_text_only_drafter_is_refused_for_an_image_prompt_before_any_model_call(tiny_mm):
    """DraftSource lets a text-only drafter leave inputs_embeds out of draft(): with an image prompt that was a
    TypeError from its draft call, after the towers and the target's prefill had run."""
    target, _ = tiny_mm
    ids, mask, pixels = image_prompt(0)
    hook = target.register_forward_pre_hook(lambda *args: pytest.fail("the target ran"))
    try:
        for run in (lambda: speculative_generate(target, StandInDrafter(500), ids, mask, max_new_tokens=2,
                                                 pixel_values=pixels),
                    lambda: target.generate(ids, attention_mask=mask, pixel_values=pixels, max_new_tokens=2,
                                            custom_generate=custom_generate, drafter=StandInDrafter(500))):
            with pytest.raises(ArgumentError, match=r"an image or audio prompt needs a drafter whose draft takes "
                                                 r"inputs_embeds .*; StandInDrafter.draft does not"):
                run()
    finally:
        hook.remove()


def test_a_bf16_targets_media_are_checked_against_its_towers():
    """A bf16 target keeps some tensors in float32 (its short convolutions): the patches' dtype is the vision
    tower's."""
    target = synthetic.load_hf_target(synthetic.cached_checkpoint("tiny"), dtype=torch.bfloat16)
    ids, _, pixels = image_prompt(0)
    assert merged_rows(target, ids, pixel_values=pixels.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ArgumentError, match="pixel_values must be a torch.bfloat16 tensor"):
        merged_rows(target, ids, pixel_values=pixels)
