"""Speculative generation from the command line: ``python -m inkling_compiled.generate``.

Loads a transformers Inkling target and its MTP head from a raw-layout checkpoint directory (default: the tiny
synthetic checkpoint, written once and cached), builds the drafter, generates from random prompts with
:func:`inkling_compiled.runtime.speculative.speculative_generate`, and prints the tokens and acceptance figures.
Random MTP weights give (near) zero acceptance: the figures are only meaningful for trained or distilled heads.
``--text-target`` uses the tiny target trained on Python standard-library source instead
(:mod:`inkling_compiled.training.text_target`): prompts are held-out source lines and the output is printed as text.
``--image N`` / ``--audio N`` put an image of N random patches / N random audio frames into every prompt of the
synthetic target (its placeholder tokens after the first two tokens): the target and the drafter's prefill read the
merged rows (docs/model.md §7).
``--tp N`` under ``torchrun --nproc-per-node N`` shards the draft head over the N ranks (docs/model.md §11; gloo on
CPU, NCCL on CUDA, one GPU per rank); the target is replicated, every rank generates the same tokens and rank 0
prints them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
from safetensors import SafetensorError

from . import arguments
from .checkpoint.reader import checkpoint_directory, open_checkpoint
from .testing.synthetic import PRESETS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROG = "python -m inkling_compiled.generate"
# what torchrun sets in each process and --tp reads (the process group's env:// rendezvous, this rank's device)
TORCHRUN_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def parse_args(argv=None) -> argparse.Namespace:
    """The parsed arguments, every one checked (paths and device included) before anything is loaded."""
    parser = arguments.OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", help="raw Inkling checkpoint directory (default: tiny synthetic checkpoint)")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="synthetic preset used when no --checkpoint is given (default tiny; tiny8 has 8 depths)")
    parser.add_argument("--distilled", action="store_true",
                        help="with the default checkpoint: self-distil its MTP first (cached; ~5 min the first time on "
                             "2 CPU cores)")
    parser.add_argument("--text-target", action="store_true",
                        help="the tiny target trained on stdlib source (built and cached on first use, ~3 min): "
                             "held-out prompts, decoded text out")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=None,
                        help="drafts per round, i.e. MTP depths chained (default: every depth of the checkpoint)")
    parser.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt (default 16)")
    parser.add_argument("--batch", type=int, default=1, help="number of sequences (default 1)")
    parser.add_argument("--ragged", action="store_true",
                        help="give the sequences different prompt lengths (left padding)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="default 32")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image", type=int, default=0, metavar="N",
                        help="put an image of N random vision patches into every prompt (synthetic target)")
    parser.add_argument("--audio", type=int, default=0, metavar="N",
                        help="put N random audio frames into every prompt (synthetic target)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the checkpoint's EOS ids")
    parser.add_argument("--no-compile", action="store_true", help="run the drafter eagerly")
    parser.add_argument("--no-warmup", action="store_true", help="time the first call (compilation included)")
    parser.add_argument("--check", action="store_true",
                        help="greedy only: also run the target's own generate() and compare the tokens")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks for the draft head; launch with torchrun --nproc-per-node N")
    args = parser.parse_args(argv)
    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    unset = [name for name in TORCHRUN_ENV if not os.environ.get(name)]
    if args.tp > 1 and (os.environ.get("WORLD_SIZE") != str(args.tp) or unset):
        parser.error(f"--tp {args.tp} needs {args.tp} processes: launch with torchrun --nproc-per-node {args.tp} -m "
                     f"inkling_compiled.generate --tp {args.tp} ... (WORLD_SIZE is {os.environ.get('WORLD_SIZE')}"
                     f"{'; unset: ' + ', '.join(unset) if unset else ''})")
    for name in ("prompt_len", "batch", "max_new_tokens", "num_speculative_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not -(2**63) <= args.seed < 2**64:  # what torch.manual_seed takes
        parser.error(f"--seed must be in [-2**63, 2**64), got {args.seed}")
    for flag, check in (("--temperature", lambda: arguments.temperature(args.temperature)),
                        ("--top-p", lambda: arguments.top_p(args.top_p)),
                        ("--device", lambda: arguments.device(args.device, "--device", runs=True)),
                        ("--checkpoint", lambda: args.checkpoint is None
                         or checkpoint_directory("--checkpoint", args.checkpoint))):
        try:
            check()
        except arguments.ArgumentError as e:
            parser.error(str(e) if str(e).startswith(flag) else f"{flag}: {e}")
    if args.check and args.temperature > 0:
        parser.error("--check compares against greedy generate(); use it with --temperature 0")
    given = [flag for flag, value in (("--checkpoint", args.checkpoint), ("--text-target", args.text_target)) if value]
    if len(given) > 1:
        parser.error("--checkpoint and --text-target each name the checkpoint: give one of them")
    for flag, value in (("--preset", args.preset), ("--distilled", args.distilled)):
        if value and given:
            parser.error(f"{flag} chooses the synthetic checkpoint; {given[0]} names another: leave out {flag}")
    args.preset = args.preset or "tiny"
    if args.image < 0 or args.audio < 0:
        parser.error("--image and --audio take a count >= 0")
    if args.text_target and (args.image or args.audio):
        parser.error("--image / --audio need the multimodal synthetic target, not --text-target")
    return args


def device_mesh(args):
    """With ``--tp N``: join torchrun's process group (gloo on CPU, NCCL on CUDA with one GPU per local rank) and
    return its 1-D DeviceMesh; ``args.device`` becomes this rank's device. None without."""
    if args.tp == 1:
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    kind = torch.device(args.device).type
    if kind == "cuda":
        args.device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(args.device)
    dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    return init_device_mesh(kind, (args.tp,))


