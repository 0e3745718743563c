"""The ``multimodal`` section (``--full``): acceptance on image prompts, the drafter's prefill fed the
target's merged rows vs the placeholder ids; ``generate(custom_generate=...)``'s cost (docs/protocol.md §6.11)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from inkling_compiled import InklingMTP
from inkling_compiled.runtime import Drafter, custom_generate, speculative_generate
from inkling_compiled.testing.synthetic import load_hf_target

from .harness import Context, progress, table, yes
from .models import left_pad


@dataclass
class Multimodal:
    checkpoint: str
    k: int
    prompts: int
    image_patches: int
    new_tokens: int
    compiled: bool
    acceptance: dict[str, list[float]]  # per drafter prefill, "merged" / "placeholder": per position
    mean_accepted_length: dict[str, float]
    same_tokens: bool  # both prefills' tokens are greedy generate's
    tokens_per_s: dict[str, float]  # "generate" (its custom_generate=) / "speculative" (speculative_generate)
    wrapper_cost: float  # median over the pairs of generate's seconds / speculative's, minus 1
    pairs: int
    timer: str


class PlaceholderDrafter:
    """A drafter that never sees multimodal rows: its prefill embeds the placeholder ids like any token."""

    def __init__(self, drafter):
        self.drafter = drafter

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def draft(self, *args, inputs_embeds=None, **kwargs):
        return self.drafter.draft(*args, **kwargs)


def image_prompts(config, text: list[torch.Tensor], patches: int, text_after: int):
    """(input_ids, attention_mask, pixel_values): each text prompt with an image (its begin token and ``patches``
    placeholders) ``text_after`` tokens before its end, left-padded; random pixels for every image."""
    vision = config.vision_config
    image = torch.tensor([config.image_bos_token_id] + [config.image_token_id] * patches)
    ids, mask = left_pad([torch.cat([t[:len(t) - text_after], image, t[len(t) - text_after:]]) for t in text])
    shape = (vision.temporal_patch_size, vision.patch_size, vision.patch_size, vision.num_channels)
    return ids, mask, torch.randn(len(text) * patches, *shape, generator=torch.Generator().manual_seed(0))


def paired_seconds(calls: dict, device: torch.device, budget_s: float, min_pairs: int = 5) -> dict[str, list[float]]:
    """Seconds of each of two calls run back to back in pairs, the order swapped every pair, for about ``budget_s``
    after one untimed call of each: thread CPU time on CPU, synchronized wall time on CUDA."""
    timer = time.thread_time if device.type == "cpu" else time.perf_counter
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    names, found = list(calls), {name: [] for name in calls}
    with torch.no_grad():
        for call in calls.values():
            call()
        end = time.perf_counter() + budget_s
        while time.perf_counter() < end or len(found[names[0]]) < min_pairs:
            for name in names:
                sync()
                start = timer()
                calls[name]()
                sync()
                found[name].append(timer() - start)
            names.reverse()
    return found


def run_multimodal(checkpoint, text: list[torch.Tensor], *, k: int = 8, new_tokens: int = 32, patches: int = 6,
                   text_after: int = 2, compile: bool = True, budget_s: float = 6.0) -> Multimodal:
    target = load_hf_target(checkpoint).requires_grad_(False)
    mtp = InklingMTP.from_pretrained(checkpoint, target=target)
    ids, mask, pixels = image_prompts(target.config, text, patches, text_after)
    drafter = Drafter(mtp, max_batch_size=len(text), max_length=ids.shape[1] + new_tokens,
                      num_speculative_tokens=min(k, mtp.config.num_depths), compile=compile)
    greedy = dict(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None)
    progress(f"multimodal: {len(text)} image prompts, K = {drafter.num_speculative_tokens}, drafter prefill fed the "
             f"merged rows, then the placeholder ids{' (compiles first)' if compile else ''}")
    reference = target.generate(ids, attention_mask=mask, pixel_values=pixels, **greedy)
    runs = {name: speculative_generate(target, d, ids, mask, max_new_tokens=new_tokens, pixel_values=pixels)
            for name, d in (("merged", drafter), ("placeholder", PlaceholderDrafter(drafter)))}

    progress(f"multimodal: generate(custom_generate=...) vs speculative_generate, one image prompt (~{budget_s:.0f} s)")
    one, one_pixels = ids[:1, int((mask[0] == 0).sum()):], pixels[:patches]  # the first prompt, unpadded, its image
    seconds = paired_seconds({
        "generate": lambda: target.generate(one, pixel_values=one_pixels, custom_generate=custom_generate,
                                            drafter=drafter, **greedy),
        "speculative": lambda: speculative_generate(target, drafter, one, max_new_tokens=new_tokens,
                                                    pixel_values=one_pixels)}, mtp.device, budget_s)
    return Multimodal(
        checkpoint=str(checkpoint), k=drafter.num_speculative_tokens, prompts=len(text), image_patches=patches,
        new_tokens=new_tokens, compiled=compile,
        acceptance={name: out.acceptance_per_position for name, out in runs.items()},
        mean_accepted_length={name: out.mean_accepted_length for name, out in runs.items()},
        same_tokens=all(torch.equal(out.sequences, reference) for out in runs.values()),
        tokens_per_s={name: new_tokens / statistics.median(s) for name, s in seconds.items()},
        wrapper_cost=statistics.median(g / s for g, s in zip(seconds["generate"], seconds["speculative"])) - 1.0,
        pairs=len(seconds["generate"]), timer="thread CPU time" if mtp.device.type == "cpu" else "wall")


def measure(ctx: Context) -> Multimodal:
    s, target = ctx.settings, ctx.e2e_target()
    text = list(target.prompts[:4]) if target.prompts is not None else list(
        torch.randint(8, 256, (4, 24), generator=torch.Generator().manual_seed(0)))
    return run_multimodal(target.checkpoint, text, k=max(s.e2e_ks), new_tokens=min(32, s.e2e_tokens),
                          compile=s.runs("compiled"), budget_s=s.time_budget)


def lines(result: dict) -> list[str]:
    rows = [["drafter prefill", "acceptance per position", "mean accepted length"]]
    for name, label in (("merged", "merged rows (ours)"), ("placeholder", "placeholder ids")):
        rows.append([label, " ".join(f"{a:.2f}" for a in result["acceptance"][name]),
                     f"{result['mean_accepted_length'][name]:.2f}"])
    return [f"image prompts ({result['prompts']} x {result['image_patches']} patches, K = {result['k']}, "
            f"{result['new_tokens']} new tokens, drafter {'compiled' if result['compiled'] else 'eager'}; same tokens "
            f"as greedy generate: {yes(result['same_tokens'])})", *table(rows, "  "),
            f"  generate(custom_generate=...) {result['tokens_per_s']['generate']:.1f} tok/s vs speculative_generate "
            f"{result['tokens_per_s']['speculative']:.1f} tok/s ({result['timer']}): wrapper cost "
            f"{result['wrapper_cost']:+.1%} (median of {result['pairs']} pairs; goal < 2 %)"]
