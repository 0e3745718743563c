"""A tiny Inkling target trained from scratch on real text, so that end-to-end acceptance means something.

A random synthetic target's greedy continuations are a fixed function of random weights; a language model's are
not. No real Inkling weights can be downloaded here, so this module trains one on text every machine has: a fixed,
listed set of the Python standard library's own source files, read from the running interpreter's stdlib directory
and split into train and held-out modules. Tokens are bytes (ids 0..255) plus a few special ids above them (BOS /
EOS / PAD and the multimodal placeholders the config names); the logits cover exactly those (``unpadded_vocab_size``)
and the embedding tables are padded to a multiple of 64.

The target is a real transformers Inkling (``InklingForCausalLM`` trained with AdamW + cosine, written as
``InklingForConditionalGeneration`` in the raw layout of :mod:`inkling_compiled.testing.synthetic`: ``model.llm.*``
shards and ``mtp.safetensors`` with 8 MTP depths in Inkling's pattern, 0, 2, 4, 5, 6, 7 sliding and 1, 3 full). Its
8 depths are then self-distilled (:func:`inkling_compiled.training.distill.distill`) on the target's greedy
continuations of train-file text; their agreement is measured on continuations of held-out text (= greedy
acceptance, inflated when the target loops) and on held-out text itself (:func:`text_agreement`). Everything is
seeded; the result is cached under the checkpoint cache root, keyed by the corpus content (a different Python's
stdlib is a different corpus) and the recipe, and built on first use with progress printed (docs/text-target.md).

    python -m inkling_compiled.training.text_target [--reduced] [--force]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import arguments
from ..arguments import ArgumentError
from ..model.torchao_schemes import quiet_import

FORMAT_VERSION = 1  # bump when the build writes different weights for the same corpus and recipe
METRICS_FILE = "text_target.json"

# Standard-library modules (``a.b`` -> ``a/b.py`` or ``a/b/__init__.py``), present from Python 3.9 on.
TRAIN_MODULES = (
    "argparse", "ast", "base64", "calendar", "collections", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "difflib", "enum", "fractions", "functools", "ipaddress", "json.decoder", "json.encoder",
    "logging", "operator", "optparse", "queue", "random", "shutil", "statistics", "threading", "tokenize",
    "traceback", "uuid", "weakref",
)
HELDOUT_MODULES = ("textwrap", "shlex", "pprint", "heapq", "glob", "fnmatch", "bisect", "numbers")

BYTES = 256
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
IMAGE_TOKEN_ID, IMAGE_BOS_TOKEN_ID, AUDIO_BOS_TOKEN_ID, AUDIO_TOKEN_ID = 259, 260, 261, 262
LOGITS_VOCAB = 263  # unpadded_vocab_size: bytes + the specials above
VOCAB = 320  # embedding / LM-head rows, padded to a multiple of 64
SPECIAL_NAMES = {BOS_ID: "<bos>", EOS_ID: "<eos>", PAD_ID: "<pad>"}
MTP_DEPTHS = 8


def _log(msg: str, progress: bool) -> None:
    if progress:
        print(f"[text-target] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------------- corpus

def stdlib_dir() -> Path:
    """The running interpreter's pure-Python standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def module_source(module: str, root: Path) -> bytes:
    """Source bytes of standard-library ``module`` under ``root`` (a module file or a package's ``__init__``)."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.read_bytes()
    raise FileNotFoundError(f"standard-library module {module!r} not found under {root} "
                            f"(looked for {base.with_suffix('.py').name} and {base.name}/__init__.py)")


@dataclass(frozen=True)
class Corpus:
    """Source bytes per module, train and held-out; ``digest`` hashes names and contents of both."""

    train: dict[str, bytes]
    heldout: dict[str, bytes]

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for split in (self.train, self.heldout):
            for name, data in split.items():
                h.update(f"{name}\0{len(data)}\0".encode())
                h.update(data)
            h.update(b"\1")
        return h.hexdigest()

    def stream(self, split: str) -> torch.Tensor:
        """One id stream of ``split`` ("train" / "heldout"): each file as BOS + its bytes + EOS, in listed order."""
        files = {"train": self.train, "heldout": self.heldout}[split]
        parts = [torch.tensor([BOS_ID, *data, EOS_ID], dtype=torch.long) for data in files.values()]
        return torch.cat(parts)


def load_corpus(root=None, train=TRAIN_MODULES, heldout=HELDOUT_MODULES) -> Corpus:
    """The listed modules' sources from ``root`` (default: :func:`stdlib_dir`)."""
    root = Path(root) if root is not None else stdlib_dir()
    overlap = sorted(set(train) & set(heldout))
    if overlap:
        raise ValueError(f"modules both in train and held-out: {overlap}")
    return Corpus({m: module_source(m, root) for m in train}, {m: module_source(m, root) for m in heldout})


