"""The passes are installed process-wide but rewrite only the model's own ops: another model compiled in the same
process, written with the very ops our patterns describe, compiles exactly as stock Inductor compiles it."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inkling_compiled.testing.kernel_stats import compile_fresh
from tests.helpers import hidden_and_logits_step, random_mtp

H, V, EPS = 64, 96, 1e-6
NO_MATCHES = {"fuse_draft_input_embed": 0, "fuse_draft_input": 0, "fold_mup_scale": 0}


def their_rms_norm(x, weight, eps):
    """Someone else's RMSNorm, op for op the model's (so its graph is the one our pattern describes)."""
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return (x32 * torch.rsqrt(variance + eps) * weight.float()).to(x.dtype)


class TheirModel(nn.Module):
    """A model that is not ours: scaled linears and an RMSNorm + cat of its own."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randn(V, H, generator=g), requires_grad=False)
        self.gain_x = nn.Parameter(torch.rand(H, generator=g) + 0.5, requires_grad=False)
        self.gain_y = nn.Parameter(torch.rand(H, generator=g) + 0.5, requires_grad=False)

    def forward(self, x, y):
        scaled_after = F.linear(x, self.weight) * 0.5
        scaled_before = F.linear(x / 24.0, self.weight)
        normed = torch.cat([their_rms_norm(x, self.gain_x, EPS), their_rms_norm(y, self.gain_y, EPS)], dim=-1)
        return scaled_after, scaled_before, normed


def _generated(run) -> list[str]:
    """The generated modules without their ``# AOT ID`` line (a per-process compile counter)."""
    return [re.sub(r"^# AOT ID: .*\n", "", code, flags=re.M) for code in run.code]


def _their_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 5, H, generator=g), torch.randn(2, 5, H, generator=g)


def test_their_model_compiles_as_stock():
    theirs, args = TheirModel(), _their_inputs()
    stock = compile_fresh(theirs, *args, passes=False)
    ours_installed = compile_fresh(theirs, *args, passes=True)
    assert ours_installed.matches == NO_MATCHES
    assert _generated(ours_installed) == _generated(stock)  # the very same kernels and wrapper
    for got, want in zip(ours_installed.output, stock.output):
        assert torch.equal(got, want)


@pytest.mark.usefixtures("tests_count_as_model")
def test_their_ops_are_what_our_patterns_describe():
    # the control: counted as the model's code, the same graph does fuse, so only the source check keeps it stock
    run = compile_fresh(TheirModel(), *_their_inputs(), passes=True)
    assert run.matches == {"fuse_draft_input_embed": 0, "fuse_draft_input": 1, "fold_mup_scale": 1}


def test_our_model_in_the_same_graph_still_fuses():
    theirs, mtp = TheirModel(), random_mtp()
    step = hidden_and_logits_step(mtp)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, mtp.config.vocab_size, (2, 5), generator=g)
    positions = torch.arange(5).expand(2, 5)
    previous = torch.randn(2, 5, mtp.config.hidden_size, generator=g)

    def both(x, y, ids, positions, previous):
        return theirs(x, y), step(ids, positions, previous)

    args = (*_their_inputs(), ids, positions, previous)
    stock = compile_fresh(both, *args, passes=False)
    fused = compile_fresh(both, *args, passes=True)
    assert fused.matches == {"fuse_draft_input_embed": 1, "fuse_draft_input": 0, "fold_mup_scale": 1}  # ours only
    assert stock.stats.extern_calls.count("addmm") == 0 and fused.stats.extern_calls.count("addmm") == 1
    assert fused.stats.loop_nests == stock.stats.loop_nests - 1  # our input block: 2 passes -> 1; theirs untouched
    for got, want in zip(fused.output[0], stock.output[0]):
        assert torch.equal(got, want)
