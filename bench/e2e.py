"""End to end on a self-distilled target: tokens/s and acceptance, greedy, batch 1, one draft per round (K = 1;
:mod:`bench.ksweep` sweeps K).

``python -m bench.run`` runs it on the text target (:mod:`inkling_compiled.training.text_target`) with held-out
source lines as prompts; given no prompts it draws random ids (the distribution a synthetic target's draft head was
distilled on). Runs, on the same prompts and for the same number of new tokens with no EOS stop: the target alone
(``target.generate(do_sample=False)``, and a minimal greedy loop making the same target calls as our speculative
loop, which separates the speculative gain from ``generate``'s own per-token overhead), transformers' own MTP
speculative decoding (``generate(use_mtp=True)``, which drafts with every MTP depth and rebuilds its ``MtpModel``
inside each call), and ours (``speculative_generate`` with a ``Drafter`` over depth 0: eager, and compiled with our
passes). Every method gets one untimed warm-up call (compiles the drafter's prefill / 1-row / 2-row shapes), then
the methods take turns prompt by prompt, so drift on a shared machine hits them alike.
Greedy speculative decoding is lossless, so each method's tokens are compared with the target's.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from inkling_compiled import InklingMTP
from inkling_compiled.config import logits_vocab_size
from inkling_compiled.hf_compat import cache_argument
from inkling_compiled.runtime import Drafter
from inkling_compiled.runtime.speculative import speculative_generate
from inkling_compiled.testing.synthetic import greedy_generation_config, load_hf_target

from .step import compile_options


@dataclass
class E2EConfig:
    prompts: int = 4
    prompt_len: int = 8
    new_tokens: int = 64
    seed: int = 0
    compiled: bool = True  # also run ours with the compiled drafter
    hf_mtp: bool = True


@contextlib.contextmanager
def count_hf_matches():
    """Record transformers' MTP rounds: (drafted, accepted) per verify round, from its candidate generator."""
    from transformers.generation.candidate_generator import MTPCandidateGenerator

    rounds: list[list[int]] = []
    get, update = MTPCandidateGenerator.get_candidates, MTPCandidateGenerator.update_candidate_strategy

    def get_candidates(self, input_ids, *args, **kwargs):
        out = get(self, input_ids, *args, **kwargs)
        rounds.append([out[0].shape[1] - input_ids.shape[1], 0])
        return out

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        if rounds:
            rounds[-1][1] = int(num_matches)
        return update(self, input_ids, scores, num_matches)

    MTPCandidateGenerator.get_candidates = get_candidates
    MTPCandidateGenerator.update_candidate_strategy = update_candidate_strategy
    try:
        yield rounds
    finally:
        MTPCandidateGenerator.get_candidates = get
        MTPCandidateGenerator.update_candidate_strategy = update


def distilled_checkpoint(steps: int | None = None, progress=print, preset: str = "tiny"):
    """The synthetic ``preset``'s checkpoint with its MTP self-distilled (both cached after the first run, under
    ``INKLING_COMPILED_CACHE``): ``python -c "from bench.e2e import distilled_checkpoint; distilled_checkpoint()"``
    builds it ahead of a run on another machine."""
    from inkling_compiled.testing.synthetic import cached_checkpoint
    from inkling_compiled.training.distill import distill

    progress(f"e2e: {preset} target checkpoint + self-distilled MTP (cached after the first run)")
    return distill(cached_checkpoint(preset), progress=True, **({"steps": steps} if steps else {}))


