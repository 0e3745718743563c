"""The packaged round cached on disk (runtime/round_cache.py, docs/compile.md §12.1): a K > 1 CPU drafter builds it on
its first call of a (batch bucket, greedy/sampled), and that one entry serves every window width (rows dynamic);
a second process reuses it with no compile and without importing Dynamo, Inductor or transformers (so does
``Drafter.load_compiled`` of the entry); an entry that differs in any recorded field is refused and rebuilt; and it
drafts as the eager model does over a prompt and 64 rounds with every accepted count (the compiled round against the
eager one: tests/runtime/test_drafter_depths.py).

One entry is built per module and shared: K = 3 over three sliding depths of a checkpoint directory, batch 1,
greedy, serving the prompt's window (six rows: eight, padded) and both decode windows (three and four rows): the
prologue and one depth step, two AOTInductor compiles. The rebuild test swaps the build for a copy of that entry,
so it compiles nothing. A sampled entry (two compiles more, `slow`) draws as the eager model does from one seed."""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inkling_compiled import InklingMTP
from inkling_compiled.arguments import ArgumentError
from inkling_compiled.runtime import Drafter, packaged, round_cache
from inkling_compiled.testing.synthetic import cached_checkpoint

REPO = Path(__file__).resolve().parents[2]
K, MAX_LENGTH, ROUNDS, PROMPT = 3, 192, 64, 6
ENTRY = (1, False)  # (batch bucket, sampled)
ROWS = (K, 256)  # the widths it serves: K to the power of two at or above MAX_LENGTH
SERVED = tuple((1, w, False) for w in (3, 4, 8, 16, 32, 64, 128, 256))  # the decode windows and the powers of two
HEAVY = ("torch._dynamo", "torch._inductor", "transformers")


def checkpoint() -> Path:
    return cached_checkpoint("tiny", num_mtp_layers=K, local_layer_ids=tuple(range(K)))


def peaked_model() -> InklingMTP:
    """The checkpoint's MTP with a peaked head: drafts are no near-ties, so a wrong input changes them."""
    model = InklingMTP.from_pretrained(checkpoint())
    model.lm_head_weight.mul_(30.0)
    return model


def decode(drafter: Drafter, rounds: int = ROUNDS, temperature: float = 0.0) -> list[list[int]]:
    """The drafts of a prompt of ``PROMPT`` rows and then ``rounds - 1`` rounds, a + 1 new rows after a round that
    accepted a drafts, a = 0..K in turn, over one seeded stream of committed rows (sampled at ``temperature`` > 0
    from one seeded generator)."""
    rows_per_round = [PROMPT] + [1 + i % (K + 1) for i in range(ROUNDS - 1)]
    length = sum(rows_per_round)  # one stream whatever ``rounds``: the first rounds of any run see the same rows
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, drafter.model.config.logits_vocab_size, (1, length), generator=gen)
    hidden = torch.randn(1, length, drafter.model.config.hidden_size, generator=gen)
    positions = torch.arange(length)[None]
    drafts, start, sampler = [], 0, torch.Generator().manual_seed(7)
    with torch.no_grad():
        for rows in rows_per_round[:rounds]:
            part = slice(start, start + rows)
            drafts.append(drafter.draft(ids[:, part], positions[:, part], hidden[:, part], temperature=temperature,
                                        generator=sampler).drafts[0].tolist())
            start += rows
    return drafts


def cached_drafter(model: InklingMTP) -> Drafter:
    return Drafter(model, 1, MAX_LENGTH, num_speculative_tokens=K)


@pytest.fixture(scope="module")
def rounds_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("rounds")


@pytest.fixture(autouse=True)
def cache_in(rounds_dir, monkeypatch):
    monkeypatch.setenv(round_cache.ENV_VAR, str(rounds_dir))


@pytest.fixture(scope="module")
def model():
    return peaked_model()


@pytest.fixture(scope="module")
def built(model, rounds_dir):
    """(the drafter that built the entry, its drafts, the entry's directory)."""
    from torch._inductor import config as inductor_config  # here: the second process imports this module

    config = inductor_config.get_config_copy()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(round_cache.ENV_VAR, str(rounds_dir))
        drafter = cached_drafter(model)
        drafts = decode(drafter)
    # left as it was found: a changed Inductor config makes every later compile of the process miss the FX graph cache
    assert {k: v for k, v in inductor_config.get_config_copy().items() if v != config[k]} == {}
    entries = [p for p in rounds_dir.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and drafter.packaged_buckets == SERVED  # one entry for the three widths met, and more
    return drafter, drafts, entries[0]


def test_one_cached_round_drafts_as_the_eager_model_at_every_width_over_64_rounds_and_every_accepted_count(model,
                                                                                                          built):
    drafter, drafts, entry = built
    assert entry.name == round_cache.entry_name(drafter, ENTRY)
    layout = json.loads((entry / packaged.MANIFEST).read_text())["layout"]
    assert layout["buckets"] == [[1, K, False]] and layout["rows"] == list(ROWS)
    assert {drafter.bucket(1, rows)[1] for rows in (PROMPT, *range(1, K + 2))} == {8, K, K + 1}
    eager = Drafter(model, 1, MAX_LENGTH, num_speculative_tokens=K, compile=False)
    assert decode(eager) == drafts
    assert eager.packaged_buckets == ()
    for theirs, ours in zip(eager.cache.depths, drafter.cache.depths, strict=True):
        for a, b in zip(theirs.tensors(), ours.tensors()):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0, equal_nan=True)


