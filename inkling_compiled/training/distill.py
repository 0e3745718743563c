"""Self-distillation of the MTP depths on a target's own greedy continuations (synthetic, or the text target).

Random MTP weights draft nothing the target accepts, so an honest end-to-end speed-up needs a draft head that has
learnt the target. This module trains the MTP depths of a raw-layout Inkling checkpoint (the target frozen, its
embedding / embed_norm / LM head shared and frozen too) with the spec's alignment (docs/model.md §4.1,
docs/protocol.md §6.1):

    depth k at row t reads (g^{k-1}_t, x_{t+k+1}) and is trained to predict x_{t+k+2},   g^{-1}_t = h_t

where ``h`` is the target's post-final-norm ``last_hidden_state`` and the sequences are prompts (random ids, or
given ones such as real text) followed by the target's greedy continuation. Only rows whose label lies in the greedy
part count for hard labels and agreement (a random prompt token is not predictable). The loss is the sum over depths
of the mean cross-entropy of ``compute_logits`` (muP included).

The result is a new checkpoint directory that both transformers (target + ``MtpModel``) and ``InklingMTP`` load:
the target's ``.safetensors`` shards are hard-linked (copied across file systems), every other file (``config.json``,
the index) is copied, so that editing one in place leaves the source's alone, and ``mtp.safetensors`` holds the
trained depths in the stored dtype with the original raw keys. Directories are keyed by (source checkpoint,
hyper-parameters, format) and reused, like ``testing.synthetic.cached_checkpoint``; ``distill.json`` records what a
directory was made with, and a directory made with other arguments is refused, not returned.

    python -m inkling_compiled.training.distill [--config tiny] [--steps 300] [--out DIR]
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError

from .. import arguments
from ..arguments import ArgumentError
from ..atomic_files import build_directory_atomically
from ..checkpoint.layout import INDEX_FILE, MTP_FILE, CheckpointError
from ..checkpoint.reader import checkpoint_directory, open_checkpoint, read_header, stored_dtype
from ..config import CONFIG_FILE, ConfigError, logits_vocab_size
from ..testing.synthetic import PRESETS, cached_checkpoint, default_cache_root, greedy_generation_config, load_hf_target

PROG = "python -m inkling_compiled.training.distill"
FORMAT_VERSION = 1  # bump when the training recipe changes the written weights for the same arguments
METRICS_FILE = "distill.json"
DEFAULTS = dict(steps=400, seq_len=64, batch=32, seed=0, lr=1e-2, prompt_len=8, num_sequences=1024,
                eval_sequences=64, soft=True)


def _log(msg: str, progress: bool) -> None:
    if progress:
        print(f"[distill] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------- data

@dataclass
class GreedyData:
    """Sequences [N, T] (random prompt + target greedy continuation) and the target hiddens [N, T, H] (fp32)."""

    tokens: torch.Tensor
    hidden: torch.Tensor
    prompt_len: int

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def subset(self, index) -> GreedyData:
        return GreedyData(self.tokens[index], self.hidden[index], self.prompt_len)


def target_hidden(target, tokens: torch.Tensor) -> torch.Tensor:
    """The target's post-final-norm hidden (not divided by muP) for every position of ``tokens`` [B, T]."""
    with torch.no_grad():
        mask = torch.ones_like(tokens)
        return target.model(input_ids=tokens, attention_mask=mask).last_hidden_state


def random_prompts(target, *, num_sequences: int, prompt_len: int, seed: int) -> torch.Tensor:
    """[num_sequences, prompt_len] seeded random ids of the target's logits vocabulary (ids 0-2 left out)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, logits_vocab_size(target.config), (num_sequences, prompt_len), generator=gen)


def greedy_data(target, *, num_sequences: int, seq_len: int, prompt_len: int, seed: int, chunk: int = 64,
                progress: bool = False) -> GreedyData:
    """Random prompts of ``prompt_len`` ids continued greedily by ``target`` to ``seq_len`` tokens (EOS suppressed
    by decoding for exactly ``seq_len - prompt_len`` steps with no EOS id), with the target's hiddens."""
    prompts = random_prompts(target, num_sequences=num_sequences, prompt_len=prompt_len, seed=seed)
    return greedy_continuations(target, prompts, seq_len=seq_len, chunk=chunk, progress=progress)