def build(args, mesh=None):
    """(path, target, drafter) for the parsed arguments (the draft head sharded over ``mesh`` when given)."""
    from .model import InklingMTP
    from .runtime.drafter import Drafter
    from .testing.synthetic import cached_checkpoint, load_hf_target

    if args.checkpoint:
        path = args.checkpoint
    elif args.text_target:
        from .training import text_target

        path = text_target.build(text_target.RECIPE)
    else:
        path = cached_checkpoint(args.preset)
        if args.distilled:  # random MTP weights draft nothing the target accepts
            from .training.distill import distill

            path = distill(path)
    open_checkpoint(path)  # the library's own checks of config and files, before transformers reads them
    dtype = DTYPES[args.dtype]
    target = load_hf_target(path, dtype=dtype).to(args.device).requires_grad_(False)
    mtp = InklingMTP.from_pretrained(path, target=target, dtype=dtype, device=args.device, device_mesh=mesh)
    prompt_len = args.prompt_len + (args.image + 1 if args.image else 0) + (args.audio + 1 if args.audio else 0)
    drafter = Drafter(mtp, max_batch_size=args.batch, max_length=prompt_len + args.max_new_tokens,
                      num_speculative_tokens=args.num_speculative_tokens, compile=not args.no_compile)
    return path, target, drafter


