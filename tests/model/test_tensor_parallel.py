"""Tensor-parallel draft head (docs/model.md §11) on 2 and 4 gloo ranks against the unsharded model, in one spawn per
world size: every depth over a cached stream (fp32, 1e-5), greedy tokens with ties and padded ids, the drafter's
rounds, and lossless speculative generation (greedy and sampled) equal on every rank to the unsharded run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from inkling_compiled import InklingMTP
from inkling_compiled.arguments import ArgumentError
from inkling_compiled.checkpoint import raw_key
from inkling_compiled.generate import main as generate_cli
from inkling_compiled.model import tensor_parallel
from inkling_compiled.model.tensor_parallel import TARGET_TP_PLAN, TensorParallel, checksum
from inkling_compiled.runtime import Drafter, custom_generate, speculative_generate
from inkling_compiled.runtime.packaged import PackageMismatch
from inkling_compiled.testing.distributed import run_ranks
from inkling_compiled.testing.synthetic import greedy_generation_config, load_hf_target, tiny_config, write_checkpoint

# tiny, with 4 query and 4 KV heads on both depth geometries so that 4 ranks hold one whole head each
TP_HEADS = dict(num_attention_heads=4, num_key_value_heads=4, swa_num_attention_heads=4, swa_num_key_value_heads=4,
                head_dim=16, swa_head_dim=16)
TOL = dict(atol=1e-5, rtol=1e-5)
MAX_LENGTH = 12


@pytest.fixture(scope="module")
def tp_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "ckpt"
    write_checkpoint(path, tiny_config(**TP_HEADS))
    return path


def _stream(config, gen):
    """A cached stream: a 6-row prefill (one sequence left-padded), then decode calls of 1 and 2 rows."""
    batch, h = 2, config.hidden_size
    calls, start = [], 0
    for rows in (6, 1, 2, 1, 2):
        positions = torch.arange(start, start + rows).expand(batch, rows).clone()
        calls.append((torch.randint(0, config.logits_vocab_size, (batch, rows), generator=gen), positions,
                      torch.randn(batch, rows, h, generator=gen)))
        start += rows
    calls[0][1][1, :2] = MAX_LENGTH  # padding rows of sequence 1, at the cache's scratch slot
    return calls


def _integer_head(config, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """(head [V, H], hidden [64, H]) whose logits are small exact integers: ties everywhere, and a tied best row in
    two shards (ids 10 and V - 40); padded rows that would win every row if they were not masked."""
    v, h, kept = config.vocab_size, config.hidden_size, config.logits_vocab_size
    head = torch.randint(-1, 2, (v, h), generator=gen).float()
    head[v - 40] = head[10]
    head[kept:] = 2.0
    hidden = torch.randint(0, 2, (64, h), generator=gen).float()
    hidden[:8] = head[10].clamp(min=0)  # rows 10 and V - 40 both give the largest logit
    return head, hidden * config.mup


def _checks(mesh, path) -> dict:
    full = InklingMTP.from_pretrained(path)
    tp = InklingMTP.from_pretrained(path, device_mesh=mesh)
    rank = mesh.get_local_rank()
    config, gen = full.config, torch.Generator().manual_seed(0)
    result = {}

    # every depth over one cached stream, and without a cache
    caches = full.new_cache(2, MAX_LENGTH), tp.new_cache(2, MAX_LENGTH)
    for step, (ids, positions, hidden) in enumerate(_stream(config, gen)):
        for depth in range(config.num_depths):
            want, got = (m(ids, positions, hidden, cache, depth) for m, cache in zip((full, tp), caches))
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, s=step, d=depth: f"step {s} depth {d}: {m}")
            torch.testing.assert_close(tp.compute_logits(got), full.compute_logits(got), **TOL)
            assert torch.equal(tp.get_top_tokens(want), full.get_top_tokens(want))
    stateless = torch.randint(0, config.logits_vocab_size, (2, 7), generator=gen), torch.arange(7).expand(2, 7)
    hidden = torch.randn(2, 7, config.hidden_size, generator=gen)
    for depth in range(config.num_depths):
        torch.testing.assert_close(tp(*stateless, hidden, depth=depth), full(*stateless, hidden, depth=depth), **TOL)
    result["head_rows"] = tp.lm_head_weight.shape[0]

    # greedy tokens: exact ties across shards and padded ids, as the one-process argmax
    head, top_hidden = _integer_head(config, gen)
    full.lm_head_weight.data.copy_(head)
    tp.lm_head_weight.data.copy_(tp.parallel.shards(config)["lm_head_weight"].take(head))
    logits = top_hidden.double() @ head.double().T / config.mup
    reference = logits[:, : config.logits_vocab_size].argmax(dim=-1)
    ties = (logits[:, : config.logits_vocab_size] == logits[:, : config.logits_vocab_size].amax(-1, keepdim=True))
    result["tied_rows"] = int((ties.sum(-1) > 1).sum())
    result["cross_shard_tie"] = bool(ties[:8, 10].all() and ties[:8, config.vocab_size - 40].all())
    for shape in ((64,), (8, 8), (2, 4, 8)):
        x = top_hidden.view(*shape, -1)
        assert torch.equal(tp.get_top_tokens(x), reference.view(shape)), shape
        assert torch.equal(full.get_top_tokens(x), reference.view(shape)), shape
    result["top_tokens"] = tp.get_top_tokens(top_hidden)
    return result | {"rank": rank, **_decoding(mesh, path)}


def _decoding(mesh, path) -> dict:
    """The drafter's rounds (K = 2: the window prologue) and speculative generation, unsharded vs sharded."""
    target = load_hf_target(path)
    target.generation_config.eos_token_id = None
    full = InklingMTP.from_pretrained(path, target=target)
    tp = InklingMTP.from_pretrained(path, target=target, device_mesh=mesh)
    start, stop = tp.parallel.vocab_rows(tp.config)
    assert tp.lm_head_weight.data_ptr() == target.lm_head.weight[start].data_ptr()  # a view: no copy
    assert tp.embed_weight is target.get_input_embeddings().weight
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(8, tp.config.logits_vocab_size, (2, 9), generator=gen)
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0
    out = {}
    drafters = [Drafter(m, 2, 40, compile=False) for m in (full, tp)]
    for temperature in (0.0, 0.8):
        runs = [speculative_generate(target, d, prompts, mask, max_new_tokens=12, temperature=temperature,
                                     generator=torch.Generator().manual_seed(7)) for d in drafters]
        assert torch.equal(runs[1].sequences, runs[0].sequences), temperature
        assert runs[1].accepted_per_round == runs[0].accepted_per_round
        out[f"sequences@{temperature}"] = runs[1].sequences
    reference = target.generate(prompts, attention_mask=mask, generation_config=greedy_generation_config(target, 12))
    assert torch.equal(out["sequences@0.0"], reference)
    rows = torch.randint(0, tp.config.logits_vocab_size, (2, 3), generator=gen), torch.arange(3).expand(2, 3)
    hidden = torch.randn(2, 3, tp.config.hidden_size, generator=gen)
    for temperature in (0.0, 0.8):
        results = [d.draft(*rows, hidden, temperature=temperature, generator=torch.Generator().manual_seed(3))
                   for d in drafters]
        assert torch.equal(results[1].drafts, results[0].drafts)
        torch.testing.assert_close(results[1].hidden, results[0].hidden, **TOL)
        if temperature:
            torch.testing.assert_close(results[1].draft_probs, results[0].draft_probs, **TOL)
    # as in a fresh process whose first agreement runs under inference mode: the buffer it keeps is written again
    # outside it (an inference tensor made there refused that for good)
    tensor_parallel._EXCHANGES.clear()
    with torch.inference_mode():
        inside = tp(*rows, hidden)
    torch.testing.assert_close(tp(*rows, hidden), inside, **TOL)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_equals_unsharded(tp_checkpoint, world_size):
    results = run_ranks(_checks, world_size, tp_checkpoint, timeout=240)
    assert [r["rank"] for r in results] == list(range(world_size))
    first = results[0]
    assert first["tied_rows"] > 8 and first["cross_shard_tie"]  # the tie cases are really there
    for r in results[1:]:  # every rank returns the same tokens
        for key in ("top_tokens", "sequences@0.0", "sequences@0.8"):
            assert torch.equal(r[key], first[key]), key
    assert {r["head_rows"] for r in results} == {512 // world_size}


def _outcome(call) -> str:
    """"ok", or the exception's type and message: what a rank did with a call the ranks may disagree on."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test reads the outcome
        return f"{type(e).__name__}: {e}"
    return "ok"


def _disagreements(mesh, path, other) -> dict:
    """Ranks that load, or pass, different things: each call below differs on rank 1 only."""
    one = mesh.get_local_rank() == 1
    out = {"load other checkpoint": _outcome(lambda: InklingMTP.from_pretrained(other if one else path,
                                                                                device_mesh=mesh)),
           "load fewer depths": _outcome(lambda: InklingMTP.from_pretrained(path, device_mesh=mesh,
                                                                            num_depths=1 if one else None)),
           "load missing path": _outcome(lambda: InklingMTP.from_pretrained(path.parent / "missing" if one else path,
                                                                            device_mesh=mesh)),
           "load quantized": _outcome(lambda: InklingMTP.from_pretrained(path, device_mesh=mesh,
                                                                         quantize="int8" if one else None))}
    target = load_hf_target(path)
    target.generation_config.eos_token_id = None
    tp = InklingMTP.from_pretrained(path, target=target, device_mesh=mesh)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tp.config.logits_vocab_size, (2, 4), generator=gen)
    positions, hidden = torch.arange(4).expand(2, 4), torch.randn(2, 4, tp.config.hidden_size, generator=gen)
    out["forward batch"] = _outcome(lambda: tp(ids[:2 if one else 1], positions[:2 if one else 1],
                                               hidden[:2 if one else 1]))
    out["forward ids"] = _outcome(lambda: tp(ids + int(one), positions, hidden))
    out["forward bad id"] = _outcome(lambda: tp(ids + 10_000 * int(one), positions, hidden))
    out["forward cache"] = _outcome(lambda: tp(ids, positions, hidden, cache=tp.new_cache(2, 8) if one else None))
    last = hidden[:, -1]
    out["logits hidden"] = _outcome(lambda: tp.compute_logits(last + int(one)))
    out["top tokens bad hidden"] = _outcome(lambda: tp.get_top_tokens(last[:, :-1] if one else last))
    out["top tokens"] = tp.get_top_tokens(last)  # the group still works
    # padding rows (negative positions) may hold anything: they reach no output
    padded_ids, padded_positions, padded_hidden = ids.clone(), positions - 2, hidden.clone()
    padded_ids[:, :2] = int(one)
    padded_hidden[:, :2] = float("nan") if one else 0.0
    drafter = Drafter(tp, 2, 16, compile=False)
    out["padding rows"] = drafter.draft(padded_ids, padded_positions, padded_hidden).drafts
    rows = ids, positions, hidden
    embeds = tp.embed_tokens(ids)
    out["draft inputs_embeds"] = _outcome(lambda: Drafter(tp, 2, 16, compile=False).draft(
        *rows, inputs_embeds=embeds + int(one)))
    out["draft temperature"] = _outcome(lambda: Drafter(tp, 2, 16, compile=False).draft(
        *rows, temperature=0.8 if one else 0.0, generator=torch.Generator().manual_seed(0)))
    out["draft K"] = _outcome(lambda: Drafter(tp, 2, 16, compile=False, num_speculative_tokens=1 if one else 2).draft(
        *rows))
    out["draft bad temperature"] = _outcome(lambda: Drafter(tp, 2, 16, compile=False).draft(
        *rows, temperature=-1.0 if one else 0.0))
    out["draft max_batch_size"] = _outcome(lambda: Drafter(tp, 1 if one else 2, 16, compile=False).draft(*rows))
    prompts = torch.randint(8, tp.config.logits_vocab_size, (2, 5), generator=gen)
    out["generate prompt"] = _outcome(lambda: speculative_generate(target, drafter, prompts + int(one),
                                                                   max_new_tokens=4))
    out["generate seed"] = _outcome(lambda: speculative_generate(
        target, drafter, prompts, max_new_tokens=4, temperature=0.8, generator=torch.Generator().manual_seed(int(one))))
    out["generate() prompt"] = _outcome(lambda: target.generate(
        prompts + int(one), attention_mask=torch.ones_like(prompts), custom_generate=custom_generate, drafter=drafter,
        generation_config=greedy_generation_config(target, 4)))
    out["sequences"] = speculative_generate(target, drafter, prompts, max_new_tokens=4).sequences  # the group works
    return out


def test_ranks_that_disagree_are_refused_on_every_rank(tp_checkpoint, tmp_path):
    """Ranks reading other checkpoints, or passing other inputs, would compute garbage together (their partial sums
    add up all the same), and a rank refusing its input would leave the others waiting in the next collective:
    every rank raises, naming the difference (or the rank that refused)."""
    other = write_checkpoint(tmp_path / "other", tiny_config(**TP_HEADS), seed=1)
    ranks = run_ranks(_disagreements, 2, tp_checkpoint, other, timeout=240)
    refused = "ArgumentError: {what}: rank(s) [1] of the tensor-parallel group refused theirs"
    differ = "ArgumentError: {what} differ between the 2 tensor-parallel ranks: "
    for got in ranks:
        assert got["load other checkpoint"].startswith(differ.format(what="the checkpoints' replicated tensors")
                                                       + "contents of embed_norm_weight; contents of embed_weight; ")
        assert got["load other checkpoint"].endswith(" more. Every rank must load the same checkpoint files.")
        assert got["load fewer depths"] == differ.format(what="the checkpoints") + (
            "contents of the config, dtype and tensor shapes. Every rank must load the same checkpoint, with the same "
            "from_pretrained options.")
        assert got["forward batch"].startswith(differ.format(what="the inputs") + "batch (rank 0: 1, rank 1: 2)")
        assert got["forward ids"] == differ.format(what="the inputs") + (
            "contents of input_ids / inputs_embeds. Every rank passes the same inputs: the ranks split the weights, "
            "not the rows.")
        assert got["generate prompt"].startswith(differ.format(what="speculative decoding's arguments")
                                                 + "contents of input_ids."), got["generate prompt"]
        assert got["generate() prompt"] == got["generate prompt"]
        assert got["forward cache"].startswith(differ.format(what="the inputs") + "cache batch_size (rank 0: 0, "
                                               "rank 1: 2); cache max_length (rank 0: 0, rank 1: 8).")
        assert got["logits hidden"] == differ.format(what="the head's hidden states") + (
            "contents of hidden. Every rank passes the same inputs: the ranks split the weights, not the rows.")
        draft = differ.format(what="the draft's inputs")
        assert got["draft inputs_embeds"].startswith(draft + "contents of inputs_embeds."), got["draft inputs_embeds"]
        assert got["draft temperature"].startswith(draft + "contents of temperature."), got["draft temperature"]
        assert got["draft K"].startswith(draft + "num_speculative_tokens (rank 0: 2, rank 1: 1)."), got["draft K"]
        assert got["generate seed"].startswith(differ.format(what="speculative decoding's arguments")
                                               + "contents of the generator's state."), got["generate seed"]
    zero, one = ranks
    assert zero["load missing path"].startswith(refused.format(what="the checkpoints"))
    assert one["load missing path"].startswith("FileNotFoundError: checkpoint directory ")
    assert zero["forward bad id"].startswith(refused.format(what="the inputs"))
    for case, own in (("load quantized", "quantize='int8' with device_mesh="), ("draft bad temperature",
                      "temperature must be 0"), ("draft max_batch_size", "exceeds the drafter's max_batch_size 1")):
        assert zero[case].startswith(refused.format(what="the draft's inputs" if "draft" in case else
                                                    "the checkpoints")), zero[case]
        assert one[case].startswith("ArgumentError: " + own) or own in one[case], one[case]
    assert one["forward bad id"].startswith("ArgumentError: token id ") and "out of range" in one["forward bad id"]
    assert zero["top tokens bad hidden"].startswith(refused.format(what="the head's hidden states"))
    assert one["top tokens bad hidden"].startswith("ArgumentError: hidden has shape (2, 63)")
    assert torch.equal(zero["top tokens"], one["top tokens"])
    assert torch.equal(zero["padding rows"], one["padding rows"])
    assert torch.equal(zero["sequences"], one["sequences"])


def test_torchrun_cli(tp_checkpoint):
    """``torchrun --nproc-per-node 2 -m inkling_compiled.generate --tp 2`` as a user runs it (gloo, loopback only)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", "inkling_compiled.generate",
               "--tp", "2", "--checkpoint", str(tp_checkpoint), "--no-compile", "--check",
               "--max-new-tokens", "6", "--batch", "2", "--ragged"]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "generated the same tokens: True" in done.stdout and "greedy generate() match: True" in done.stdout
    assert done.stdout.count("checkpoint:") == 1  # rank 0 speaks for both