_SECOND_PROCESS = """
import json, sys, torch
from tests.runtime.test_cached_round import HEAVY, cached_drafter, decode, peaked_model
from inkling_compiled.runtime import Drafter
torch.set_num_threads(int(sys.argv[2]))  # the entry's CPU kernels keep the count they were built with: part of its key
model = peaked_model()
drafter = cached_drafter(model)
cached = decode(drafter, 8)
loaded = Drafter.load_compiled(sys.argv[1], peaked_model())
print(json.dumps({"cached": cached, "loaded": decode(loaded, 8), "buckets": [drafter.packaged_buckets,
                  loaded.packaged_buckets], "heavy": [m for m in HEAVY if m in sys.modules]}))
"""


@pytest.mark.slow  # its own entry: two more AOTInductor compiles
def test_a_sampled_entry_draws_as_the_eager_model_from_the_same_generator(model, tmp_path, monkeypatch):
    """Sampling has its own entry (the round takes the noise and 1 / temperature as inputs); it consumes the
    generator as the eager round does, so one seed gives the same drafts. At temperature 30 the peaked head's x 30
    is undone: real draws, not the argmax."""
    monkeypatch.setenv(round_cache.ENV_VAR, str(tmp_path))
    drafter = cached_drafter(model)
    drafts = decode(drafter, 16, temperature=30.0)
    assert [p.name for p in tmp_path.iterdir()] == [round_cache.entry_name(drafter, (1, True))]
    assert drafter.packaged_buckets == tuple((1, w, True) for _, w, _ in SERVED)
    assert round_cache.missing(drafter, sampled=True) == [] and round_cache.missing(drafter) == [1]
    eager = Drafter(model, 1, MAX_LENGTH, num_speculative_tokens=K, compile=False)
    assert decode(eager, 16, temperature=30.0) == drafts
    assert drafts != decode(eager, 16)


def test_a_second_process_reuses_the_entry_with_no_compile_and_no_compiler_or_transformers_imported(built,
                                                                                                    rounds_dir):
    _, drafts, entry = built
    manifest = (entry / packaged.MANIFEST).stat().st_mtime_ns
    env = {**os.environ, round_cache.ENV_VAR: str(rounds_dir), "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-c", _SECOND_PROCESS, str(entry), str(torch.get_num_threads())]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["heavy"] == []  # no Dynamo, no Inductor: nothing was compiled, and no transformers either
    assert found["buckets"] == [[list(key) for key in SERVED]] * 2
    assert found["cached"] == found["loaded"] == drafts[:8]
    assert (entry / packaged.MANIFEST).stat().st_mtime_ns == manifest  # read, not rebuilt
    assert [p.name for p in rounds_dir.iterdir() if not p.name.startswith(".")] == [entry.name]