def greedy_continuations(target, prompts: torch.Tensor, *, seq_len: int, chunk: int = 64,
                         progress: bool = False) -> GreedyData:
    """``prompts`` [N, P] continued greedily by ``target`` to ``seq_len`` tokens (EOS suppressed by decoding for
    exactly ``seq_len - P`` steps with no EOS id), with the target's hiddens."""
    if prompts.dim() != 2:
        raise ArgumentError(f"prompts must be [N, P] token ids, got shape {tuple(prompts.shape)}")
    num_sequences, prompt_len = prompts.shape
    if not 0 < prompt_len < seq_len:
        raise ArgumentError(f"need 0 < prompt_len < seq_len, got {prompt_len}, {seq_len}")
    vocab = logits_vocab_size(target.config)
    if int(prompts.min()) < 0 or int(prompts.max()) >= vocab:
        raise ArgumentError(f"prompt ids must lie in [0, {vocab}), got [{int(prompts.min())}, {int(prompts.max())}]")
    prompts = prompts.to(target.lm_head.weight.device)
    config = greedy_generation_config(target, seq_len - prompt_len)
    tokens, hidden = [], []
    start = time.perf_counter()
    with torch.no_grad():
        for lo in range(0, num_sequences, chunk):
            p = prompts[lo:lo + chunk]
            out = target.generate(p, attention_mask=torch.ones_like(p), generation_config=config)
            if out.shape[1] != seq_len:
                raise RuntimeError(f"generate returned {out.shape[1]} tokens, expected {seq_len}")
            tokens.append(out)
            hidden.append(target_hidden(target, out).float())
            done = min(lo + chunk, num_sequences)
            if done == num_sequences or (lo // chunk) % 4 == 3:
                _log(f"greedy continuations {done}/{num_sequences} ({time.perf_counter() - start:.1f} s)", progress)
    return GreedyData(torch.cat(tokens), torch.cat(hidden), prompt_len)


# ----------------------------------------------------------------------------------------------------------- loss

def depth_rows(seq_len: int, depth: int) -> int:
    """Rows depth ``depth`` can be trained on in a sequence of ``seq_len`` tokens: t = 0 .. T-3-depth."""
    return seq_len - 2 - depth


def mtp_loss(mtp, tokens: torch.Tensor, hidden: torch.Tensor, prompt_len: int, depths: int | None = None,
             soft: bool = False) -> tuple[torch.Tensor, list[float], list[float]]:
    """Sum over depths of the mean cross-entropy; also per-depth (loss, top-1 agreement) as floats.

    Depth k, row t: hidden g^{k-1}_t (h_t for k = 0), token x_{t+k+1}, label x_{t+k+2}. Positions are the absolute
    row indices (stateless full-sequence forward, ``cache=None``). Hard labels (``soft=False``): the greedy token,
    rows whose label lies inside the random prompt (index < prompt_len) ignored. Soft labels: cross-entropy against
    the target's own next-token distribution at t+k+1 (``softmax`` of the shared head on h_{t+k+1}), whose argmax is
    the greedy label, on every row (the prompt rows carry signal too). Agreement is always measured against the
    greedy tokens on the greedy rows.
    """
    batch, seq = tokens.shape
    depths = mtp.config.num_depths if depths is None else depths
    previous = hidden.to(mtp.dtype)
    total = tokens.new_zeros((), dtype=torch.float32)
    losses, accs = [], []
    for k in range(depths):
        n = depth_rows(seq, k)
        if n <= 0:
            break
        positions = torch.arange(n, device=tokens.device)[None].expand(batch, n)
        ids = tokens[:, k + 1:k + 1 + n]
        labels = tokens[:, k + 2:k + 2 + n]
        out = mtp(ids, positions, previous[:, :n], depth=k)
        logits = mtp.compute_logits(out).float()
        keep = (torch.arange(n, device=tokens.device) + k + 2 >= prompt_len)[None].expand(batch, n)
        if soft:
            with torch.no_grad():
                teacher = mtp.compute_logits(hidden[:, k + 1:k + 1 + n].to(mtp.dtype)).float().softmax(-1)
            ce = -(teacher * logits.log_softmax(-1)).sum(-1).mean()
        else:
            ce = F.cross_entropy(logits[keep], labels[keep])
        total = total + ce
        losses.append(float(ce.detach()))
        accs.append(float((logits[keep].argmax(-1) == labels[keep]).float().mean()))
        previous = out
    return total, losses, accs


def agreement(mtp, data: GreedyData, *, batch: int = 64) -> list[float]:
    """Teacher-forced top-1 agreement per depth on ``data``. For depth 0 this is exactly the greedy K=1 acceptance
    rate along the target's greedy path (the draft at row t sees h_t and the committed x_{t+1})."""
    sums, count = None, 0
    with torch.no_grad():
        for lo in range(0, len(data), batch):
            part = data.subset(slice(lo, lo + batch))
            _, _, accs = mtp_loss(mtp, part.tokens, part.hidden, data.prompt_len)
            n = part.tokens.shape[0]
            sums = [a * n for a in accs] if sums is None else [s + a * n for s, a in zip(sums, accs)]
            count += n
    return [s / count for s in sums]


def train(mtp, data: GreedyData, *, steps: int, batch: int, lr: float, seed: int, soft: bool = True,
          progress: bool = False, log_every: int = 50) -> list[float]:
    """Adam on the MTP depths (shared tensors frozen), cosine-decayed lr, warm-up 5 %; returns the loss per step."""
    params = [p for name, p in mtp.named_parameters() if name.startswith(("layers.", "chain_norm."))]
    for name, p in mtp.named_parameters():
        p.requires_grad_(name.startswith(("layers.", "chain_norm.")))
    opt = torch.optim.Adam(params, lr=lr)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / max(steps, 1))))
    gen = torch.Generator().manual_seed((seed + 1) % 2**64)  # modulo 2**64 as torch takes seeds: 2**64 - 1 overflowed
    history = []
    mtp.train()
    start = time.perf_counter()
    try:
        for step in range(steps):
            index = torch.randint(0, len(data), (batch,), generator=gen)
            part = data.subset(index)
            loss, losses, accs = mtp_loss(mtp, part.tokens, part.hidden, data.prompt_len, soft=soft)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            history.append(float(loss.detach()))
            if (step + 1) % log_every == 0 or step + 1 == steps:
                _log(f"step {step + 1}/{steps}  loss {history[-1]:.3f}  per-depth "
                     f"{' '.join(f'{x:.2f}' for x in losses)}  train top-1 {' '.join(f'{a:.2f}' for a in accs)}  "
                     f"({time.perf_counter() - start:.1f} s)", progress)
    finally:
        mtp.eval()
        mtp.requires_grad_(False)
    return history


