"""Our depths against a straightforward re-derivation of docs/model.md §4, written as loops over positions.

This covers what transformers cannot check (docs/model.md §9): the true sliding window, the relative-bias extent
cut-off, the double-normed embedding (backbone embed_norm, rounding, depth embed_norm), hidden-first concat and the
chain norm.
"""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import random_mtp, tiny_text_config


def ref_rms(x, w, eps=1e-6):
    return (x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + eps) * w.double())


def ref_sconv(x, w):  # x [T, C], w [C, 1, K]
    K = w.shape[-1]
    out = x.double().clone()
    for t in range(x.shape[0]):
        for k in range(K):
            s = t - (K - 1) + k
            if s >= 0:
                out[t] += w[:, 0, k].double() * x[s].double()
    return out


def ref_depth(model, depth, ids, hidden, positions):
    """One sequence: ids [T], hidden [T, H], positions [T] -> [T, H] in float64."""
    c, layer = model.config, model.layers[depth]
    g = c.depths[depth]
    blk, attn = layer.transformer_block, layer.transformer_block.attn
    e = model.embed_weight[ids].double()
    if c.use_embed_norm:
        e = ref_rms(e, model.embed_norm_weight).to(model.dtype).double()
    parts = [ref_rms(hidden, layer.hidden_norm.weight), ref_rms(e, layer.embed_norm.weight)]
    x = torch.cat(parts if c.hidden_states_first else parts[::-1], -1) @ layer.input_proj.weight.double().T
    a = ref_rms(x, blk.attn_norm.weight)
    T = x.shape[0]
    q = (a @ attn.wq_du.weight.double().T).view(T, g.num_heads, g.head_dim)
    k = ref_sconv(a @ attn.wk_dv.weight.double().T, attn.k_sconv.weight).view(T, g.num_kv_heads, g.head_dim)
    v = ref_sconv(a @ attn.wv_dv.weight.double().T, attn.v_sconv.weight).view(T, g.num_kv_heads, g.head_dim)
    r = (a @ attn.wr_du.weight.double().T).view(T, g.num_heads, c.d_rel)
    q, k = ref_rms(q, attn.q_norm.weight), ref_rms(k, attn.k_norm.weight)
    R = r @ attn.rel_logits_proj.proj.double()  # [T, heads, E]
    o = torch.zeros(T, g.num_heads, g.head_dim, dtype=torch.float64)
    group = g.num_heads // g.num_kv_heads
    for i in range(T):
        for h in range(g.num_heads):
            scores = []
            for j in range(T):
                d = int(positions[i] - positions[j])
                if d < 0 or (g.window is not None and d >= g.window):
                    scores.append(-math.inf)
                    continue
                bias = R[i, h, d] if d < g.rel_extent else 0.0
                scores.append(float(q[i, h] @ k[j, h // group]) / g.head_dim + float(bias))
            p = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
            o[i, h] = sum(p[j] * v[j, h // group] for j in range(T))
    x1 = x + ref_sconv(o.reshape(T, -1) @ attn.wo_ud.weight.double().T, blk.attn_sconv.weight)
    m = ref_rms(x1, blk.mlp_norm.weight)
    inter = c.intermediate_size
    w13 = blk.mlp.w13_dn.weight.double()
    act = {"silu": F.silu, "gelu": F.gelu}[c.hidden_act]
    y = (act(m @ w13[:inter].T) * (m @ w13[inter:].T)) @ blk.mlp.w2_md.weight.double().T * blk.mlp.global_scale.double()
    out = x1 + ref_sconv(y, blk.mlp_sconv.weight)
    return ref_rms(out, model.chain_norm.weight) if model.chain_norm is not None else out


@pytest.mark.parametrize("overrides", [
    {},  # depth 0 sliding with window 8 < T, depth 1 full with extent 16 < T
    {"mtp_hidden_states_first": False, "chain_hidden_post_norm": True, "hidden_act": "gelu"},
])
@torch.no_grad()
def test_depths_match_dense_reference(overrides):
    model = random_mtp(tiny_text_config(**overrides), seed=3)
    T = 21
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (1, T), generator=gen)
    hidden = torch.randn(1, T, 64, generator=gen)
    positions = torch.arange(T)[None] + 5  # absolute positions need not start at 0: only distances matter
    for depth in range(model.config.num_depths):
        got = model(ids, positions, hidden, depth=depth)[0]
        ref = ref_depth(model, depth, ids[0], hidden[0], positions[0])
        assert (got.double() - ref).abs().max().item() < 1e-5, depth


@torch.no_grad()
def test_window_and_double_norm_matter():
    """The reference is sensitive to what it checks: dropping the window or the backbone norm changes the output."""
    model = random_mtp(seed=3)
    T = 21
    ids = torch.randint(0, 256, (1, T))
    hidden = torch.randn(1, T, 64)
    positions = torch.arange(T)[None]
    got = model(ids, positions, hidden, depth=0)
    raw = model(None, positions, hidden, depth=0, inputs_embeds=model.embed_weight[ids])
    assert (got - raw).abs().max() > 1e-2
    attn = model.layers[0].transformer_block.attn
    windowed = model(ids, positions, hidden, depth=0)
    attn.geometry = dataclasses.replace(attn.geometry, window=None)
    assert (model(ids, positions, hidden, depth=0) - windowed).abs().max() > 1e-3