def make_prompts(args, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids (or held-out text with ``--text-target``) [batch, prompt_len], left-padded with ``--ragged``."""
    gen = torch.Generator().manual_seed(args.seed)
    pad = 0
    if args.text_target:
        from .training import text_target

        ids, pad = text_target.heldout_prompts(args.batch, args.prompt_len, seed=args.seed), text_target.PAD_ID
    else:
        ids = torch.randint(min(8, vocab - 1), vocab, (args.batch, args.prompt_len), generator=gen)
    mask = torch.ones_like(ids)
    if args.ragged and args.batch > 1:
        lengths = torch.randint(max(1, args.prompt_len // 2), args.prompt_len + 1, (args.batch,), generator=gen)
        for b, n in enumerate(lengths.tolist()):
            mask[b, : args.prompt_len - n] = 0
            ids[b, : args.prompt_len - n] = pad
    return ids.to(args.device), mask.to(args.device)


def add_media(args, target, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """With ``--image`` / ``--audio``: every prompt with its placeholder rows (a begin token, then one placeholder per
    patch / frame) after its first two real tokens, and the random inputs ``generate`` takes for them."""
    if not (args.image or args.audio):
        return ids, mask, {}
    # the seed after --seed's, wrapped as torch wraps seeds (modulo 2**64): --seed 2**64 - 1 overflowed here
    config, gen = target.config, torch.Generator().manual_seed((args.seed + 1) % 2**64)
    media, inserted = {}, []
    if args.image:
        vision = config.vision_config
        patch = (vision.temporal_patch_size, vision.patch_size, vision.patch_size, vision.num_channels)
        media["pixel_values"] = torch.randn(args.batch * args.image, *patch, generator=gen).to(
            args.device, target.model.vision_tower.dtype)  # as --dtype loaded the vision tower
        inserted += [config.image_bos_token_id] + [config.image_token_id] * args.image
    if args.audio:
        audio = config.audio_config
        media["audio_input_ids"] = torch.randint(0, audio.codebook_size, (args.batch, args.audio, audio.num_codebooks),
                                                 generator=gen).to(args.device)
        inserted += [config.audio_bos_token_id] + [config.audio_token_id] * args.audio
    extra = torch.tensor(inserted, device=ids.device)
    rows = []
    for b in range(ids.shape[0]):
        real = ids[b, mask[b].bool()]
        rows.append(torch.cat([real[:2], extra, real[2:]]))
    width = max(len(r) for r in rows)
    new_ids = torch.zeros(len(rows), width, dtype=torch.long, device=ids.device)
    new_mask = torch.zeros_like(new_ids)
    for b, row in enumerate(rows):
        new_ids[b, width - len(row):], new_mask[b, width - len(row):] = row, 1
    return new_ids, new_mask, media


def ranks_agree(sequences: torch.Tensor) -> bool:
    """Whether every rank of the default process group generated ``sequences`` exactly (rank 0's, broadcast)."""
    import torch.distributed as dist

    reference = sequences.clone()
    dist.broadcast(reference, src=0)
    same = torch.tensor([int(torch.equal(reference, sequences))], device=sequences.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.device.startswith("cuda"):  # transformers' note that causal_conv1d, a CUDA kernel, is not installed
        logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)
    mesh = device_mesh(args)
    try:
        return generate(args, mesh)
    finally:
        if mesh is not None:
            torch.distributed.destroy_process_group()


def generate(args, mesh) -> int:
    """Build, generate (after a warm-up call), print; 1 when a requested check fails."""
    from .config import logits_vocab_size
    from .runtime.speculative import speculative_generate
    from .testing.synthetic import greedy_generation_config

    torch.manual_seed(args.seed)
    say = print if mesh is None or mesh.get_rank() == 0 else (lambda *_: None)  # rank 0 speaks for all
    try:
        path, target, drafter = build(args, mesh)
    except (ValueError, TypeError, OSError, MemoryError, SafetensorError) as e:  # the library's refusals (a cache
        # too large for --batch / --prompt-len / --max-new-tokens included), unreadable or damaged files: one line
        return arguments.refused(PROG, e)
    ids, mask = make_prompts(args, logits_vocab_size(target.config.get_text_config()))
    ids, mask, media = add_media(args, target, ids, mask)
    eos = None if args.ignore_eos else target.generation_config.eos_token_id
    pad = target.generation_config.pad_token_id

    def run():
        gen = torch.Generator(device=args.device).manual_seed(args.seed)
        return speculative_generate(target, drafter, ids, mask, max_new_tokens=args.max_new_tokens,
                                    temperature=args.temperature, top_p=args.top_p, eos_token_id=eos,
                                    pad_token_id=pad, generator=gen, **media)

    try:
        if not args.no_warmup:
            run()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = run()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    except arguments.ArgumentError as e:  # the options were checked in parse_args: what the loop refuses here is the
        # checkpoint's (its EOS / pad ids, say), so the line names it
        return arguments.refused(PROG, arguments.ArgumentError(f"checkpoint {path}: {e}"))

    say(f"checkpoint: {path}")
    say(f"target: {type(target).__name__}, drafter compile={not args.no_compile}, device={args.device}, "
        f"dtype={args.dtype}, temperature={args.temperature}, top_p={args.top_p}, eos={eos}"
        + (f", image patches {args.image}" if args.image else "")
        + (f", audio frames {args.audio}" if args.audio else ""))
    prompt_len = ids.shape[1]
    for b in range(ids.shape[0]):
        real = int(mask[b].sum())
        prompt, new = ids[b, prompt_len - real:], out.sequences[b, prompt_len:]
        if args.text_target:
            from .training.text_target import decode

            say(f"[{b}] prompt ({real} bytes):\n{decode(prompt)}\n[{b}] generated ({new.shape[0]} tokens):\n"
                  f"{decode(new)}\n[{b}] end")
        else:
            say(f"[{b}] prompt ({real}): {prompt.tolist()}")
            say(f"[{b}] new    ({out.num_new_tokens}): {new.tolist()}")
    say(f"drafted {out.num_drafted}, accepted {out.num_accepted}, acceptance rate {out.acceptance_rate:.3f}, "
          f"mean accepted length {out.mean_accepted_length:.3f} tokens / target forward "
          f"({out.num_rounds} verify rounds + prefill)")
    say(f"acceptance per position (K = {out.num_speculative_tokens}): "
          f"{' '.join(f'{a:.3f}' for a in out.acceptance_per_position)}")
    say(f"accepted per round: {out.accepted_per_round}")
    say(f"tokens per round:   {out.emitted_per_round}")
    new_tokens = out.num_new_tokens * ids.shape[0]
    say(f"time {seconds * 1e3:.1f} ms, {new_tokens / seconds:.1f} tokens/s"
          f"{'' if args.no_warmup else ' (after one warm-up call)'}")
    if mesh is not None:
        agree = ranks_agree(out.sequences)
        say(f"tensor-parallel ranks (--tp {args.tp}) generated the same tokens: {agree}")
        if not agree:
            return 1
    if args.check:
        config = greedy_generation_config(target, args.max_new_tokens, eos_token_id=eos)
        reference = target.generate(ids, attention_mask=mask, generation_config=config, **media)
        same = torch.equal(reference, out.sequences)
        say(f"greedy generate() match: {same}")
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