def encode(text: str | bytes) -> torch.Tensor:
    """Byte ids of ``text`` (UTF-8), int64 [N]."""
    if not isinstance(text, (str, bytes, bytearray)):
        raise ArgumentError(f"text must be a str or bytes, got {type(text).__name__} {text!r}")
    data = text.encode() if isinstance(text, str) else bytes(text)
    return torch.tensor(list(data), dtype=torch.long)


def decode(ids) -> str:
    """Text of byte ids (a 1-d integer tensor or a list of ints; invalid UTF-8 replaced); special ids shown by name,
    pad dropped."""
    values = arguments.integer_tensor("ids", ids, ndim=1).tolist() if isinstance(ids, torch.Tensor) else list(ids)
    if not all(arguments.is_int(i) for i in values):
        raise ArgumentError(f"ids must be integer token ids, got {ids!r}")
    out, run = [], bytearray()
    for i in values:
        if 0 <= i < BYTES:
            run.append(i)
            continue
        out.append(run.decode("utf-8", errors="replace"))
        run = bytearray()
        if i != PAD_ID:
            out.append(SPECIAL_NAMES.get(i, f"<id {i}>"))
    out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)


def line_start_windows(stream: torch.Tensor, count: int, length: int, seed: int) -> torch.Tensor:
    """``count`` windows [count, length] of ``stream`` starting at seeded random line starts (after a newline or a
    BOS), never crossing a file's EOS: prompts that look like the text a person would continue."""
    count, length = arguments.positive_int("count", count), arguments.positive_int("length", length)
    seed = arguments.integer("seed", seed)
    starts = torch.nonzero((stream == ord("\n")) | (stream == BOS_ID)).flatten() + 1
    starts = starts[starts + length <= len(stream)]
    windows = stream[starts[:, None] + torch.arange(length)[None]]
    windows = windows[(windows < BYTES).all(1)]  # inside one file, bytes only
    if len(windows) < count:
        raise ArgumentError(f"count={count} windows of {length} bytes requested, the stream has only {len(windows)}")
    pick = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed))[:count]
    return windows[pick]


# --------------------------------------------------------------------------------------------------------- recipe

@dataclass(frozen=True)
class Recipe:
    """Everything that decides the weights, besides the corpus. Distillation fields start with ``distill_``.

    The defaults fit about 3 minutes of one CPU thread (train ~105 s, distil ~50 s). At that budget the step count
    limits learning more than the width does (per step, transformers' eager layers cost about the same at H 32, 48
    or 64), so the model is narrow and the learning rate high: H 48 reached 2.45 held-out bits per byte where H 64
    at the same CPU time reached 3.2-3.4 (H 32: 2.74). The trunk keeps 8 layers for transformers' MtpModel (see
    ``num_layers``).
    """

    seed: int = 0
    hidden_size: int = 48
    num_layers: int = 8  # >= MTP depths: transformers' MtpModel numbers depths after the trunk layers
    head_dim: int = 16
    intermediate_size: int = 192
    sliding_window: int = 64
    rel_extent: int = 128
    steps: int = 450
    batch: int = 8
    seq_len: int = 128
    lr: float = 6e-2
    head_lr_mult: float = 3.0
    weight_decay: float = 0.1
    warmup: int = 40
    eval_windows: int = 256
    distill_steps: int = 150
    distill_batch: int = 8
    distill_lr: float = 1e-2
    distill_prompt_len: int = 48
    distill_seq_len: int = 112  # prompt + 64 greedy bytes
    distill_sequences: int = 256
    distill_eval_sequences: int = 64


