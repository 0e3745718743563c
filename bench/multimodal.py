"""Image prompts and the ``generate(custom_generate=...)`` entry (issue 24): what feeding the drafter the target's
merged rows buys, and what the wrapper costs.

:func:`measure` runs the text target (``inkling_compiled.training.text_target``: trained on Python source, its 8
MTP depths self-distilled; its vision tower is random) on image prompts, an image of random patches between the
head and the last ``text_after`` tokens of a held-out source line, and reports:

* ``acceptance_merged`` / ``acceptance_placeholder``: acceptance per position over the same prompts, the drafter's
  prefill fed the target's merged rows (ours, docs/model.md §7) or the placeholder ids' embeddings (what drafting
  from ``input_ids`` alone gives, as transformers' ``generate(use_mtp=True)`` does), with the mean accepted lengths;
  ``same_tokens``: both equal the target's greedy ``generate`` (lossless either way);
* ``tokens_per_s_generate`` / ``tokens_per_s_speculative`` and ``wrapper_cost``: one image prompt through
  ``target.generate(..., custom_generate=custom_generate, drafter=...)`` and through ``speculative_generate`` with the
  same ``pixel_values``, timed in turns, the order swapped every repeat (median of ``repeats`` each, after one
  untimed call of each);
  ``wrapper_cost`` = generate's median time / speculative_generate's - 1 (the goal: < 2 %).

    python -m bench.multimodal [--k 8] [--new-tokens 32] [--patches 6] [--prompts 4] [--repeats 7] [--no-compile]
                               [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class MultimodalResult:
    k: int
    prompts: int
    image_patches: int
    new_tokens: int
    compiled: bool
    acceptance_merged: list[float]
    acceptance_placeholder: list[float]
    mean_accepted_length_merged: float
    mean_accepted_length_placeholder: float
    same_tokens: bool
    tokens_per_s_generate: float
    tokens_per_s_speculative: float
    wrapper_cost: float


class PlaceholderDrafter:
    """A drafter that never sees multimodal rows: its prefill embeds the placeholder ids like any token."""

    def __init__(self, drafter):
        self.drafter = drafter

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def draft(self, *args, inputs_embeds=None, **kwargs):
        return self.drafter.draft(*args, **kwargs)


def image_prompts(config, count: int, patches: int, length: int, text_after: int, seed: int = 0):
    """(input_ids [count, L], pixel_values [count * patches, ...]): held-out source lines of ``length`` tokens with an
    image (its begin token and ``patches`` placeholders) ``text_after`` tokens before the end."""
    from inkling_compiled.training import text_target

    gen = torch.Generator().manual_seed(seed)
    vision = config.vision_config
    text = text_target.heldout_prompts(count, length, seed=seed)
    image = torch.tensor([config.image_bos_token_id] + [config.image_token_id] * patches).expand(count, -1)
    ids = torch.cat([text[:, :length - text_after], image, text[:, length - text_after:]], dim=1)
    shape = (vision.temporal_patch_size, vision.patch_size, vision.patch_size, vision.num_channels)
    return ids, torch.randn(count * patches, *shape, generator=gen)


def measure(*, k: int = 8, new_tokens: int = 32, patches: int = 6, prompts: int = 4, prompt_len: int = 24,
            text_after: int = 2, repeats: int = 7, compile: bool = True, seed: int = 0) -> MultimodalResult:
    from inkling_compiled import InklingMTP
    from inkling_compiled.runtime import Drafter, custom_generate, speculative_generate
    from inkling_compiled.testing.synthetic import load_hf_target
    from inkling_compiled.training import text_target

    path = text_target.build(text_target.RECIPE)
    target = load_hf_target(path).requires_grad_(False)
    mtp = InklingMTP.from_pretrained(path, target=target)
    ids, pixels = image_prompts(target.config, prompts, patches, prompt_len, text_after, seed)
    drafter = Drafter(mtp, max_batch_size=prompts, max_length=ids.shape[1] + new_tokens, num_speculative_tokens=k,
                      compile=compile)
    greedy = dict(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None)
    reference = target.generate(ids, pixel_values=pixels, **greedy)
    runs = {name: speculative_generate(target, d, ids, max_new_tokens=new_tokens, pixel_values=pixels)
            for name, d in (("merged", drafter), ("placeholder", PlaceholderDrafter(drafter)))}
    same = all(torch.equal(out.sequences, reference) for out in runs.values())

    one_ids, one_pixels = ids[:1], pixels[:patches]
    calls = {"generate": lambda: target.generate(one_ids, pixel_values=one_pixels, custom_generate=custom_generate,
                                                 drafter=drafter, **greedy),
             "speculative": lambda: speculative_generate(target, drafter, one_ids, max_new_tokens=new_tokens,
                                                         pixel_values=one_pixels)}
    seconds = {name: [] for name in calls}
    with torch.no_grad():
        for call in calls.values():  # untimed: compiles and warms up both paths
            call()
        for repeat in range(repeats):
            for name, call in list(calls.items())[::1 if repeat % 2 else -1]:
                start = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    return MultimodalResult(
        k=k, prompts=prompts, image_patches=patches, new_tokens=new_tokens, compiled=compile,
        acceptance_merged=runs["merged"].acceptance_per_position,
        acceptance_placeholder=runs["placeholder"].acceptance_per_position,
        mean_accepted_length_merged=runs["merged"].mean_accepted_length,
        mean_accepted_length_placeholder=runs["placeholder"].mean_accepted_length,
        same_tokens=same,
        tokens_per_s_generate=new_tokens / median["generate"],
        tokens_per_s_speculative=new_tokens / median["speculative"],
        wrapper_cost=median["generate"] / median["speculative"] - 1.0)


def report(result: MultimodalResult) -> str:
    positions = " ".join(f"{a:.3f}" for a in result.acceptance_merged)
    placeholder = " ".join(f"{a:.3f}" for a in result.acceptance_placeholder)
    return "\n".join([
        f"image prompts: {result.prompts} x {result.image_patches} patches, K = {result.k}, "
        f"{result.new_tokens} new tokens, drafter {'compiled' if result.compiled else 'eager'}",
        f"acceptance per position, merged rows:    {positions}  (mean accepted length "
        f"{result.mean_accepted_length_merged:.3f})",
        f"acceptance per position, placeholder ids: {placeholder}  (mean accepted length "
        f"{result.mean_accepted_length_placeholder:.3f})",
        f"same tokens as greedy generate: {result.same_tokens}",
        f"tokens/s: generate(custom_generate=...) {result.tokens_per_s_generate:.1f}, speculative_generate "
        f"{result.tokens_per_s_speculative:.1f}; wrapper cost {100 * result.wrapper_cost:+.2f} % (goal < 2 %)"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.multimodal", description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--patches", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(k=args.k, new_tokens=args.new_tokens, patches=args.patches, prompts=args.prompts,
                     repeats=args.repeats, compile=not args.no_compile)
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(result), f, indent=1)
    return 0 if result.same_tokens else 1


if __name__ == "__main__":
    sys.exit(main())
