"""End to end on a self-distilled target, greedy, batch 1: tokens/s and acceptance of our speculative generation at
K = 1 and the largest K asked for, against the target alone and transformers' ``generate(use_mtp=True)``: the
``e2e`` section. The methods take turns prompt by prompt, after one untimed warm-up each (the drafters' compiles)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from transformers import DynamicCache
from transformers.generation.candidate_generator import MTPCandidateGenerator

from inkling_compiled import InklingMTP
from inkling_compiled.config import logits_vocab_size
from inkling_compiled.hf_compat import cache_argument
from inkling_compiled.runtime import Drafter
from inkling_compiled.runtime.speculative import speculative_generate
from inkling_compiled.testing.synthetic import greedy_generation_config, load_hf_target
from inkling_compiled.training import distill, text_target

from .harness import Context, Settings, fmt, progress, table, yes
from .models import distilled
from .step import compile_options

TEXT_PROMPT_LEN = 32  # bytes of held-out source per prompt
LABELS = {"target": "target.generate (greedy)", "target_loop": "target alone, minimal greedy loop",
          "hf_mtp": "transformers generate(use_mtp=True)", "ours_eager": "ours, eager drafter"}


def label(name: str) -> str:
    return LABELS.get(name) or f"ours, compiled drafter, K = {name.rsplit('_k', 1)[-1]}"


@dataclass(frozen=True)
class Target:
    """The distilled checkpoint the end-to-end sections run on, with its prompts (None: random ids)."""

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
        path = text_target.build(text_target.RECIPE)
    else:
        progress("e2e: tiny8 target checkpoint + self-distilled MTP (cached after the first run)")
        path = distilled("tiny8", s.distill_steps)
    if text_target.is_built(path):
        m = text_target.load_metrics(path)
        built = {k: m[k] for k in ("heldout_bits_per_byte", "heldout_text_agreement", "train_seconds",
                                   "build_seconds", "parameters", "corpus")}
        name = (f"text target: stdlib source, {m['parameters'] / 1e3:.0f} k parameters, "
                f"{m['heldout_bits_per_byte']:.2f} held-out bits/byte; held-out prompts")
        prompts = text_target.heldout_prompts(max(s.e2e_prompts, 4), TEXT_PROMPT_LEN)  # the K sweep's batch takes 4
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


def load(checkpoint):
    """transformers' target (fp32, CPU) and our MTP sharing its embedding and head."""
    target = load_hf_target(checkpoint, dtype=torch.float32).requires_grad_(False)
    return target, InklingMTP.from_pretrained(checkpoint, target=target)


def generators(target, new_tokens: int):
    """(the target alone: ``target.generate`` greedy, transformers' ``generate(use_mtp=True)``), each ``fn(ids,
    mask=None)`` returning (sequences, None) / (sequences, its rounds [drafted, accepted])."""
    gconfig, gconfig_mtp = (greedy_generation_config(target, new_tokens) for _ in range(2))
    gconfig_mtp.use_mtp = True

    def alone(ids, mask=None):
        mask = torch.ones_like(ids) if mask is None else mask
        return target.generate(ids, attention_mask=mask, generation_config=gconfig), None

    def transformers_mtp(ids, mask=None):
        with count_hf_matches() as rounds:
            mask = torch.ones_like(ids) if mask is None else mask
            return target.generate(ids, attention_mask=mask, generation_config=gconfig_mtp), rounds

    return alone, transformers_mtp


def counts(detail) -> tuple[int, int, int]:
    """(drafted, accepted, rounds that drafted) of one generation's detail: our ``SpeculativeOutput``,
    transformers' rounds [drafted, accepted], or None (the target alone)."""
    if detail is None:
        return 0, 0, 0
    if isinstance(detail, list):
        drafting = [r for r in detail if r[0] > 0]
        return sum(r[0] for r in drafting), sum(r[1] for r in drafting), len(drafting)
    return detail.num_drafted, detail.num_accepted, detail.num_rounds


def interleaved(methods: dict, rows: list[torch.Tensor], tag: str = "e2e") -> dict[str, dict]:
    """Each method's seconds over ``rows`` and its outputs in row order, after one untimed warm-up each
    (``warmup_s``); the methods take turns prompt by prompt (order rotating), so drift on a shared machine hits
    them alike."""
    figures = {name: {"seconds": 0.0, "outputs": []} for name in methods}
    names = list(methods)
    with torch.no_grad():
        for name, fn in methods.items():
            progress(f"{tag}: {label(name)}: warm-up" + (" (compiles the drafter)" if "compiled" in name else ""))
            start = time.perf_counter()
            fn(rows[0])
            figures[name]["warmup_s"] = time.perf_counter() - start
        progress(f"{tag}: timing {len(rows)} prompts x {len(methods)} methods, interleaved")
        for i, p in enumerate(rows):
            for name in names[i % len(names):] + names[:i % len(names)]:
                start = time.perf_counter()
                figures[name]["outputs"].append(methods[name](p))
                figures[name]["seconds"] += time.perf_counter() - start
    return figures