def _compiled_checks(mesh, path, package_root) -> dict:
    """One depth, one bucket: the compiled round equals the eager one with no recompile over the stream, and the
    rank's AOTInductor package (its rank in the manifest) equals the compiled round."""
    model = InklingMTP.from_pretrained(path, device_mesh=mesh, num_depths=1)
    rank = mesh.get_local_rank()
    eager, compiled = (Drafter(model, 2, 16, compile=c, batch_buckets=(2,)) for c in (False, True))
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.logits_vocab_size, (2, 8), generator=gen)
    hidden = torch.randn(2, 8, model.config.hidden_size, generator=gen)
    drafts = {"eager": [], "compiled": []}
    for t in range(8):  # one row per call: one compiled step, reused at every position
        rows = ids[:, t : t + 1], torch.full((2, 1), t), hidden[:, t : t + 1]
        with torch._dynamo.config.patch(error_on_recompile=t > 0):
            for name, drafter in (("eager", eager), ("compiled", compiled)):
                result = drafter.draft(*rows)
                drafts[name].append(result.drafts)
        assert torch.equal(drafts["compiled"][-1], drafts["eager"][-1]), t
    directory = compiled.save_compiled(package_root / f"rank{rank}", batch_sizes=(2,), rows=(1,))
    loaded = Drafter.load_compiled(directory, model)
    assert loaded.packaged_buckets == ((2, 1, False),)
    # validated calls: each runs the agreement exchange right before the package's AOTInductor step, whose
    # collectives once deadlocked the ranks within a few calls (a gloo worker finishing the exchange took the GIL the
    # step holds; TensorParallel._exchange): the stream four times over, rewound to position 0 each time
    for t in [t for _ in range(4) for t in range(8)]:
        rows = ids[:, t : t + 1], torch.full((2, 1), t), hidden[:, t : t + 1]
        assert torch.equal(loaded.draft(*rows).drafts, drafts["compiled"][t]), t
    rows = ids[:, :1], torch.zeros(2, 1, dtype=torch.long), hidden[:, :1] + rank  # rank 1's hidden differs
    with pytest.raises(ArgumentError, match="the draft's inputs differ between the 2 tensor-parallel ranks: "):
        loaded.draft(*rows)  # refused on every rank: the packaged drafter compares its ranks' calls too
    other = package_root / f"rank{1 - rank}"  # the other rank's package: its shards, not ours
    dist.barrier()
    with pytest.raises(PackageMismatch, match=f"tensor_parallel 'rank {1 - rank} of 2' vs 'rank {rank} of 2'"):
        Drafter.load_compiled(other, model)
    return {"drafts": torch.cat(drafts["compiled"], 1)}