RECIPE = Recipe()
# Seconds, not minutes: for tests and for trying the pipeline.
REDUCED = Recipe(hidden_size=32, head_dim=16, intermediate_size=64, sliding_window=16, rel_extent=32, steps=8,
                 batch=4, seq_len=32, warmup=2, eval_windows=8, distill_steps=4, distill_batch=4, distill_prompt_len=8,
                 distill_seq_len=20, distill_sequences=8, distill_eval_sequences=4)


def text_config(recipe: Recipe = RECIPE) -> dict:
    """config.json of the text target: the ``tiny`` preset's structure at the recipe's size, dense MLPs, the byte
    vocabulary, 8 MTP depths in Inkling's sliding / full pattern."""
    from ..testing.synthetic import INKLING_SLIDING_DEPTHS, tiny_config

    heads = recipe.hidden_size // recipe.head_dim
    if heads < 1 or heads * recipe.head_dim != recipe.hidden_size:
        raise ArgumentError(f"hidden_size {recipe.hidden_size} is not a multiple of head_dim {recipe.head_dim}")
    if recipe.num_layers < MTP_DEPTHS:
        raise ArgumentError(f"num_layers {recipe.num_layers} < {MTP_DEPTHS} MTP depths (transformers' MtpModel "
                            "numbers its depths after the trunk layers)")
    attention = dict(num_attention_heads=heads, num_key_value_heads=heads, head_dim=recipe.head_dim,
                     swa_num_attention_heads=heads, swa_num_key_value_heads=heads, swa_head_dim=recipe.head_dim)
    config = tiny_config(
        num_mtp_layers=MTP_DEPTHS, local_layer_ids=INKLING_SLIDING_DEPTHS, num_hidden_layers=recipe.num_layers,
        moe=False, use_unpadded=False, hidden_size=recipe.hidden_size, **attention,
        dense_intermediate_size=recipe.intermediate_size, vocab_size=VOCAB, unpadded_vocab_size=LOGITS_VOCAB,
        sliding_window_size=recipe.sliding_window, rel_extent=recipe.rel_extent, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    config.update(image_token_id=IMAGE_TOKEN_ID, image_bos_token_id=IMAGE_BOS_TOKEN_ID,
                  audio_bos_token_id=AUDIO_BOS_TOKEN_ID, audio_token_id=AUDIO_TOKEN_ID)
    return config


# ------------------------------------------------------------------------------------------------------- training

def new_model(config: dict, seed: int):
    """A freshly initialised transformers ``InklingForCausalLM`` (transformers' own init, seeded), q / k norm gains
    set to ``head_dim ** 0.25``: q and k are RMS-normed and scaled by 1 / head_dim, so unit gains would start every
    attention logit within +-1 (attention all but uniform); these gains start it like the usual 1 / sqrt(head_dim).
    """
    with quiet_import():
        from transformers import InklingConfig, InklingForCausalLM

    text = InklingConfig.from_dict(json.loads(json.dumps(config))).text_config
    torch.manual_seed(seed)
    model = InklingForCausalLM(text)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_norm.weight.fill_(attn.head_dim ** 0.25)
            attn.k_norm.weight.fill_(attn.head_dim ** 0.25)
    return model


def next_byte_loss(model, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy in nats, number of byte labels) of predicting ``windows[:, 1:]`` from the prefix;
    labels that are special ids (the EOS / BOS between files) do not count."""
    logits = model(input_ids=windows[:, :-1]).logits.float()
    labels = windows[:, 1:]
    keep = labels < BYTES
    nats = F.cross_entropy(logits[keep], labels[keep], reduction="sum")
    return nats, keep.sum()


def bits_per_byte(model, stream: torch.Tensor, *, seq_len: int, windows: int, batch: int = 32) -> float:
    """Held-out bits per byte: ``windows`` evenly spaced windows of ``seq_len + 1`` ids of ``stream``."""
    starts = torch.linspace(0, len(stream) - seq_len - 1, windows).long()
    chunks = stream[starts[:, None] + torch.arange(seq_len + 1)[None]]
    nats = count = 0.0
    with torch.no_grad():
        for lo in range(0, windows, batch):
            n, c = next_byte_loss(model, chunks[lo:lo + batch])
            nats, count = nats + float(n), count + int(c)
    return nats / count / math.log(2)


def text_agreement(mtp, target, windows: torch.Tensor) -> list[float]:
    """Teacher-forced per-depth agreement on real text ``windows`` [N, T]: depth k at row t (hidden g^{k-1}_t, the
    true byte x_{t+k+1}) against the target's own greedy choice after x_{t+k+1}, every row counted. Agreement on
    the target's greedy continuations (what distillation reports, = greedy acceptance) is inflated once the target
    falls into a loop; real text has none."""
    from .distill import depth_rows, target_hidden

    batch, seq = windows.shape
    with torch.no_grad():
        hidden = target_hidden(target, windows).to(mtp.dtype)
        previous, out = hidden, []
        for k in range(mtp.config.num_depths):
            n = depth_rows(seq, k)
            positions = torch.arange(n)[None].expand(batch, n)
            previous = mtp(windows[:, k + 1:k + 1 + n], positions, previous[:, :n], depth=k)
            drafted = mtp.compute_logits(previous).argmax(-1)
            wanted = mtp.compute_logits(hidden[:, k + 1:k + 1 + n]).argmax(-1)
            out.append(float((drafted == wanted).float().mean()))
    return out


def _lr_factor(step: int, recipe: Recipe) -> float:
    """Linear warm-up, then cosine down to 10 % of the peak."""
    if step < recipe.warmup:
        return (step + 1) / recipe.warmup
    frac = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * frac))


def train_target(model, stream: torch.Tensor, recipe: Recipe, *, progress: bool = False,
                 log_every: int = 25) -> list[float]:
    """AdamW on every parameter (decay on matrices only) over seeded random windows of ``stream``; returns the
    per-step training bits per byte.

    The LM head reads the hidden divided by the muP multiplier (24), so an Adam step moves the logits 24x less than
    it would without it; its learning rate is ``head_lr_mult`` times the others' to make up for it.
    """
    head = model.lm_head.weight
    decay = [p for p in model.parameters() if p.dim() >= 2 and p is not head]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": rest, "weight_decay": 0.0},
                             {"params": [head], "weight_decay": recipe.weight_decay,
                              "lr": recipe.lr * recipe.head_lr_mult}], lr=recipe.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, recipe))
    gen = torch.Generator().manual_seed(recipe.seed + 1)
    offsets = torch.arange(recipe.seq_len + 1)[None]
    history: list[float] = []
    model.train()
    start = time.perf_counter()
    try:
        for step in range(recipe.steps):
            starts = torch.randint(0, len(stream) - recipe.seq_len - 1, (recipe.batch, 1), generator=gen)
            nats, count = next_byte_loss(model, stream[starts + offsets])
            loss = nats / count
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            history.append(float(loss.detach()) / math.log(2))
            if (step + 1) % log_every == 0 or step + 1 == recipe.steps:
                recent = history[-log_every:]
                _log(f"train step {step + 1}/{recipe.steps}  bits/byte {sum(recent) / len(recent):.3f}  "
                     f"({time.perf_counter() - start:.1f} s)", progress)
    finally:
        model.eval()
    return history


# ---------------------------------------------------------------------------------------------------------- build

def default_root() -> Path:
    from ..testing.synthetic import default_cache_root

    return default_cache_root()


def cache_key(corpus: Corpus, recipe: Recipe) -> str:
    """What the built directory is keyed by: the corpus content, the recipe and the format."""
    from . import distill as D

    parts = {"corpus": corpus.digest, "recipe": dataclasses.asdict(recipe), "format": FORMAT_VERSION,
             "distill_format": D.FORMAT_VERSION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def target_dir(recipe: Recipe = RECIPE, *, root=None, corpus: Corpus | None = None) -> Path:
    """Where :func:`build` puts (or finds) the text target for ``recipe`` and the corpus."""
    corpus = corpus if corpus is not None else load_corpus()
    root = arguments.path("root", root) if root is not None else default_root()
    return root / f"text-{cache_key(corpus, recipe)}"


def is_built(path) -> bool:
    """Distilled, and the real-text agreement (measured last) recorded."""
    from .distill import METRICS_FILE as DISTILL_METRICS

    path = Path(path)
    if not ((path / METRICS_FILE).is_file() and (path / DISTILL_METRICS).is_file()):
        return False
    return "heldout_text_agreement" in json.loads((path / METRICS_FILE).read_text())


def load_metrics(path) -> dict:
    """``text_target.json`` (corpus, recipe, held-out bits per byte, timings) merged with the distillation's
    ``distill.json`` under ``"distill"`` (per-depth agreement before / after, timings)."""
    from .distill import load_metrics as distill_metrics

    metrics = json.loads((Path(path) / METRICS_FILE).read_text())
    metrics["distill"] = {k: v for k, v in distill_metrics(path).items() if k != "loss_history"}
    return metrics


def write_trained_target(path, recipe: Recipe, corpus: Corpus, *, progress: bool = True) -> dict:
    """Train the target on ``corpus`` and write it to ``path`` (raw layout, seeded random MTP depths) with its
    metrics in ``text_target.json``; returns the metrics."""
    from ..testing.synthetic import raw_text_tensors, write_checkpoint

    start = time.perf_counter()
    train_stream, heldout_stream = corpus.stream("train"), corpus.stream("heldout")
    _log(f"corpus {corpus.digest[:16]}: {len(corpus.train)} train modules ({len(train_stream)} ids), "
         f"{len(corpus.heldout)} held-out ({len(heldout_stream)} ids); {recipe}", progress)
    config = text_config(recipe)
    model = new_model(config, recipe.seed)
    history = train_target(model, train_stream, recipe, progress=progress)
    train_seconds = time.perf_counter() - start
    bpb = bits_per_byte(model, heldout_stream, seq_len=recipe.seq_len, windows=recipe.eval_windows)
    _log(f"held-out bits per byte {bpb:.3f} (trained in {train_seconds:.1f} s)", progress)
    write_checkpoint(path, config, seed=recipe.seed, tensors=raw_text_tensors(model))
    metrics = dict(corpus=corpus.digest, train_modules=list(corpus.train), heldout_modules=list(corpus.heldout),
                   stdlib=str(stdlib_dir()), recipe=dataclasses.asdict(recipe), format=FORMAT_VERSION,
                   parameters=sum(p.numel() for p in model.parameters()), heldout_bits_per_byte=bpb,
                   train_bits_per_byte_last=sum(history[-10:]) / len(history[-10:]), train_seconds=train_seconds,
                   threads=torch.get_num_threads())
    (Path(path) / METRICS_FILE).write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def distill_arguments(recipe: Recipe, corpus: Corpus) -> dict:
    """Keyword arguments of :func:`inkling_compiled.training.distill.distill` for ``recipe``: greedy continuations of
    line-start windows of the train modules, agreement measured on continuations of held-out ones."""
    n = recipe.distill_prompt_len
    return dict(steps=recipe.distill_steps, seq_len=recipe.distill_seq_len, batch=recipe.distill_batch,
                seed=recipe.seed, lr=recipe.distill_lr,
                prompts=line_start_windows(corpus.stream("train"), recipe.distill_sequences, n, recipe.seed),
                eval_prompts=line_start_windows(corpus.stream("heldout"), recipe.distill_eval_sequences, n,
                                                recipe.seed))


def build(recipe: Recipe = RECIPE, *, root=None, corpus: Corpus | None = None, force: bool = False,
          progress: bool = True) -> Path:
    """Train the text target and distil its MTP depths, or return the finished cached directory.

    The trained target (random MTP depths) is written to a temporary sibling, distilled into the final directory
    (written atomically by :func:`inkling_compiled.training.distill.distill`, which hard-links the target's files),
    and the temporary directory removed. Concurrent builders race harmlessly.
    """
    from . import distill as D

    if not isinstance(recipe, Recipe):
        raise ArgumentError(f"recipe must be a Recipe, got {type(recipe).__name__}")
    arguments.check_bool("force", force)
    arguments.check_bool("progress", progress)
    corpus = corpus if corpus is not None else load_corpus()
    final = target_dir(recipe, root=root, corpus=corpus)
    if is_built(final) and not force:
        _log(f"cached: {final}", progress)
        return final
    if final.exists():
        shutil.rmtree(final)
    start = time.perf_counter()
    base = final.parent / f".tmp-{final.name}-target-{uuid.uuid4().hex[:8]}"
    try:
        metrics = write_trained_target(base, recipe, corpus, progress=progress)
        D.distill(base, final, progress=progress, **distill_arguments(recipe, corpus))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    metrics["heldout_text_agreement"] = _measure_text_agreement(final, recipe, corpus)
    _log(f"held-out text agreement per depth: {' '.join(f'{a:.3f}' for a in metrics['heldout_text_agreement'])}",
         progress)
    metrics["build_seconds"] = time.perf_counter() - start
    tmp = final / f".{METRICS_FILE}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(metrics, indent=2) + "\n")
    os.replace(tmp, final / METRICS_FILE)  # atomic: is_built never reads a half-written file
    _log(f"built {final} in {metrics['build_seconds']:.1f} s", progress)
    return final


def _measure_text_agreement(path: Path, recipe: Recipe, corpus: Corpus) -> list[float]:
    from ..model.mtp import InklingMTP
    from ..testing.synthetic import load_hf_target

    target = load_hf_target(path).requires_grad_(False)
    mtp = InklingMTP.from_pretrained(path, target=target)
    windows = line_start_windows(corpus.stream("heldout"), recipe.distill_eval_sequences, recipe.distill_seq_len,
                                 recipe.seed + 1)
    return text_agreement(mtp, target, windows)


def heldout_prompts(count: int, length: int, *, seed: int = 0, corpus: Corpus | None = None) -> torch.Tensor:
    """[count, length] byte windows of the held-out modules, starting at line starts (seeded)."""
    seed = arguments.integer("seed", seed)  # before the offset below: the error names the caller's value
    corpus = corpus if corpus is not None else load_corpus()
    return line_start_windows(corpus.stream("heldout"), count, length, seed + 1000)


def main(argv=None) -> int:
    parser = arguments.OneLineParser(prog="python -m inkling_compiled.training.text_target",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--reduced", action="store_true", help="the seconds-long recipe the tests use")
    parser.add_argument("--force", action="store_true", help="rebuild even if a cached result exists")
    parser.add_argument("--threads", type=arguments.threads_option, default=None, help="torch intra-op threads")
    parser.add_argument("--root", type=arguments.writable_directory_option,
                        help="cache root (default: the checkpoint cache)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = build(REDUCED if args.reduced else RECIPE, root=args.root, force=args.force)
    metrics = load_metrics(path)
    print(json.dumps({"path": str(path), "heldout_bits_per_byte": metrics["heldout_bits_per_byte"],
                      "train_seconds": metrics["train_seconds"],
                      "greedy_agreement": metrics["distill"]["agreement_after"],
                      "heldout_text_agreement": metrics["heldout_text_agreement"],
                      "distill_seconds": metrics["distill"]["total_seconds"],
                      "build_seconds": metrics["build_seconds"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
