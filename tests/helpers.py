"""Shared test helpers: tiny configs, randomly initialised models (fp32, seeded), one checkpoint in both libraries."""

from types import SimpleNamespace

import torch
from transformers import InklingForCausalLM, InklingTextConfig

from inkling_compiled import InklingMTP, MTPConfig
from inkling_compiled.runtime import DraftResult
from inkling_compiled.testing.synthetic import load_hf_mtp, load_hf_target, randomize_

# Self-distillation in few steps and sequences: seconds on a 2-core CPU, still a clear effect.
QUICK_DISTILL = dict(steps=60, seq_len=32, batch=16, lr=1e-2, prompt_len=8, num_sequences=64, eval_sequences=16,
                     seed=0)


def tiny_text_config(**overrides) -> InklingTextConfig:
    """A tiny Inkling text config with 2 MTP depths (0 sliding, 1 full), short window/extent and GQA on full depths."""
    fields = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_head_dim=32, d_rel=16, sliding_window_size=8,
        rel_extent=16, intermediate_size=96, vocab_size=256, unpadded_vocab_size=250, num_mtp_layers=2,
        mtp_local_layer_ids=[0], mlp_layer_types=["dense", "dense"], hidden_act="silu",
    )
    fields.update(overrides)
    return InklingTextConfig(**fields)


def random_mtp(text_config: InklingTextConfig | None = None, seed: int = 0, dtype=torch.float32,
               **config_kwargs) -> InklingMTP:
    model = InklingMTP(MTPConfig.from_hf(text_config or tiny_text_config(), **config_kwargs))
    return randomize_(model, seed, mup=model.config.mup).to(dtype).eval().requires_grad_(False)


def both_libraries(path) -> SimpleNamespace:
    """transformers' target and its ``MtpModel``, and our ``InklingMTP`` sharing the target's tensors, all from one
    raw-layout directory (fp32, CPU)."""
    target = load_hf_target(path).requires_grad_(False)
    hf_mtp = load_hf_mtp(target).requires_grad_(False)
    mtp = InklingMTP.from_pretrained(path, target=target)
    return SimpleNamespace(target=target, hf_mtp=hf_mtp, mtp=mtp, config=mtp.config)


def hidden_and_logits_step(mtp: InklingMTP, depth: int = 0):
    """The function the pass tests compile: one depth over (ids, positions, hidden), then the muP head."""

    def step(input_ids, positions, previous_hidden):
        hidden = mtp(input_ids, positions, previous_hidden, depth=depth)
        return hidden, mtp.compute_logits(hidden)

    return step


def draft_rows(mtp: InklingMTP, batch: int = 2, length: int = 3, seed: int = 0):
    """Random (input_ids, positions, previous_hidden) rows for one stateless depth call of ``mtp``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, mtp.config.logits_vocab_size, (batch, length), generator=g)
    positions = torch.arange(length).expand(batch, length)
    previous = torch.randn(batch, length, mtp.config.hidden_size, generator=g).to(mtp.dtype)
    return ids, positions, previous


PAD = 0  # the speculative tests' pad token id


def make_target(*, vocab=128, unpadded=120, hidden=64, mlp=("dense", "sparse"), seed=0, init=0.2, mup=2.0):
    """A tiny random transformers ``InklingForCausalLM`` target (fp32, eager attention, sliding window 8)."""
    torch.manual_seed(seed)
    config = InklingTextConfig(
        vocab_size=vocab, unpadded_vocab_size=unpadded, hidden_size=hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
        swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=8, d_rel=4, rel_extent=16,
        local_layer_ids=[0], mlp_layer_types=list(mlp), intermediate_size=128, moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, logits_mup_width_multiplier=mup,
        initializer_range=init, eos_token_id=None, bos_token_id=None, pad_token_id=PAD,
        attn_implementation="eager")
    return InklingForCausalLM(config).eval().requires_grad_(False)


class StandInDrafter:
    """A ``DraftSource`` with one draft per round that records every row it is fed.

    Greedy: proposes ``oracle[b][P]`` (the target's greedy token at real position P, from ``generate``) unless
    ``wrong(b, P)``, then a different token. Sampling: samples from ``q_fn(history_b, P)`` ([V] per row).
    """

    num_speculative_tokens = 1

    def __init__(self, vocab, *, max_batch_size=8, max_length=64, oracle=None, wrong=lambda b, p: False,
                 q_fn=None):
        self.vocab, self.max_batch_size, self.max_length = vocab, max_batch_size, max_length
        self.oracle, self.wrong, self.q_fn = oracle, wrong, q_fn
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.history: list[dict[int, int]] = []  # per row: real position -> token, from the rows fed

    def draft(self, input_ids, positions, hidden, *, temperature=0.0, generator=None, validate=True):
        assert input_ids.shape == positions.shape and hidden.shape[:2] == positions.shape
        assert input_ids.dtype == positions.dtype == torch.long
        batch = positions.shape[0]
        assert batch <= self.max_batch_size and int(positions.max()) < self.max_length
        self.calls.append((input_ids.clone(), positions.clone(), hidden.clone()))
        if not self.history:
            self.history = [{} for _ in range(batch)]
        for b in range(batch):
            for tok, pos in zip(input_ids[b].tolist(), positions[b].tolist()):
                if pos >= 0:
                    self.history[b][pos + 1] = tok
        want = (positions.amax(dim=1) + 2).tolist()  # the position each draft is for (after the last real row)
        if temperature == 0.0:
            tokens = []
            for b, p in enumerate(want):
                tok = self.oracle[b][p] if self.oracle is not None and p in self.oracle[b] else 3
                tokens.append((tok + 1 + b) % self.vocab if self.wrong(b, p) else tok)
            return DraftResult(drafts=torch.tensor(tokens)[:, None], draft_probs=None, hidden=hidden[:, -1])
        # a finished row (every row padding) drafts nothing the loop reads: any distribution will do
        q = torch.stack([self.q_fn(self.history[b], p) if p >= 2 else torch.ones(self.vocab) / self.vocab
                         for b, p in enumerate(want)]).float()
        tokens = torch.multinomial(q, 1, generator=generator).squeeze(1)
        return DraftResult(drafts=tokens[:, None], draft_probs=q[:, None], hidden=hidden[:, -1])

    def check_rows(self, sequences, prompt_mask, target, eos=None):
        """Every non-padding row fed must be (target hidden at P, committed token at P + 1) of the final output."""
        batch, prompt_len = prompt_mask.shape
        full_mask = torch.cat([prompt_mask, torch.ones(batch, sequences.shape[1] - prompt_len, dtype=torch.long)], 1)
        ref_hidden = target.model(input_ids=sequences, attention_mask=full_mask).last_hidden_state
        pad_left = (prompt_len - prompt_mask.sum(1)).tolist()
        checked = 0
        for ids, pos, hid in self.calls:
            for b in range(ids.shape[0]):
                for t in range(ids.shape[1]):
                    p = int(pos[b, t])
                    if p < 0:
                        continue
                    col = p + pad_left[b]
                    assert int(ids[b, t]) == int(sequences[b, col + 1]), (b, p)
                    torch.testing.assert_close(hid[b, t], ref_hidden[b, col], atol=2e-5, rtol=1e-4)
                    checked += 1
        return checked
