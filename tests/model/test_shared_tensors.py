"""Tensors shared with the target (loaded with ``target=``) and module conversions, in both directions.

The MTP holds the target's own embedding, embed_norm and LM head Parameters. Converting the MTP must not convert them
behind the target's back (it raises, changing nothing, unless the conversion leaves them as they are); converting
the target leaves the MTP half-converted, which the Drafter and the validated forward refuse, naming the tensors.
"""

import copy
import pickle

import pytest
import torch

from inkling_compiled import InklingMTP
from inkling_compiled.runtime import Drafter
from inkling_compiled.testing import synthetic

SHARED = ("embed_weight", "embed_norm_weight", "lm_head_weight")


@pytest.fixture(scope="module")
def path():
    return synthetic.cached_checkpoint("tiny")


@pytest.fixture
def target(path):
    return synthetic.load_hf_target(path)


def rows(mtp, length=4):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (1, length), generator=gen)
    hidden = torch.randn(1, length, mtp.config.hidden_size, generator=gen).to(mtp.dtype)
    return ids, torch.arange(length)[None], hidden


def target_logits(target, ids):
    with torch.no_grad():
        return target(input_ids=ids).logits


@pytest.mark.parametrize("convert", [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double(),
                                     lambda m: m.to("meta")], ids=["to_bf16", "half", "double", "to_meta"])
def test_converting_a_sharing_mtp_raises_and_changes_nothing(path, target, convert):
    mtp = InklingMTP.from_pretrained(path, target=target)
    ids = rows(mtp)[0]
    before = target_logits(target, ids)
    with pytest.raises(ValueError, match=r"would change embed_weight \(torch\.float32 on cpu -> .*\), "
                                         r"embed_norm_weight .*lm_head_weight .*shares with its target.*"
                                         r"Convert the target instead and re-load the MTP"):
        convert(mtp)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in mtp.parameters())  # nothing converted
    theirs = (target.get_input_embeddings().weight, target.get_input_embeddings().embed_norm.weight,
              target.get_output_embeddings().weight)
    assert all(getattr(mtp, name) is p for name, p in zip(SHARED, theirs))  # still shared
    assert torch.equal(target_logits(target, ids), before)  # the target still runs, unchanged


@pytest.mark.parametrize("convert", [lambda m: m.to(torch.float32), lambda m: m.float(), lambda m: m.to("cpu"),
                                     lambda m: m.cpu()], ids=["to_fp32", "float", "to_cpu", "cpu"])
def test_conversions_that_change_no_shared_tensor_pass(path, target, convert):
    mtp = InklingMTP.from_pretrained(path, target=target)
    assert convert(mtp) is mtp
    assert mtp.lm_head_weight is target.get_output_embeddings().weight
    mtp(*rows(mtp))


def test_an_mtp_that_owns_its_tensors_converts_as_usual(path, target):
    mtp = InklingMTP.from_pretrained(path).to(torch.bfloat16)
    assert {p.dtype for p in mtp.parameters()} == {torch.bfloat16}
    mtp(*rows(mtp))
    # a copy of a sharing MTP owns copies of the tensors: it converts, and the target keeps its own
    shared = InklingMTP.from_pretrained(path, target=target)
    for other in (copy.deepcopy(shared), pickle.loads(pickle.dumps(shared))):
        other.to(torch.bfloat16)
        assert {p.dtype for p in other.parameters()} == {torch.bfloat16}
    assert target.get_input_embeddings().weight.dtype == torch.float32


def test_converting_the_target_first_then_the_mtp_works(path, target):
    mtp = InklingMTP.from_pretrained(path, target=target)
    target.to(torch.bfloat16)
    mtp.to(torch.bfloat16)  # the shared tensors are already bf16: only the MTP's own are converted
    assert {p.dtype for p in mtp.parameters()} == {torch.bfloat16}
    assert mtp.embed_weight is target.get_input_embeddings().weight
    ids, positions, hidden = rows(mtp)
    Drafter(mtp, max_batch_size=1, max_length=8, compile=False, num_speculative_tokens=1).draft(ids, positions, hidden)
    target_logits(target, ids)


def test_a_target_converted_after_sharing_is_refused_naming_the_tensors(path, target):
    mtp = InklingMTP.from_pretrained(path, target=target)
    built_before = Drafter(mtp, max_batch_size=1, max_length=8, compile=False, num_speculative_tokens=1)
    target.to(torch.bfloat16)
    ids, positions, hidden = rows(mtp)
    mixed = (r"the MTP's parameters are not all of one dtype on one device \(torch\.bfloat16 on cpu: embed_weight, "
             r"embed_norm_weight, lm_head_weight; torch\.float32 on cpu: layers\.0\.hidden_norm\.weight, .* more\)\. "
             r"Was the target converted after loading\?")
    with pytest.raises(ValueError, match=mixed):
        Drafter(mtp, max_batch_size=1, max_length=8, compile=False, num_speculative_tokens=1)
    with pytest.raises(ValueError, match=mixed):
        mtp(ids, positions, hidden.float())
    with pytest.raises(ValueError, match=mixed):  # not "the model is now bf16 ... build a new Drafter": it was not
        built_before.draft(ids, positions, hidden)
