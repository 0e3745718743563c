"""The ``e2e`` section (its parts: bench/README.md): greedy speculative generation against the target alone and
``generate(use_mtp=True)``, on a self-distilled target; methods take turns input by input, so drift hits them alike."""

from __future__ import annotations

import contextlib
import itertools
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from transformers import DynamicCache
from transformers.generation.candidate_generator import MTPCandidateGenerator

from inkling_compiled import InklingMTP
from inkling_compiled.runtime import Drafter, round_cache, speculative
from inkling_compiled.testing.synthetic import greedy_generation_config, load_hf_target
from inkling_compiled.training import distill, text_target

from . import harness
from .harness import Context, Settings, Stats, error_text, fmt, progress, random_rows, run_probe, samples_ms, table, yes
from .models import distilled, left_pad
from .step import compile_options

TEXT_PROMPT_LEN = 32  # bytes of held-out source per prompt
PADDED_PROMPTS = 8  # the batched part's prompts, row b shortened by b % 4 tokens
MODES = ("lockstep", "per_row")
LABELS = {"target": "target.generate (greedy)", "target_loop": "target alone, minimal greedy loop",
          "hf_mtp": "transformers generate(use_mtp=True)"}


def label(name: str) -> str:
    """``ours_compiled_k8`` -> "ours, compiled, K = 8" (and so ``per_row_k4``, ``lockstep_k4``)."""
    if name in LABELS:
        return LABELS[name]
    head, k = name.rsplit("_k", 1)
    return f"ours, {head.removeprefix('ours_').replace('_', ' ')}, K = {k}"