def prompt_batch(prompts: torch.Tensor | None, count: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """The first ``count`` rows of ``prompts`` [N, P] (checked), or ``count`` seeded random prompts of ``length``
    ids when it is None."""
    if prompts is None:
        gen = torch.Generator().manual_seed(seed + 1000)
        return torch.randint(3, vocab, (count, length), generator=gen)
    if prompts.dim() != 2 or prompts.shape[0] < count or prompts.dtype != torch.long:
        raise ValueError(f"prompts must be int64 [N >= {count}, P], got {prompts.dtype} {tuple(prompts.shape)}")
    if int(prompts.min()) < 0 or int(prompts.max()) >= vocab:
        raise ValueError(f"prompt ids must lie in [0, {vocab}), got [{int(prompts.min())}, {int(prompts.max())}]")
    return prompts[:count]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_e2e(checkpoint, *, device="cpu", cfg: E2EConfig | None = None, progress=lambda msg: None,
            distill_metrics: dict | None = None, prompts: torch.Tensor | None = None, target_label: str = "") -> dict:
    """Tokens/s and acceptance of each method on ``checkpoint`` (a distilled raw-layout directory), fp32.

    ``prompts`` [N >= cfg.prompts, P] (held-out text, say) replace the random ids of ``cfg.prompt_len``;
    ``target_label`` says what the target is in the record and the table."""
    cfg = cfg or E2EConfig()
    device = torch.device(device)
    target = load_hf_target(checkpoint, dtype=torch.float32).to(device).requires_grad_(False)
    mtp = InklingMTP.from_pretrained(checkpoint, target=target)
    text = target.config.get_text_config()
    vocab = logits_vocab_size(text)
    prompts = [row[None].to(device) for row in prompt_batch(prompts, cfg.prompts, cfg.prompt_len, vocab, cfg.seed)]
    gconfig = greedy_generation_config(target, cfg.new_tokens)
    gconfig_mtp = greedy_generation_config(target, cfg.new_tokens)
    gconfig_mtp.use_mtp = True
    max_length = prompts[0].shape[1] + cfg.new_tokens + 8

    def target_alone(p):
        out = target.generate(p, attention_mask=torch.ones_like(p), generation_config=gconfig)
        return out, None

    mup = text.logits_mup_width_multiplier

    def target_loop(p):
        """The target alone through the same calls our speculative loop makes (no generate() machinery)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=target.config)
        cache_kwarg = {cache_argument(target.model): cache}
        mask = torch.ones_like(p)
        ids, out = p, []
        for _ in range(cfg.new_tokens):
            h = target.model(input_ids=ids, attention_mask=mask, use_cache=True, **cache_kwarg).last_hidden_state
            ids = target.lm_head(h[:, -1:] / mup)[..., :vocab].argmax(-1)
            out.append(ids)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        return torch.cat([p, *out], dim=1), None

    def hf_mtp(p):
        with count_hf_matches() as rounds:
            out = target.generate(p, attention_mask=torch.ones_like(p), generation_config=gconfig_mtp)
        drafted = sum(r[0] for r in rounds)
        accepted = sum(r[1] for r in rounds if r[0] > 0)
        return out, (drafted, accepted, sum(1 for r in rounds if r[0] > 0))

    def ours(drafter):
        def run(p):
            out = speculative_generate(target, drafter, p, max_new_tokens=cfg.new_tokens)
            return out.sequences, (out.num_drafted, out.num_accepted, out.num_rounds)
        return run

    methods = {"target": target_alone, "target_loop": target_loop}
    if cfg.hf_mtp:
        methods["hf_mtp"] = hf_mtp
    # one draft per round (K = 1): the section's fixed point; the K sweep (bench.ksweep) runs every K
    methods["ours_eager"] = ours(Drafter(mtp, 1, max_length, num_speculative_tokens=1, compile=False))
    if cfg.compiled:
        methods["ours_compiled"] = ours(Drafter(mtp, 1, max_length, num_speculative_tokens=1, compile=True,
                                                compile_options=compile_options(passes=True, fresh=False)))

    acc = {name: dict(seconds=0.0, tokens=0, drafted=0, accepted=0, rounds=0, matches=0, warm=0.0)
           for name in methods}
    with torch.no_grad():
        for name, fn in methods.items():
            progress(f"e2e: {name} (warm-up{' + drafter compiles' if name == 'ours_compiled' else ''})")
            t0 = time.perf_counter()
            fn(prompts[0])
            acc[name]["warm"] = time.perf_counter() - t0
        progress(f"e2e: timing {len(prompts)} prompts x {len(methods)} methods, interleaved")
        for i, p in enumerate(prompts):
            # every method on this prompt in turn (order rotating), so drift on a shared machine hits all alike
            names = list(methods)
            names = names[i % len(names):] + names[:i % len(names)]
            outs = {}
            for name in names:
                _sync(device)
                t0 = time.perf_counter()
                out, stats = methods[name](p)
                _sync(device)
                a = acc[name]
                a["seconds"] += time.perf_counter() - t0
                outs[name] = out[:, p.shape[1]:]
                a["tokens"] += outs[name].shape[1]
                if stats:
                    a["drafted"] += stats[0]
                    a["accepted"] += stats[1]
                    a["rounds"] += stats[2]
            reference = outs["target"]
            for name, new in outs.items():
                n = min(new.shape[1], reference.shape[1])
                acc[name]["matches"] += int(torch.equal(new[:, :n], reference[:, :n]))
    results: dict[str, dict] = {}
    for name, a in acc.items():
        results[name] = {
            "tokens_per_s": a["tokens"] / a["seconds"], "ms_per_token": 1e3 * a["seconds"] / a["tokens"],
            "new_tokens": a["tokens"], "seconds": a["seconds"], "warmup_s": a["warm"],
            "acceptance": a["accepted"] / a["drafted"] if a["drafted"] else None,
            "drafted": a["drafted"], "accepted": a["accepted"], "rounds": a["rounds"],
            "tokens_per_round": (a["tokens"] - len(prompts)) / a["rounds"] if a["rounds"] else None,
            "outputs_match_target": None if name == "target" else a["matches"] == len(prompts),
        }
    base = results["target"]["tokens_per_s"]
    for r in results.values():
        r["speedup_vs_target"] = r["tokens_per_s"] / base
    return {"checkpoint": str(checkpoint), "device": str(device), "prompts": cfg.prompts,
            "prompt_len": prompts[0].shape[1], "new_tokens": cfg.new_tokens, "methods": results,
            "hf_mtp_depths": text.num_mtp_layers, "distill": distill_metrics,
            "target": target_label or "distilled synthetic target, random prompts"}