@pytest.mark.slow  # two compiles per rank (the step, its AOTInductor package): ~2 minutes on 2 cores
def test_compiled_and_packaged(tp_checkpoint, tmp_path):
    results = run_ranks(_compiled_checks, 2, tp_checkpoint, tmp_path, timeout=600)
    assert torch.equal(results[0]["drafts"], results[1]["drafts"])


def _tp_target_checks(mesh, path) -> dict:
    """A transformers target itself tensor-parallel with TARGET_TP_PLAN: the draft head uses its head's local block
    (no copy) and decodes losslessly; one with transformers' default plan (head split along the hidden dim) is
    refused with the fix named."""
    from transformers import DistributedConfig, InklingForConditionalGeneration

    def target(plan):
        config = DistributedConfig(tp_size=mesh.size(), tp_plan=plan)
        return InklingForConditionalGeneration.from_pretrained(str(path), distributed_config=config).eval()

    sharded_target = target(TARGET_TP_PLAN)
    tp = InklingMTP.from_pretrained(path, target=sharded_target, device_mesh=mesh)
    assert tp.lm_head_weight.data_ptr() == sharded_target.lm_head.weight.to_local().data_ptr()
    prompts = torch.randint(8, tp.config.logits_vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))
    out = speculative_generate(sharded_target, Drafter(tp, 2, 32, compile=False), prompts, max_new_tokens=8)
    reference = sharded_target.generate(prompts, generation_config=greedy_generation_config(sharded_target, 8))
    assert torch.equal(out.sequences, reference)
    with pytest.raises(ArgumentError, match="TARGET_TP_PLAN"):
        InklingMTP.from_pretrained(path, target=target(None), device_mesh=mesh)
    return {"sequences": out.sequences}