def _edit(entry: Path, edit) -> None:
    manifest = json.loads((entry / packaged.MANIFEST).read_text())
    edit(manifest)
    (entry / packaged.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("field", packaged.BUILT_FOR)
def test_an_entry_recorded_for_anything_else_is_refused_naming_it(built, tmp_path, field):
    drafter, _, entry = built
    copy = shutil.copytree(entry, tmp_path / entry.name)
    assert round_cache.refusal(drafter, ENTRY, copy) is None

    def edit(manifest):
        manifest["built_for"][field] = "something else"

    _edit(copy, edit)
    assert field in round_cache.refusal(drafter, ENTRY, copy)


DAMAGES = {
    "torch": lambda entry: _edit(entry, lambda m: m["built_for"].update(torch="0.0")),
    "layout": lambda entry: _edit(entry, lambda m: m["layout"].update(max_length=MAX_LENGTH + 1)),
    "rows": lambda entry: _edit(entry, lambda m: m["layout"].update(rows=[K, 128])),
    "threads": lambda entry: _edit(entry, lambda m: m.update(threads=m["threads"] + 1)),
    "step file": lambda entry: next(entry.glob("*.pt2")).write_bytes(b"not a package"),
    "manifest": lambda entry: (entry / packaged.MANIFEST).write_text("{"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_refused_or_damaged_entry_is_removed_and_rebuilt(model, built, tmp_path, monkeypatch, caplog, damage):
    _, drafts, entry = built
    monkeypatch.setenv(round_cache.ENV_VAR, str(tmp_path))
    DAMAGES[damage](shutil.copytree(entry, tmp_path / entry.name))
    builds = []

    def rebuild(drafter, directory, buckets, rows, cache):  # the build, without its two AOTInductor compiles
        builds.append(([b.key for b in buckets], rows, cache))
        return shutil.copytree(entry, directory)

    monkeypatch.setattr(packaged, "save_rounds", rebuild)
    drafter = cached_drafter(model)
    with caplog.at_level(logging.INFO, logger=round_cache.__name__):
        assert decode(drafter, 8) == drafts[:8]
        decode(cached_drafter(model), 8)  # the rebuilt entry is reused: nothing more is built, nothing logged
    # once, for every width; a concurrent builder's entry would serve as well (packaged.save's cache)
    assert builds == [([(1, K, False)], ROWS, True)] and drafter.packaged_buckets == SERVED
    started, ended = caplog.records  # the build is logged when it starts and, with its seconds, when it ends
    assert f"packaging the K = {K} round of batch bucket 1 (greedy, 3 to 256 rows)" in started.getMessage()
    assert ended.build_s >= 0 and "packaged the round of batch bucket 1 (greedy) in" in ended.getMessage()
    assert round_cache.refusal(drafter, ENTRY, tmp_path / entry.name) is None  # the new entry in the stale one's place
    assert sorted(p.name for p in tmp_path.iterdir()) == [entry.name]  # nothing else left behind


def test_a_failed_build_warns_and_runs_the_compiled_round(model, built, tmp_path, monkeypatch):
    _, drafts, _ = built
    monkeypatch.setenv(round_cache.ENV_VAR, str(tmp_path))

    tried = []

    def broken(drafter, directory, buckets, rows, cache):
        tried.append(rows)
        raise OSError("no space left on device")

    monkeypatch.setattr(packaged, "save_rounds", broken)
    drafter = cached_drafter(model)
    with pytest.warns(RuntimeWarning, match=r"no space left on device.*running the compiled round instead"):
        assert decode(drafter, 8) == drafts[:8]
    assert drafter.packaged_buckets == ()
    assert len(tried) == 1  # the prompt's width failed: the decode widths of that batch bucket do not try again


@pytest.mark.parametrize("k, max_length, expected", [(3, 160, (3, 256)), (3, 512, (3, 512)), (1, 64, (2, 64)),
                                                     (3, 3, (3, 4)), (2, 2, (2, 2))])
def test_an_entry_serves_k_rows_up_to_the_widest_call_and_only_widths_a_call_runs_as(model, k, max_length,
                                                                                    expected):
    drafter = Drafter(model, 1, max_length, num_speculative_tokens=k, compile=False)
    assert round_cache.rows_range(drafter) == expected  # from 2 at K = 1: export specializes a dim of one
    low, high = expected
    assert packaged.widths(drafter, expected) == sorted({drafter.bucket(1, r)[1] for r in range(1, high + 1)}
                                                        - set(range(low)))


def test_the_cache_is_off_by_default_for_k_1_and_by_the_switch(model, monkeypatch):
    assert not Drafter(model, 1, MAX_LENGTH, num_speculative_tokens=1).cached_rounds
    assert Drafter(model, 1, MAX_LENGTH).cached_rounds
    assert not Drafter(model, 1, MAX_LENGTH, compile=False).cached_rounds
    monkeypatch.setenv(round_cache.ENV_VAR, "off")
    assert round_cache.cache_root() is None
    monkeypatch.setenv(round_cache.ENV_VAR, "~/rounds")  # quoted, so no shell expanded it: not ./~/rounds
    assert round_cache.cache_root() == Path.home() / "rounds"
    with pytest.raises(ArgumentError, match=r"cached_rounds must be a bool or None, got 'yes'"):
        Drafter(model, 1, MAX_LENGTH, cached_rounds="yes")


def test_missing_refuses_what_is_not_a_drafter_or_a_bool(model):
    """Not an AttributeError from inside, nor "yes" taken as sampled=True."""
    with pytest.raises(ArgumentError, match=r"drafter must be a Drafter, got str"):
        round_cache.missing("x")
    with pytest.raises(ArgumentError, match=r"sampled must be a bool, got 'yes'"):
        round_cache.missing(cached_drafter(model), sampled="yes")


def test_missing_names_the_batch_buckets_a_first_call_would_build(model, built, tmp_path, monkeypatch):
    assert round_cache.missing(cached_drafter(model)) == []  # built's entry serves batch bucket 1, greedy
    assert round_cache.missing(cached_drafter(model), sampled=True) == [1]
    monkeypatch.setenv(round_cache.ENV_VAR, str(tmp_path))
    assert round_cache.missing(Drafter(model, 4, MAX_LENGTH, num_speculative_tokens=K, batch_buckets=(1, 2))) == [
        1, 2, 4]
    assert round_cache.missing(Drafter(model, 1, MAX_LENGTH, num_speculative_tokens=1)) == []  # uses no cache
    monkeypatch.setenv(round_cache.ENV_VAR, "off")
    assert round_cache.missing(cached_drafter(model)) == []
