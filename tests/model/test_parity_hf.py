"""Parity with transformers' own MtpModel / InklingDecoderLayer on tiny fp32 configs (the ground truth for block math).

transformers differs from the spec in two known ways (docs/model.md §8 items 2 and 10, §9), neutralised here: it feeds
the raw embedding (both sides get the same raw embedding through ``inputs_embeds``), and it applies no sliding window on
its MTP path (sliding depths are compared on sequences no longer than the window).
"""

import pytest
import torch
from transformers import InklingForCausalLM
from transformers.modeling_layers import MtpModel

from inkling_compiled import InklingMTP, MTPConfig
from inkling_compiled.testing.synthetic import randomize_
from tests.helpers import tiny_text_config

pytestmark = pytest.mark.floor  # make test-floor: exercises a dependency at its lowest version

# transformers MtpLayer / InklingDecoderLayer name -> InklingMTP name (per depth)
HF_TO_OURS = {
    "hnorm.weight": "hidden_norm.weight",
    "enorm.weight": "embed_norm.weight",
    "eh_proj.weight": "input_proj.weight",
    "mtp_block.input_layernorm.weight": "transformer_block.attn_norm.weight",
    "mtp_block.post_attention_layernorm.weight": "transformer_block.mlp_norm.weight",
    "mtp_block.self_attn.q_proj.weight": "transformer_block.attn.wq_du.weight",
    "mtp_block.self_attn.k_proj.weight": "transformer_block.attn.wk_dv.weight",
    "mtp_block.self_attn.v_proj.weight": "transformer_block.attn.wv_dv.weight",
    "mtp_block.self_attn.r_proj.weight": "transformer_block.attn.wr_du.weight",
    "mtp_block.self_attn.o_proj.weight": "transformer_block.attn.wo_ud.weight",
    "mtp_block.self_attn.q_norm.weight": "transformer_block.attn.q_norm.weight",
    "mtp_block.self_attn.k_norm.weight": "transformer_block.attn.k_norm.weight",
    "mtp_block.self_attn.k_sconv.conv1d.weight": "transformer_block.attn.k_sconv.weight",
    "mtp_block.self_attn.v_sconv.conv1d.weight": "transformer_block.attn.v_sconv.weight",
    "mtp_block.self_attn.rel_logits_proj.proj": "transformer_block.attn.rel_logits_proj.proj",
    "mtp_block.attn_sconv.conv1d.weight": "transformer_block.attn_sconv.weight",
    "mtp_block.mlp_sconv.conv1d.weight": "transformer_block.mlp_sconv.weight",
    "mtp_block.mlp.down_proj.weight": "transformer_block.mlp.w2_md.weight",
    "mtp_block.mlp.global_scale": "transformer_block.mlp.global_scale",
}


def hf_pair(text_config, seed=0, **mtp_kwargs):
    """A random transformers MtpModel and our InklingMTP holding the very same weights."""
    torch.manual_seed(seed)
    target = InklingForCausalLM(text_config).eval()
    mup = text_config.logits_mup_width_multiplier
    hf = randomize_(MtpModel(target, text_config.num_mtp_layers), seed, mup=mup).eval()
    randomize_(target, seed + 1, mup=mup)
    ours = InklingMTP(MTPConfig.from_hf(text_config, **mtp_kwargs)).eval()
    state = {}
    for i, layer in enumerate(hf.layers):
        hf_state = layer.state_dict()
        for hf_name, name in HF_TO_OURS.items():
            state[f"layers.{i}.{name}"] = hf_state[hf_name]
        mlp = layer.mtp_block.mlp
        state[f"layers.{i}.transformer_block.mlp.w13_dn.weight"] = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
    embedding = target.get_input_embeddings()
    state.update(embed_weight=embedding.weight, embed_norm_weight=embedding.embed_norm.weight,
                 lm_head_weight=target.lm_head.weight)
    ours.load_state_dict(state, strict=True)
    return hf, ours.requires_grad_(False), target


def inputs(config, batch, seq, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    hidden = torch.randn(batch, seq, config.hidden_size, generator=gen)
    positions = torch.arange(seq)[None].expand(batch, seq)
    return ids, positions, hidden


@pytest.mark.parametrize("depth,seq", [(0, 8), (1, 24)])  # depth 0 sliding (seq <= window 8), depth 1 full
@pytest.mark.parametrize("act", ["silu", "gelu"])
@torch.no_grad()
def test_depth_matches_transformers(depth, seq, act):
    config = tiny_text_config(hidden_act=act)
    hf, ours, target = hf_pair(config)
    ids, positions, hidden = inputs(config, 1, seq)
    raw = target.get_input_embeddings().weight[ids]  # transformers feeds the raw embedding (docs/model.md §8 item 2)
    expected = hf.forward_layer(depth, hidden, positions, None, inputs_embeds=raw)
    got = ours(None, positions, hidden, depth=depth, inputs_embeds=raw)
    assert (got - expected).abs().max().item() <= 1e-5
    torch.testing.assert_close(ours.compute_logits(got), hf._project_to_logits(expected), atol=1e-5, rtol=0)


@torch.no_grad()
def test_block_matches_transformers_decoder_layer():
    config = tiny_text_config()
    hf, ours, _ = hf_pair(config)
    x = torch.randn(2, 24, config.hidden_size)
    positions = torch.arange(24)[None].expand(2, 24)
    expected = hf.layers[1].mtp_block(x, attention_mask=None)
    got = ours.layers[1].transformer_block(x, positions)
    assert (got - expected).abs().max().item() <= 1e-5


@torch.no_grad()
def test_log_scaling_matches_transformers_when_enabled():
    """tau on full depths (transformers/SGLang behaviour) behind ``mtp_log_scaling``; off by default (vLLM)."""
    config = tiny_text_config(log_scaling_n_floor=4, log_scaling_alpha=0.3)
    hf, ours, target = hf_pair(config, mtp_log_scaling=True)
    ids, positions, hidden = inputs(config, 1, 24)
    raw = target.get_input_embeddings().weight[ids]
    expected = hf.forward_layer(1, hidden, positions, None, inputs_embeds=raw)
    assert (ours(None, positions, hidden, depth=1, inputs_embeds=raw) - expected).abs().max().item() <= 1e-5
    _, default, _ = hf_pair(config)
    assert (default(None, positions, hidden, depth=1, inputs_embeds=raw) - expected).abs().max().item() > 1e-3