def same_tokens(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal over the columns both have (a sequence that met EOS may stop early)."""
    width = min(a.shape[1], b.shape[1])
    return torch.equal(a[:, :width], b[:, :width])


@dataclass(frozen=True)
class Target:
    """The distilled checkpoint the section runs on, with its prompts (None: random ids)."""

    checkpoint: Path
    label: str
    prompts: torch.Tensor | None
    metrics: dict | None  # distill.json without the loss history (and the text target's build figures)


def build_target(s: Settings) -> Target:
    """The text target (built on first use, a few minutes, then cached), a checkpoint given with --e2e-checkpoint
    (a text target's own gets held-out prompts too), or the self-distilled synthetic tiny8."""
    if s.e2e_checkpoint is not None:
        path = s.e2e_checkpoint
    elif s.e2e_target == "text":
        progress("e2e: the text target (trained on stdlib source, MTP self-distilled; built once, then cached)")
        corpus, start = text_target.load_corpus(), time.perf_counter()  # the corpus read once, for both calls
        fresh = not text_target.is_built(text_target.target_dir(text_target.RECIPE, corpus=corpus))
        path = text_target.build(text_target.RECIPE, corpus=corpus)
        if fresh:
            harness.ONE_TIME.add("the text target", time.perf_counter() - start)
    else:
        progress("e2e: tiny8 target checkpoint + self-distilled MTP (cached after the first run)")
        path = distilled("tiny8", s.distill_steps)
    if text_target.is_built(path):
        m = text_target.load_metrics(path)
        built = {k: m[k] for k in ("heldout_bits_per_byte", "heldout_text_agreement", "train_seconds",
                                   "build_seconds", "parameters", "corpus")}
        name = (f"text target: stdlib source, {m['parameters'] / 1e3:.0f} k parameters, "
                f"{m['heldout_bits_per_byte']:.2f} held-out bits/byte; held-out prompts")
        prompts = text_target.heldout_prompts(max(s.e2e_prompts, PADDED_PROMPTS), TEXT_PROMPT_LEN)
        return Target(path, name, prompts, {**m["distill"], "text_target": built})
    try:
        metrics = {k: v for k, v in distill.load_metrics(path).items() if k != "loss_history"}
    except FileNotFoundError:  # a checkpoint that was not distilled here
        metrics = None
    return Target(path, f"distilled synthetic target {path.name}, random prompts", None, metrics)


@contextlib.contextmanager
def count_hf_matches():
    """transformers' MTP rounds as [drafted, accepted], from its candidate generator."""
    rounds: list[list[int]] = []
    get, update = MTPCandidateGenerator.get_candidates, MTPCandidateGenerator.update_candidate_strategy

    def get_candidates(self, input_ids, *args, **kwargs):
        out = get(self, input_ids, *args, **kwargs)
        rounds.append([out[0].shape[1] - input_ids.shape[1], 0])
        return out

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        rounds[-1][1] = int(num_matches)
        return update(self, input_ids, scores, num_matches)

    with (mock.patch.object(MTPCandidateGenerator, "get_candidates", get_candidates),
          mock.patch.object(MTPCandidateGenerator, "update_candidate_strategy", update_candidate_strategy)):
        yield rounds


def _timed(fn, *args, **kwargs) -> tuple[object, float]:
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, 1e3 * (time.perf_counter() - start)


@contextlib.contextmanager
def timed_rollback(records: defaultdict[str, list[float]]):
    """Wall ms of every verify forward and per-row rollback of the loop, appended to ``records["forward"]`` /
    ``["rollback"]`` (and ``["ragged"]`` for the rollbacks whose rows rejected different counts)."""
    step, rollback = speculative._target_step, speculative.rollback_rows

    def forward(*args, last_only, **kwargs):
        result, wall = _timed(step, *args, last_only=last_only, **kwargs)
        if not last_only:  # a verify forward (the prefill is last_only)
            records["forward"].append(wall)
        return result

    def rolled(cache, mask, rejected):
        result, wall = _timed(rollback, cache, mask, rejected)
        records["rollback"].append(wall)
        if len(set(rejected)) > 1:
            records["ragged"].append(wall)
        return result

    with mock.patch.object(speculative, "_target_step", forward), mock.patch.object(speculative, "rollback_rows",
                                                                                    rolled):
        yield records


def _rollback_medians(records: defaultdict[str, list[float]]) -> dict:
    forward, rollback = statistics.median(records["forward"]), statistics.median(records["rollback"])
    return {"forward_ms": forward, "rollback_ms": rollback, "share": rollback / forward}


def pooled(outputs) -> dict:
    """Our acceptance pooled over several ``SpeculativeOutput``, every (row, round) weighted alike; accepted length:
    tokens per row per target forward."""
    k = outputs[0].num_speculative_tokens
    drafted, accepted = sum(o.num_drafted for o in outputs), sum(o.num_accepted for o in outputs)
    rows = drafted // k or 1
    per_position = [sum(sum(r[j] for r in o.accepted_per_position_per_round) for o in outputs) / rows
                    for j in range(k)]
    return {"acceptance": accepted / drafted if drafted else None, "drafted": drafted, "accepted": accepted,
            "rounds": sum(o.num_rounds for o in outputs), "accepted_length": sum(sum(o.emitted_per_round)
                                                                                  for o in outputs) / rows,
            "acceptance_per_position": per_position, "per_sequence_accepted_length": 1 + sum(per_position)}


def hf_pooled(rounds: list[list[int]], depths: int) -> dict:
    """The same figures from transformers' rounds ``[drafted, accepted]`` (those that drafted): position j counts
    the rounds whose first j + 1 drafts were accepted."""
    drafting = [r for r in rounds if r[0] > 0]
    drafted, accepted, n = sum(r[0] for r in drafting), sum(r[1] for r in drafting), len(drafting) or 1
    return {"acceptance": accepted / drafted if drafted else None, "drafted": drafted, "accepted": accepted,
            "rounds": len(drafting), "accepted_length": 1 + accepted / n,
            "acceptance_per_position": [sum(r[1] > j for r in drafting) / n for j in range(depths)]}


def interleaved(methods: dict, inputs: list[tuple], tag: str, warmed=lambda: None) -> dict[str, dict]:
    """Each method's seconds over ``inputs`` (argument tuples) and its outputs in order, after an untimed warm-up
    over every input (``warmup_s``: the first; last method first: a K > 1 round packaged on first use leaves the
    compiled drafters warmed before it to compile again; ``warmed()`` runs after it); the methods take turns input by
    input, order rotating."""
    figures = {name: {"seconds": 0.0, "outputs": []} for name in methods}
    names = list(methods)
    with torch.no_grad():
        for name, fn in reversed(methods.items()):
            progress(f"{tag}: {label(name)}: warm-up")
            start = time.perf_counter()
            fn(*inputs[0])
            figures[name]["warmup_s"] = time.perf_counter() - start
            for args in inputs[1:]:  # so that no bucket is first met (compiled, or its round packaged) while timed
                fn(*args)
        warmed()
        progress(f"{tag}: timing {len(inputs)} inputs x {len(methods)} methods, interleaved")
        for i, args in enumerate(inputs):
            for name in names[i % len(names):] + names[:i % len(names)]:
                start = time.perf_counter()
                figures[name]["outputs"].append(methods[name](*args))
                figures[name]["seconds"] += time.perf_counter() - start
    return figures


def padded_groups(prompts: torch.Tensor, batch: int, pad_token_id: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """Row b shortened by b % 4 tokens, in left-padded batches of ``batch``: (ids, mask) each."""
    rows = [prompts[b, b % 4:] for b in range(len(prompts))]
    return [left_pad(rows[i:i + batch], pad_token_id) for i in range(0, len(rows), batch)]


def round_latency(drafter: Drafter, rows: int, seconds: float, name: str) -> dict:
    """``{name}_ms`` (wall) and ``{name}_cpu_ms`` (median thread CPU) of ``drafter.draft`` at batch 1 on ``rows`` new
    verified rows per round, positions advancing (starting over before the cache's end)."""
    gen, end = torch.Generator().manual_seed(0), drafter.max_length - rows
    cycle = itertools.cycle([random_rows(drafter.model, 1, i * rows % end, rows, gen) for i in range(64)])

    def draft():
        drafter.draft(*next(cycle), validate=False)

    with torch.no_grad():
        wall = samples_ms(draft, torch.device("cpu"), seconds)
        cpu = samples_ms(draft, torch.device("cpu"), seconds / 2, timer=time.thread_time)
    return {f"{name}_ms": Stats.of(wall), f"{name}_cpu_ms": statistics.median(cpu)}


def rollback_cost(target, batch: int, context: int, k: int) -> dict:
    """Median wall ms of a verify forward (K + 1 rows) and of the ragged per-row rollback after it over 20 rounds, on
    a cache that starts at ``context`` positions; rows keep 1, 2, .., K + 1 of the verified rows."""
    gen, vocab = torch.Generator().manual_seed(0), target.config.get_text_config().vocab_size
    mask, cache = torch.ones(batch, context, dtype=torch.long), DynamicCache(config=target.config)
    rejected, records = [b % (k + 1) for b in range(batch)], defaultdict(list)
    with torch.no_grad(), timed_rollback(records):
        speculative._target_step(target, torch.randint(3, vocab, (batch, context), generator=gen), mask, cache,
                                 last_only=True)
        cache.activate_past_recording()
        for _ in range(20):
            mask = torch.cat([mask, mask.new_ones(batch, k + 1)], dim=1)
            speculative._target_step(target, torch.randint(3, vocab, (batch, k + 1), generator=gen), mask, cache,
                                     last_only=False)
            mask = speculative.rollback_rows(cache, mask, rejected)
    return {"context": context, "batch": batch, "k": k, **_rollback_medians(records)}


@dataclass
class E2EConfig:
    ks: tuple[int, ...] = (1, 8)  # beyond the checkpoint's depths: left out
    prompts: int = 2  # batch 1
    new_tokens: int = 64
    compiled: bool = True  # False: eager drafters everywhere (the same tokens; for tests)
    hf_mtp: bool = True
    eager: bool = True  # our eager drafter at K = 1 beside the compiled ones
    target_loop: bool = True
    round_seconds: float = 0.0  # of draft-round timing per K and window; 0: none
    cold_compile: bool = False  # the smallest and largest K's drafters compiled in fresh processes (with rounds)
    batches: tuple[int, ...] = ()  # the left-padded batches, per row and lockstep; (): none
    contexts: tuple[int, ...] = (64,)  # the rollback outside the loop
    threads: int = 1


@dataclass
class E2E:
    target: str
    checkpoint: str
    prompts: int
    prompt_len: int
    new_tokens: int
    hf_mtp_depths: int
    methods: dict[str, dict] = field(default_factory=dict)  # batch 1
    rounds: dict[str, dict] = field(default_factory=dict)  # K -> draft-round latency, cold compile
    batched: dict | None = None  # target tok/s per batch; K -> batch -> lockstep / per_row / rollback
    distill: dict | None = None


class Setup:
    """The target, our drafter per K and the prompts a run of the section (or its prebuild) works on."""

    def __init__(self, checkpoint, cfg: E2EConfig, prompts: torch.Tensor | None):
        torch.set_num_threads(cfg.threads)
        self.cfg, self.target = cfg, load_hf_target(checkpoint, dtype=torch.float32).requires_grad_(False)
        self.mtp = mtp = InklingMTP.from_pretrained(checkpoint, target=self.target)
        ks = tuple(k for k in cfg.ks if k <= mtp.config.num_depths)
        if not ks:
            raise ValueError(f"none of K = {cfg.ks} fits the checkpoint's {mtp.config.num_depths} MTP depth(s)")
        count = max(cfg.prompts, PADDED_PROMPTS if cfg.batches else 0)
        prompts = torch.randint(3, mtp.config.logits_vocab_size, (count, 8),
                                generator=torch.Generator().manual_seed(1000)) if prompts is None else prompts[:count]
        if len(prompts) < count:
            raise ValueError(f"{count} prompts needed, {len(prompts)} given")
        self.prompts = prompts
        self.drafters = {k: self.drafter(k, cfg.compiled) for k in ks}  # every batch bucket of cfg.batches

    def drafter(self, k: int, compile: bool) -> Drafter:
        buckets, max_length = (1, *self.cfg.batches), self.prompts.shape[1] + self.cfg.new_tokens + 8
        return Drafter(self.mtp, max(buckets), max_length, num_speculative_tokens=k, compile=compile,
                       batch_buckets=buckets, compile_options=compile_options(passes=True, fresh=False) if compile
                       else None)

    def ours(self, d: Drafter, lockstep=False, records=None, new_tokens: int | None = None):
        def run(ids, mask=None):
            with timed_rollback(records) if records is not None else contextlib.nullcontext():
                out = speculative.speculative_generate(self.target, d, ids, mask, lockstep=lockstep,
                                                       max_new_tokens=new_tokens or self.cfg.new_tokens)
            return out.sequences, out
        return run


def run_e2e(checkpoint, cfg: E2EConfig, *, prompts: torch.Tensor | None = None, target_label: str = "",
            distill_metrics: dict | None = None) -> E2E:
    """Every figure of the section on ``checkpoint`` (a distilled raw-layout directory), CPU fp32."""
    up = Setup(checkpoint, cfg, prompts)
    target, prompts, by_k, ours = up.target, up.prompts, up.drafters, up.ours
    text, new = target.config.get_text_config(), cfg.new_tokens
    gconfig, gconfig_mtp = (greedy_generation_config(target, new) for _ in range(2))
    gconfig_mtp.use_mtp = True

    def generate(config, counter=contextlib.nullcontext):
        """target.generate's sequences and the rounds ``counter`` counted (None: not counted)."""
        def run(ids, mask=None):
            with counter() as rounds:
                return target.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask,
                                       generation_config=config), rounds
        return run

    def loop(ids):
        """The target alone through the calls our speculative loop makes (no generate() machinery)."""
        cache, mask, step, out = DynamicCache(config=target.config), torch.ones_like(ids), ids, [ids]
        for _ in range(new):
            step = speculative._target_step(target, step, mask, cache, last_only=True)[1].argmax(-1)
            out.append(step)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        return torch.cat(out, dim=1), None

    kind = "compiled" if cfg.compiled else "eager"
    drafters = {f"ours_{kind}_k{k}": d for k, d in by_k.items()}
    if cfg.eager and "ours_eager_k1" not in drafters:
        drafters["ours_eager_k1"] = up.drafter(1, False)
    methods = {"target": generate(gconfig), **({"target_loop": loop} if cfg.target_loop else {}),
               **({"hf_mtp": generate(gconfig_mtp, count_hf_matches)} if cfg.hf_mtp else {}),
               **{n: ours(d) for n, d in drafters.items()}}
    figures = interleaved(methods, [(prompts[i:i + 1],) for i in range(cfg.prompts)], "e2e")
    record = E2E(target_label or f"distilled checkpoint {checkpoint}", str(checkpoint), cfg.prompts,
                 prompts.shape[1], new, text.num_mtp_layers, distill=distill_metrics)
    base, hf_s = figures["target"]["seconds"], figures.get("hf_mtp", {}).get("seconds")
    reference = [r[:, prompts.shape[1]:] for r, _ in figures["target"]["outputs"]]
    for name, f in figures.items():
        outs, details = [o[:, prompts.shape[1]:] for o, _ in f["outputs"]], [d for _, d in f["outputs"]]
        tokens, k = sum(o.shape[1] for o in outs), int(name.rsplit("_k", 1)[1]) if "_k" in name else None
        counts = (hf_pooled([r for d in details for r in d], text.num_mtp_layers) if name == "hf_mtp"
                  else pooled(details) if k else {})
        record.methods[name] = {
            "k": text.num_mtp_layers if name == "hf_mtp" else k, "tokens_per_s": tokens / f["seconds"],
            "ms_per_token": 1e3 * f["seconds"] / tokens, "speedup_vs_target": base / f["seconds"],
            "speedup_vs_hf_mtp": hf_s / f["seconds"] if hf_s and k else None, "new_tokens": tokens,
            "seconds": f["seconds"], "warmup_s": f["warmup_s"], **counts,
            "outputs_match_target": None if name == "target" else all(map(same_tokens, outs, reference))}
    if cfg.round_seconds:
        for k, d in by_k.items():
            progress(f"e2e: draft-round latency, K={k}")
            record.rounds[str(k)] = {**round_latency(d, 1, cfg.round_seconds, "one_row"),
                                     **round_latency(d, k + 1, cfg.round_seconds, "all_rows"), "cold_compile": None}
    if cfg.cold_compile and record.rounds:
        _cold_compiles(record, checkpoint, sorted({min(by_k), max(by_k)}), cfg.threads)
    if cfg.batches:
        record.batched = _batched(target, by_k, ours, generate(gconfig), prompts[:PADDED_PROMPTS], cfg, record.methods)
    return record


def _batched(target, drafters: dict, ours, alone, prompts, cfg: E2EConfig, batch1: dict) -> dict:
    """Per row against lockstep at each batch, every K, beside target.generate on the same left-padded batches."""
    found, tokens = {"target": {}, "ks": {str(k): {} for k in drafters}}, len(prompts) * cfg.new_tokens
    for batch in cfg.batches:
        groups = padded_groups(prompts, batch, target.generation_config.pad_token_id or 0)
        records = {k: defaultdict(list) for k in drafters}
        methods = {"target": alone, **{f"{mode}_k{k}": ours(d, mode == "lockstep", records[k] if mode == "per_row"
                                                            else None) for k, d in drafters.items() for mode in MODES}}
        figures = interleaved(methods, groups, f"e2e batch {batch}", lambda r=records: [x.clear() for x in r.values()])
        found["target"][str(batch)] = tokens / figures["target"]["seconds"]
        reference = [out for out, _ in figures["target"]["outputs"]]
        for k in drafters:
            row = found["ks"][str(k)][str(batch)] = {}
            one = next(m["accepted_length"] for n, m in batch1.items() if n.startswith("ours") and m["k"] == k)
            for mode in MODES:
                f = figures[f"{mode}_k{k}"]
                outs = [o for _, o in f["outputs"]]
                row[mode] = {**pooled(outs), "tokens_per_s": tokens / f["seconds"],
                             "speedup_vs_target": figures["target"]["seconds"] / f["seconds"],
                             "target_forwards": sum(o.num_rounds + 1 for o in outs),
                             "same_tokens": all(map(same_tokens, [o.sequences for o in outs], reference))}
                row[mode]["vs_batch1"] = row[mode]["accepted_length"] / one
            r = records[k]
            row["rollback"] = {**_rollback_medians(r),
                               "ragged_ms": statistics.median(r["ragged"]) if r["ragged"] else None,
                               "rounds": len(r["rollback"]), "ragged_rounds": len(r["ragged"])}
    progress("e2e: rollback vs context")
    found["rollback_vs_context"] = [rollback_cost(target, max(cfg.batches), c, max(drafters)) for c in cfg.contexts]
    return found


def _cold_compiles(record: E2E, checkpoint, ks: list[int], threads: int) -> None:
    """Each K's drafter compiled in its own fresh process with an empty Inductor cache (a K that fails records its
    error), CPU seconds also as a ratio to the first K's."""
    first = None
    for k in ks:
        progress(f"e2e: cold compile, K={k} (fresh process, empty Inductor cache)")
        try:
            with tempfile.TemporaryDirectory(prefix="e2e-inductor-") as cache:
                found = run_probe("probes.k_compile", {"checkpoint": str(checkpoint), "k": k, "threads": threads},
                                  cache_dir=cache, timeout=1800)
        except Exception as e:  # noqa: BLE001 - keep the other Ks
            record.rounds[str(k)]["cold_compile"] = {"error": error_text(e)}
            continue
        first = first or found["cpu_s"]
        record.rounds[str(k)]["cold_compile"] = {**found, "ratio_to_first": found["cpu_s"] / first}


def config(s: Settings) -> E2EConfig:
    sweep, batched = (s.runs(part) and s.device == "cpu" for part in ("ksweep", "perrow"))
    ks = tuple(sorted({*s.e2e_ks, *s.ks})) if sweep else s.e2e_ks
    return E2EConfig(ks=ks, prompts=s.e2e_prompts, new_tokens=s.e2e_tokens, compiled=s.runs("compiled"),
                     hf_mtp=s.runs("peer"), eager=s.runs("e2e_eager"), target_loop=s.runs("target_loop"),
                     round_seconds=s.k_seconds if sweep else 0.0, threads=s.threads,
                     cold_compile=sweep and s.runs("kcompile"), batches=(4, 8) if batched else ())


def measure(ctx: Context) -> E2E:
    ctx.prebuilt()  # what prebuild() below builds: minutes on a machine's first run, a load on later ones
    target = ctx.e2e_target()
    return run_e2e(target.checkpoint, config(ctx.settings), prompts=target.prompts, target_label=target.label,
                   distill_metrics=target.metrics)


def prebuild(s: Settings) -> None:
    """The section's one-time builds, for :class:`bench.harness.Prebuild`: the text target, then the packaged round
    of each K > 1 drafter's batch bucket the round cache lacks (a first generation at that batch builds it)."""
    target, cfg = build_target(s), config(s)
    up = Setup(target.checkpoint, cfg, target.prompts)
    with torch.no_grad():
        for k, d in reversed(up.drafters.items()):  # the largest K first: its package is the longest build
            for batch in round_cache.missing(d):
                up.ours(d, new_tokens=k + 1)(*padded_groups(up.prompts, batch)[0])  # one draft round at least


def lines(e2e: dict) -> list[str]:
    agree = (e2e.get("distill") or {}).get("agreement_after")
    out = [f"end to end ({e2e['target']}; greedy, batch 1, {e2e['prompts']} prompts x {e2e['new_tokens']} new tokens"
           + (f"; distilled depth agreement {', '.join(f'{a:.2f}' for a in agree)}" if agree else "") + ")"]
    rows = [["method", "tok/s", "ms/tok", "accept", "accepted len", "acceptance per position", "vs target",
             "vs hf", "same tokens", "warm-up s"]]
    for name, m in e2e["methods"].items():
        per_position = " ".join(f"{a:.2f}" for a in m.get("acceptance_per_position") or []) or "-"
        rows.append([label(name), f"{m['tokens_per_s']:.1f}", f"{m['ms_per_token']:.2f}", fmt(m.get("acceptance")),
                     fmt(m.get("accepted_length")), per_position, f"{m['speedup_vs_target']:.2f}x",
                     fmt(m["speedup_vs_hf_mtp"], ".2f", "x"), yes(m["outputs_match_target"]), f"{m['warmup_s']:.1f}"])
    out += table(rows)
    if "hf_mtp" in e2e["methods"]:
        out.append(f"  transformers drafts {e2e['hf_mtp_depths']} tokens per round (every depth); ours K (depths "
                   "0..K-1); accepted len: tokens per target forward (docs/protocol.md §6.8); warm-up: the first "
                   "call (ours compiled: the compile)")
    if e2e["rounds"]:
        rows = [["K", "draft round ms, 1 row (cpu)", "K + 1 rows (cpu)", "cold compile cpu s (wall)", "x first K",
                 "graphs", "recompiles / 64 rounds"]]
        for k, r in e2e["rounds"].items():
            cold = r["cold_compile"] or {}
            compiled = (["FAILED", "-", "-", "-"] if "error" in cold else ["-"] * 4 if not cold else [
                f"{cold['cpu_s']:.1f} ({cold['wall_s']:.1f})", f"{cold['ratio_to_first']:.2f}x", str(cold["graphs"]),
                str(cold["recompiles_over_64_rounds"])])
            rows.append([k, f"{r['one_row_ms']['median_ms']:.2f} ({r['one_row_cpu_ms']:.2f})",
                         f"{r['all_rows_ms']['median_ms']:.2f} ({r['all_rows_cpu_ms']:.2f})", *compiled])
        out += ["draft rounds at batch 1; cold compile: K and K + 1-row windows, each K in a fresh process",
                *table(rows, "  ")]
    return out + (_batched_lines(e2e["batched"]) if e2e.get("batched") else [])


def _batched_lines(batched: dict) -> list[str]:
    rows = [["K", "batch", "tok/s target", "tok/s lockstep (vs target)", "tok/s per-row (vs target)",
             "tok/fwd lockstep (vs b1)", "tok/fwd per-row (vs b1)", "per-row len per seq",
             "rollback ms (ragged) / forward ms (share)", "same tokens"]]
    for k, entry in batched["ks"].items():
        for batch, row in entry.items():
            lock, per, rb = row["lockstep"], row["per_row"], row["rollback"]
            rows.append([k, batch, f"{batched['target'][batch]:.1f}",
                         *(f"{m['tokens_per_s']:.1f} ({m['speedup_vs_target']:.2f}x)" for m in (lock, per)),
                         *(f"{m['accepted_length']:.2f} ({m['vs_batch1']:.0%})" for m in (lock, per)),
                         f"{per['per_sequence_accepted_length']:.2f}",
                         f"{rb['rollback_ms']:.3f} ({fmt(rb['ragged_ms'], '.3f')}) / {rb['forward_ms']:.2f} "
                         f"({rb['share']:.1%})", yes(lock["same_tokens"] and per["same_tokens"])])
    return ["left-padded batches (row b shortened by b % 4), per row vs lockstep; vs b1: over batch 1's accepted "
            "length", *table(rows, "  ")] + [
        f"  rollback outside the loop, batch {c['batch']}, K={c['k']}, context {c['context']}: "
        f"{c['rollback_ms']:.3f} ms vs verify forward {c['forward_ms']:.2f} ms ({c['share']:.1%})"
        for c in batched["rollback_vs_context"]]