# ------------------------------------------------------------------------------------------------------ checkpoint

def prompts_digest(prompts: torch.Tensor, eval_prompts: torch.Tensor) -> str:
    """Content hash of given prompts (part of the cache key in place of the random ones' seed)."""
    h = hashlib.sha256()
    for t in (prompts, eval_prompts):
        h.update(f"{tuple(t.shape)}".encode())
        h.update(t.to(torch.int64).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _key(checkpoint_dir: Path, params: dict) -> str:
    parts = {"source": str(checkpoint_dir.resolve()), "params": params, "format": FORMAT_VERSION}
    for name in (CONFIG_FILE, INDEX_FILE):
        f = checkpoint_dir / name
        parts[name] = f.read_text() if f.is_file() else None
    mtp = checkpoint_dir / MTP_FILE
    parts["mtp"] = [mtp.stat().st_size, mtp.stat().st_mtime_ns] if mtp.is_file() else None
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def default_out_dir(checkpoint_dir, **params) -> Path:
    """Where :func:`distill` caches the result for these arguments (filled with :data:`DEFAULTS`)."""
    checkpoint_dir = Path(checkpoint_dir)
    full = {**DEFAULTS, **params}
    return default_cache_root() / "distilled" / f"{checkpoint_dir.name}-{_key(checkpoint_dir, full)}"


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link for a tensor shard (never edited in place, and large), a copy of anything else (``config.json``
    and the index are small and edited in place: a link would edit the source checkpoint's too)."""
    if src.suffix == ".safetensors":
        try:
            os.link(src, dst)
            return
        except OSError:  # another file system
            pass
    shutil.copy2(src, dst)


def _stored_mtp(checkpoint_dir: Path) -> tuple[set[str], torch.dtype]:
    file = checkpoint_dir / MTP_FILE
    header = read_header(file)
    return set(header), stored_dtype({k: dtype for k, (dtype, _) in header.items()}, file)


def write_distilled(checkpoint_dir, mtp, out_dir, metrics: dict) -> Path:
    """Copy the target checkpoint (tensor shards hard-linked, see :func:`_link_or_copy`) into ``out_dir`` with
    ``mtp.safetensors`` replaced by ``mtp``'s depths (raw layout, the stored dtype), atomically (temp sibling, then
    rename)."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    keys, mtp_dtype = _stored_mtp(checkpoint_dir)

    def build(tmp: Path) -> None:
        for item in checkpoint_dir.iterdir():
            if item.name in (MTP_FILE, METRICS_FILE) or not item.is_file():
                continue
            _link_or_copy(item, tmp / item.name)
        scratch = tmp / ".mtp"
        original_dtype = mtp.dtype
        mtp.to(mtp_dtype).save_pretrained(scratch, include_shared=False)
        mtp.to(original_dtype)
        written, _ = _stored_mtp(scratch)
        if written != keys:
            raise RuntimeError(f"trained MTP keys differ from {checkpoint_dir / MTP_FILE}: "
                               f"missing {sorted(keys - written)[:5]}, extra {sorted(written - keys)[:5]}")
        os.replace(scratch / MTP_FILE, tmp / MTP_FILE)
        shutil.rmtree(scratch)
        (tmp / METRICS_FILE).write_text(json.dumps(metrics, indent=2) + "\n")

    return build_directory_atomically(out_dir, build, complete=METRICS_FILE)


METRICS_KEYS = ("source", "params", "format", "loss_first", "loss_last", "agreement_before", "agreement_after",
                "total_seconds")  # what the reuse check and the command line's summary read


def load_metrics(out_dir) -> dict:
    """The ``distill.json`` written next to a distilled checkpoint (losses, agreement before / after, timings);
    CheckpointError naming the file when it is no JSON object with :data:`METRICS_KEYS`."""
    file = Path(out_dir) / METRICS_FILE
    try:
        metrics = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: not a distill.json (no JSON: {e})") from e
    if not isinstance(metrics, dict):
        raise CheckpointError(f"{file}: not a distill.json (a JSON {type(metrics).__name__}, not an object)")
    missing = [key for key in METRICS_KEYS if key not in metrics]
    if missing or not isinstance(metrics["params"], dict):
        raise CheckpointError(f"{file}: not a distill.json "
                              f"({'it lacks ' + ', '.join(missing) if missing else 'its params are no object'})")
    return metrics


def _check_reuse(out_dir: Path, checkpoint_dir: Path, params: dict, *, cli: bool = False) -> None:
    """ArgumentError when the finished ``out_dir`` was distilled from another checkpoint or with other arguments
    than ``params``: it was returned as this call's result. ``cli``: named as the command line's options."""
    recorded = load_metrics(out_dir)
    shown = (lambda key: "--" + key.replace("_", "-")) if cli else str
    differ = [f"{shown(key)} {recorded['params'].get(key)!r} (asked {params.get(key)!r})"
              for key in sorted({*params, *recorded["params"]}) if recorded["params"].get(key) != params.get(key)]
    if Path(recorded["source"]).resolve() != checkpoint_dir.resolve():
        differ.insert(0, f"the source {recorded['source']!r} (asked {str(checkpoint_dir)!r})")
    if recorded["format"] != FORMAT_VERSION:
        differ.append(f"format {recorded['format']!r} (this version writes {FORMAT_VERSION})")
    if differ:
        raise ArgumentError(f"{'--out' if cli else 'out_dir'} {str(out_dir)!r} holds a distillation made otherwise: "
                            f"{'; '.join(differ)}; name another directory, or pass "
                            f"{'--force' if cli else 'force=True'} to replace it")


# ------------------------------------------------------------------------------------------------------------- API

def distill(checkpoint_dir, out_dir=None, *, steps: int = DEFAULTS["steps"], seq_len: int = DEFAULTS["seq_len"],
            batch: int = DEFAULTS["batch"], seed: int = DEFAULTS["seed"], lr: float = DEFAULTS["lr"],
            prompt_len: int = DEFAULTS["prompt_len"], num_sequences: int = DEFAULTS["num_sequences"],
            eval_sequences: int = DEFAULTS["eval_sequences"], soft: bool = DEFAULTS["soft"], force: bool = False,
            progress: bool = True, prompts: torch.Tensor | None = None,
            eval_prompts: torch.Tensor | None = None) -> Path:
    """Self-distil the MTP depths of the raw-layout checkpoint ``checkpoint_dir``; return the distilled directory.

    The sequences are greedy continuations of random prompts (``num_sequences`` + ``eval_sequences`` of
    ``prompt_len`` ids), or of the given ``prompts`` [N, P] and ``eval_prompts`` [M, P] (real text, say), which
    then decide those three numbers.

    ``out_dir`` defaults to a cache directory keyed by the checkpoint and every argument; an existing complete
    directory is returned as is unless ``force``, if its ``distill.json`` records this checkpoint and these
    arguments (one made otherwise is an ArgumentError naming what differs). Seeded: the same arguments give the
    same weights (CPU, fp32). Metrics (loss history, depth agreement before / after on ``eval_sequences`` held-out
    sequences, timings) are in ``out_dir/distill.json`` (:func:`load_metrics`). ``soft``: cross-entropy against the
    target's full next-token distribution (default; learns faster, overfits less) instead of its greedy token (see
    :func:`mtp_loss`).
    """
    from ..model.mtp import InklingMTP

    checkpoint_dir = arguments.path("checkpoint_dir", checkpoint_dir)
    if (prompts is None) != (eval_prompts is None):
        raise ArgumentError("give both prompts and eval_prompts, or neither")
    if prompts is not None:
        if prompts.dim() != 2 or eval_prompts.dim() != 2 or prompts.shape[1] != eval_prompts.shape[1]:
            raise ArgumentError(f"prompts and eval_prompts must be [N, P] and [M, P], got {tuple(prompts.shape)} and "
                                f"{tuple(eval_prompts.shape)}")
        (num_sequences, prompt_len), eval_sequences = prompts.shape, eval_prompts.shape[0]
    params = dict(steps=steps, seq_len=seq_len, batch=batch, seed=seed, lr=lr, prompt_len=prompt_len,
                  num_sequences=num_sequences, eval_sequences=eval_sequences, soft=soft)
    _check_arguments(params, force=force, progress=progress)
    if prompts is not None:
        params["prompts"] = prompts_digest(prompts, eval_prompts)
    out_dir = arguments.path("out_dir", out_dir) if out_dir is not None else default_out_dir(checkpoint_dir, **params)
    if (out_dir / METRICS_FILE).is_file() and not force:
        _check_reuse(out_dir, checkpoint_dir, params)
        _log(f"cached: {out_dir}", progress)
        return out_dir
    _check_out_dir(out_dir, checkpoint_dir)
    if force and out_dir.exists():
        shutil.rmtree(out_dir)

    start = time.perf_counter()
    torch.manual_seed(seed)
    _log(f"target {checkpoint_dir}", progress)
    target = load_hf_target(checkpoint_dir, dtype=torch.float32).requires_grad_(False)
    if prompts is None:
        prompts = random_prompts(target, num_sequences=num_sequences + eval_sequences, prompt_len=prompt_len,
                                 seed=seed)
    else:
        prompts = torch.cat([prompts, eval_prompts])
    data = greedy_continuations(target, prompts, seq_len=seq_len, progress=progress)
    train_data, eval_data = data.subset(slice(0, num_sequences)), data.subset(slice(num_sequences, None))
    t_data = time.perf_counter() - start
    del target

    mtp = InklingMTP.from_pretrained(checkpoint_dir, dtype=torch.float32)
    before = agreement(mtp, eval_data)
    _log(f"held-out top-1 agreement before: {' '.join(f'{a:.3f}' for a in before)}", progress)
    t0 = time.perf_counter()
    history = train(mtp, train_data, steps=steps, batch=batch, lr=lr, seed=seed, soft=soft, progress=progress)
    t_train = time.perf_counter() - t0
    after = agreement(mtp, eval_data)
    _log(f"held-out top-1 agreement after:  {' '.join(f'{a:.3f}' for a in after)} "
         f"(depth 0 = greedy K=1 acceptance)", progress)
    metrics = dict(source=str(checkpoint_dir), params=params, format=FORMAT_VERSION,
                   loss_first=history[0] if history else None, loss_last=history[-1] if history else None,
                   loss_history=history, agreement_before=before, agreement_after=after,
                   data_seconds=t_data, train_seconds=t_train, total_seconds=time.perf_counter() - start)
    write_distilled(checkpoint_dir, mtp, out_dir, metrics)
    _log(f"wrote {out_dir} ({time.perf_counter() - start:.1f} s)", progress)
    return out_dir


def _check_arguments(params: dict, **flags) -> None:
    """Every count >= 1, prompt_len < seq_len, a finite lr > 0, a seed torch takes, bools: before the target's
    continuations are generated (the costly part), where a bad one failed deep inside, or, for steps <= 0, silently
    wrote an undistilled copy."""
    for name in ("steps", "seq_len", "batch", "prompt_len", "num_sequences", "eval_sequences"):
        arguments.positive_int(name, params[name])
    if params["prompt_len"] >= params["seq_len"]:
        raise ArgumentError(f"prompt_len must be < seq_len ({params['seq_len']}), the length each prompt is continued "
                            f"to, got {params['prompt_len']}")
    if not arguments.is_number(params["lr"]) or not 0 < params["lr"] < math.inf:
        raise ArgumentError(f"lr must be a finite number > 0, got {params['lr']!r}")
    if not -(2**63) <= arguments.integer("seed", params["seed"]) < 2**64:  # what torch.manual_seed takes
        raise ArgumentError(f"seed must be in [-2**63, 2**64), got {params['seed']}")
    for name, value in {"soft": params["soft"], **flags}.items():
        arguments.check_bool(name, value)


def _check_out_dir(out_dir: Path, checkpoint_dir: Path, name: str = "out_dir") -> None:
    """ArgumentError unless ``out_dir`` is new, empty or a distilled checkpoint (what ``force`` may delete), and
    neither ``checkpoint_dir`` nor a directory holding it."""
    if out_dir.resolve() in (checkpoint_dir.resolve(), *checkpoint_dir.resolve().parents):
        raise ArgumentError(f"{name} {str(out_dir)!r} holds the checkpoint distilled ({str(checkpoint_dir)!r}): "
                            "name a new or empty directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / METRICS_FILE).is_file():
        raise ArgumentError(f"{name} {str(out_dir)!r} holds files but no {METRICS_FILE}, so is no distilled "
                            "checkpoint (a forced run would delete it): name a new or empty directory")


def main(argv=None) -> int:
    parser = arguments.OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="raw-layout checkpoint directory to distil (default: the --config preset)")
    src.add_argument("--config", choices=sorted(PRESETS), default="tiny",
                     help="synthetic preset to generate and distil (default tiny)")
    parser.add_argument("--out", type=arguments.writable_directory_option,
                        help="output directory (default: a cache directory keyed by the arguments)")
    for name, value in DEFAULTS.items():
        if not isinstance(value, bool):
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--hard-labels", dest="soft", action="store_false",
                        help="train on the greedy tokens instead of the target's next-token distribution")
    parser.add_argument("--threads", type=arguments.threads_option, default=None, help="torch intra-op threads")
    parser.add_argument("--force", action="store_true", help="retrain even if a cached result exists")
    args = parser.parse_args(argv)
    params = {name: getattr(args, name) for name in DEFAULTS}
    try:
        _check_arguments(params)
    except ArgumentError as e:  # "--num-sequences must be an int >= 1, got 0": the options' names, not the API's
        parser.error(re.sub(rf"\b({'|'.join(DEFAULTS)})\b", lambda m: f"--{m[1].replace('_', '-')}", str(e)))
    if args.checkpoint is not None:
        try:
            checkpoint_directory("--checkpoint", args.checkpoint)
        except ArgumentError as e:
            parser.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    try:  # the library's refusals and unreadable or damaged files: one line, as in generate.py
        checkpoint = Path(args.checkpoint) if args.checkpoint else cached_checkpoint(args.config)
        open_checkpoint(checkpoint)  # the library's own checks of config and files, before transformers reads them
        if args.out is not None:
            _check_out_dir(args.out, checkpoint, "--out")
            if (args.out / METRICS_FILE).is_file() and not args.force:
                _check_reuse(args.out, checkpoint, params, cli=True)
        out = distill(checkpoint, args.out, force=args.force, **params)
        metrics = load_metrics(out)
    except (ArgumentError, ConfigError, CheckpointError, OSError, SafetensorError) as e:  # not a bug's ValueError
        return arguments.refused(PROG, e)
    print(json.dumps({"out_dir": str(out), "agreement_before": metrics["agreement_before"],
                      "agreement_after": metrics["agreement_after"], "loss_first": metrics["loss_first"],
                      "loss_last": metrics["loss_last"], "total_seconds": metrics["total_seconds"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