def test_tensor_parallel_transformers_target(tmp_path):
    path = tmp_path / "dense"
    write_checkpoint(path, tiny_config(moe=False, **TP_HEADS))  # the MoE target's TP plan crashes in transformers
    results = run_ranks(_tp_target_checks, 2, path, timeout=240)
    assert torch.equal(results[0]["sequences"], results[1]["sequences"])


def _cuda_graph_checks(mesh, path) -> dict:
    """NCCL, one GPU per rank: the CUDA-graph round (collectives captured inside it) equals the eager round."""
    device = f"cuda:{mesh.get_local_rank()}"
    model = InklingMTP.from_pretrained(path, device_mesh=mesh, device=device)
    eager, graphed = (Drafter(model, 2, 16, compile=c, batch_buckets=(2,)) for c in (False, True))
    assert graphed.cuda_graphs
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.config.logits_vocab_size, (2, 6), generator=gen).to(device)
    hidden = torch.randn(2, 6, model.config.hidden_size, generator=gen).to(device)
    drafts = []
    for t in range(6):
        rows = ids[:, t : t + 1], torch.full((2, 1), t, device=device), hidden[:, t : t + 1]
        want, got = eager.draft(*rows), graphed.draft(*rows)
        assert torch.equal(got.drafts, want.drafts), t
        drafts.append(got.drafts.cpu())
    assert graphed.uses_graph(2, 1)
    return {"drafts": torch.cat(drafts, 1)}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: 2 GPUs")