def prompt_batch(prompts: torch.Tensor | None, count: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """The first ``count`` rows of ``prompts`` [N, P] (checked), or ``count`` seeded random prompts."""
    if prompts is None:
        return torch.randint(3, vocab, (count, length), generator=torch.Generator().manual_seed(seed + 1000))
    if prompts.dim() != 2 or prompts.shape[0] < count or prompts.dtype != torch.long:
        raise ValueError(f"prompts must be int64 [N >= {count}, P], got {prompts.dtype} {tuple(prompts.shape)}")
    if int(prompts.min()) < 0 or int(prompts.max()) >= vocab:
        raise ValueError(f"prompt ids must lie in [0, {vocab}), got [{int(prompts.min())}, {int(prompts.max())}]")
    return prompts[:count]


@dataclass
class E2E:
    target: str
    checkpoint: str
    prompts: int
    prompt_len: int
    new_tokens: int
    hf_mtp_depths: int
    methods: dict[str, dict] = field(default_factory=dict)
    distill: dict | None = None


def run_e2e(checkpoint, *, ks=(1,), prompts: torch.Tensor | None = None, count: int = 4, new_tokens: int = 64,
            compiled: bool = True, hf_mtp: bool = True, eager: bool = True, target_loop: bool = True,
            target_label: str = "", distill_metrics: dict | None = None) -> E2E:
    """Every method on ``count`` prompts of ``checkpoint`` (a distilled raw-layout directory), CPU fp32."""
    target, mtp = load(checkpoint)
    text = target.config.get_text_config()
    vocab = logits_vocab_size(text)
    rows = [row[None] for row in prompt_batch(prompts, count, 8, vocab, 0)]
    alone, transformers_mtp = generators(target, new_tokens)
    max_length = rows[0].shape[1] + new_tokens + 8

    def loop(p):
        """The target alone through the calls our speculative loop makes (no generate() machinery)."""
        cache, mask, ids, out = DynamicCache(config=target.config), torch.ones_like(p), p, [p]
        for _ in range(new_tokens):
            h = target.model(input_ids=ids, attention_mask=mask, use_cache=True,
                             **{cache_argument(target.model): cache}).last_hidden_state
            ids = target.lm_head(h[:, -1:] / text.logits_mup_width_multiplier)[..., :vocab].argmax(-1)
            out.append(ids)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        return torch.cat(out, dim=1), None

    def ours(k, compile):
        drafter = Drafter(mtp, 1, max_length, num_speculative_tokens=k, compile=compile,
                          compile_options=compile_options(passes=True, fresh=False) if compile else None)

        def run(p):
            out = speculative_generate(target, drafter, p, max_new_tokens=new_tokens)
            return out.sequences, out
        return run

    methods = {"target": alone, **({"target_loop": loop} if target_loop else {}),
               **({"hf_mtp": transformers_mtp} if hf_mtp else {}), **({"ours_eager": ours(1, False)} if eager else {})}
    methods.update({f"ours_compiled_k{k}": ours(k, True) for k in ks if compiled and k <= mtp.config.num_depths})
    figures = interleaved(methods, rows)
    record = E2E(target_label or "distilled synthetic target, random prompts", str(checkpoint), len(rows),
                 rows[0].shape[1], new_tokens, text.num_mtp_layers, distill=distill_metrics)
    news = {name: [out[:, p.shape[1]:] for p, (out, _) in zip(rows, f["outputs"])] for name, f in figures.items()}
    base = sum(new.shape[1] for new in news["target"]) / figures["target"]["seconds"]
    for name, f in figures.items():
        tokens = sum(new.shape[1] for new in news[name])
        tokens_per_s = tokens / f["seconds"]
        drafted, accepted, rounds = map(sum, zip(*(counts(detail) for _, detail in f["outputs"])))
        matches = sum(torch.equal(new[:, :ref.shape[1]], ref[:, :new.shape[1]])
                      for new, ref in zip(news[name], news["target"]))
        record.methods[name] = {
            "k": int(name.rsplit("_k", 1)[1]) if "_k" in name else 1 if name == "ours_eager" else None,
            "tokens_per_s": tokens_per_s, "ms_per_token": 1e3 * f["seconds"] / tokens,
            "speedup_vs_target": tokens_per_s / base, "new_tokens": tokens, "seconds": f["seconds"],
            "warmup_s": f["warmup_s"], "acceptance": accepted / drafted if drafted else None,
            "drafted": drafted, "accepted": accepted, "rounds": rounds,
            "tokens_per_round": (tokens - len(rows)) / rounds if rounds else None,
            "outputs_match_target": None if name == "target" else matches == len(rows)}
    return record


def measure(ctx: Context) -> E2E:
    s, target = ctx.settings, ctx.e2e_target()
    return run_e2e(target.checkpoint, ks=s.e2e_ks, prompts=target.prompts, count=s.e2e_prompts,
                   new_tokens=s.e2e_tokens, compiled=s.runs("compiled"), hf_mtp=s.runs("peer"),
                   eager=s.runs("e2e_eager"), target_loop=s.runs("target_loop"), target_label=target.label,
                   distill_metrics=target.metrics)


def lines(e2e: dict) -> list[str]:
    agree = (e2e.get("distill") or {}).get("agreement_after")
    out = [f"end to end ({e2e['target']}; greedy, batch 1, {e2e['prompts']} prompts x {e2e['new_tokens']} new tokens"
           + (f"; distilled depth agreement {', '.join(f'{a:.2f}' for a in agree)}" if agree else "") + ")"]
    rows = [["method", "tok/s", "ms/tok", "accept", "tok/round", "vs target", "same tokens"]]
    for name, m in e2e["methods"].items():
        rows.append([label(name), f"{m['tokens_per_s']:.1f}", f"{m['ms_per_token']:.2f}", fmt(m["acceptance"]),
                     fmt(m["tokens_per_round"]), f"{m['speedup_vs_target']:.2f}x", yes(m["outputs_match_target"])])
    out += table(rows)
    if "hf_mtp" in e2e["methods"]:
        out.append(f"  transformers drafts {e2e['hf_mtp_depths']} tokens per round (every depth); ours K (depths "
                   "0..K-1); tok/round: tokens per target forward")
    return out