def test_cuda_graphs_nccl(tp_checkpoint):
    results = run_ranks(_cuda_graph_checks, 2, tp_checkpoint, timeout=600, device="cuda")
    assert torch.equal(results[0]["drafts"], results[1]["drafts"])


def test_each_rank_reads_only_slices(tp_checkpoint, monkeypatch):
    """No process group needed: rank r's read of the files is the part of the full tensors its plan names (w13:
    each half's rows), and the sharded tensors are read as slices, never whole."""
    from inkling_compiled.checkpoint import open_checkpoint, reader

    checkpoint = open_checkpoint(tp_checkpoint)
    full_shapes = {n: p.shape for n, p in InklingMTP(checkpoint.config).to("meta").named_parameters()}
    full, _ = checkpoint.read_state(full_shapes)
    whole_reads, safe_open = [], reader.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = safe_open(*args, **kwargs)

        def __enter__(self):
            self.handle = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_tensor(self, key):
            whole_reads.append(key)
            return self.handle.get_tensor(key)

        def __getattr__(self, name):  # keys, get_slice, ...
            return getattr(self.handle, name)

    monkeypatch.setattr(reader, "safe_open", Recording)
    for rank in range(4):
        shards = TensorParallel("unused", rank, 4).shards(checkpoint.config)
        whole_reads.clear()
        part, _ = checkpoint.read_state(full_shapes, shards=shards)
        assert not set(whole_reads) & {raw_key(n) for n in shards}
        for name, tensor in part.items():
            want = shards[name].take(full[name]) if name in shards else full[name]
            assert torch.equal(tensor, want), (rank, name)
    gate_up = part["layers.0.transformer_block.mlp.w13_dn.weight"]
    intermediate = checkpoint.config.intermediate_size
    assert torch.equal(gate_up[: intermediate // 4], full["layers.0.transformer_block.mlp.w13_dn.weight"][
        3 * intermediate // 4 : intermediate])  # rank 3's gate rows, then its up rows


def test_checksum_is_exact_and_order_sensitive():
    """What ranks compare (TensorParallel.agree): equal values give equal sums in any layout (-0.0 and 0.0 alike); a
    swap of two elements or one flipped bit changes them; in a large tensor (strided), a changed row does."""
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(3, 1000, generator=gen)
    assert checksum(t).dtype == torch.int64 and int(checksum(t)) == int(checksum(t.t().contiguous().t()))
    swapped, flipped = t.clone(), t.clone()
    swapped[0, :2] = t[0, :2].flip(0)
    flipped.view(torch.int32)[-1, -1] ^= 1
    assert len({int(checksum(x)) for x in (t, swapped, flipped)}) == 3
    assert int(checksum(torch.zeros(4))) == int(checksum(torch.tensor([0.0, -0.0, 0.0, 0.0])))
    for other in (t.bfloat16(), t > 0, t.long()):  # every element size
        assert int(checksum(other)) == int(checksum(other.clone()))
    large = torch.randn(4096, 1024, generator=gen)
    changed = large.clone()
    changed[1234] = torch.randn(1024, generator=gen)
    assert int(checksum(large)) == int(checksum(large.clone())) != int(checksum(changed))


def test_refusals_name_the_problem(tp_checkpoint):
    with pytest.raises(ArgumentError, match="device_mesh must be a torch.distributed DeviceMesh, got str"):
        InklingMTP.from_pretrained(tp_checkpoint, device_mesh="cpu")
    config = InklingMTP.from_pretrained(tp_checkpoint).config
    with pytest.raises(ArgumentError,
                       match=r"not multiples of 3: vocab_size 512, intermediate_size 128, depth 0 heads 4"):
        TensorParallel("unused", 0, 3).local_config(config)
    local = TensorParallel("unused", 1, 4).local_config(config)
    assert [g.num_heads for g in local.depths] == [1, 1] and local.intermediate_size == 32
    assert TensorParallel("unused", 3, 4).vocab_rows(config) == (384, 512)


def test_cli_tp_needs_torchrun(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        generate_cli(["--tp", "2"])
    assert "--tp 2 needs 2 processes: launch with torchrun --nproc-per-node 2" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")  # but none of torchrun's other variables: the rendezvous's traceback
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit):
        generate_cli(["--tp", "2"])
    assert "(WORLD_SIZE is 2; unset: RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)" in capsys.readouterr().err
