"""Int8 weight-only linears for drafting below the bandwidth floor (docs/compile.md §11).

The one-token draft step is memory-bound: it reads every weight once. Symmetric per-output-channel int8 weights with
bf16 scales read half the bytes of bf16, a quarter of fp32; activations stay bf16, and norms, short convs, the
relative-bias table and the embedding stay as they are.

:func:`int8_linear` is spelled ``mm(x, w.t().to(bf16)) * scale``, the form Inductor's weight-only-int8 lowering
recognises, so that under ``torch.compile`` the cast never materialises: on CPU the GEMM becomes
``_weight_int8pack_mm`` (or, with frozen weights and max-autotune, Inductor's C++ weight-only GEMM template); on CUDA,
with coordinate-descent tuning, a one-row GEMM becomes a reduction that loads the int8 weight directly. Eager, the
cast writes a bf16 copy of the weight on every call: correct, and slow (eager is the reference). With float32
activations no int8 kernel applies at all (the weight is converted on every call, over 10x slower than float32), so
quantizing demands a bfloat16 model instead of converting one silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..arguments import ArgumentError
from . import torchao_schemes

SCHEMES = ("int8",)
ACTIVATION_DTYPE = torch.bfloat16
DEVICES = ("cpu", "cuda")  # where an int8 weight-only kernel exists behind the spelling below (tested on both)
# Schemes people ask for that have no weight-only kernel here: the reason, instead of a plain "unknown scheme".
NO_KERNEL = {
    "float8": "float8 weight-only has no GEMM kernel in torch: the weight is dequantized in full on every call "
              "(about 10x slower than float32 on CPU), and torch's float8 GEMM quantizes the activations too (on a GPU "
              "with float8 support, torchao's Float8DynamicActivationFloat8WeightConfig() does that)",
}
_QMAX = 127  # symmetric: -127..127, so that the scale maps the largest magnitude exactly


@dataclass(frozen=True)
class Quantization:
    """What ``InklingMTP.quantize_`` did, and its memory: ``InklingMTP.quantization``."""

    scheme: str
    head: bool  # compute_logits reads a draft-only int8 copy of the LM head (the shared head is untouched)
    depth_bytes_before: int  # weights of the depth linears before quantizing ...
    depth_bytes: int  # ... and after (int8 weights + bf16 scales)
    head_copy_bytes: int  # the draft-only head copy, held beside the shared head (0 when head=False)


def check_scheme(scheme) -> None:
    """ArgumentError naming the problem unless ``scheme`` names a scheme offered here or is a torchao
    config (``model/torchao_schemes.py``)."""
    if torchao_schemes.is_config(scheme):
        return
    if not isinstance(scheme, str):
        raise ArgumentError(f"quantize must be a scheme name {list(SCHEMES)}, a torchao config instance, or None, got "
                            f"{type(scheme).__name__} {scheme!r}")
    if scheme in NO_KERNEL:
        raise ArgumentError(f"quantize: the scheme {scheme!r} is not offered: {NO_KERNEL[scheme]}; use 'int8'")
    if scheme not in SCHEMES:
        raise ArgumentError(f"quantize: unknown quantization scheme {scheme!r}: choose from {list(SCHEMES)} or pass a "
                            f"torchao config instance ({torchao_schemes.INSTALL_HINT})")


def check_runs_int8(device: torch.device, dtype: torch.dtype, error: type[ValueError] = ArgumentError) -> None:
    """``error`` unless a model on ``device`` with ``dtype`` activations has int8 weight-only kernels: an
    ArgumentError for a model about to be quantized, a ValueError for one quantized before (its state)."""
    if device.type not in DEVICES:
        raise error(f"int8 weight-only drafting has kernels on {' and '.join(DEVICES)}, not on {device}")
    if dtype != ACTIVATION_DTYPE:
        raise error(f"int8 weight-only drafting runs with bfloat16 activations, this model runs in {dtype}, "
                    "for which no int8 kernel applies (the weight would be converted on every call: over 10x "
                    "slower than not quantizing, measured in float32); load with dtype=torch.bfloat16 or call "
                    ".to(torch.bfloat16) before quantizing (with target=, the target must be bfloat16)")


def quantize_rows(weight: torch.Tensor, multiplier: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: int8 ``q`` [N, K] and bf16 ``scale`` [N] with ``q * scale ~= weight * multiplier`` per row.

    The scale is rounded to bf16 first and ``q`` computed against the rounded scale, so the bf16 rounding of the
    scale costs nothing beyond the int8 rounding itself. ``multiplier`` (1/muP for the LM head) is folded into the
    scale, so the GEMM's own epilogue applies it. An all-zero row gets scale 1 and q = 0.
    """
    w = weight.detach().float() * multiplier
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / _QMAX, torch.ones_like(absmax)).to(ACTIVATION_DTYPE)
    q = torch.round(w / scale.float()[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q, scale


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scale).T`` for int8 ``weight`` [N, K] and per-row ``scale`` [N]: [..., K] -> [..., N].

    Spelled as Inductor's weight-only-int8 pattern expects (2-D ``mm`` over the transposed, then cast, weight; the
    scale multiplied after): a different spelling compiles to a full-weight cast on every call.
    """
    x2d = x.reshape(-1, x.shape[-1])
    out = torch.mm(x2d, weight.t().to(x.dtype)) * scale
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Int8Linear(nn.Module):
    """A bias-free linear holding an int8 ``weight`` [N, K] and a bf16 ``scale`` [N] (no autograd on either)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)

    @classmethod
    def quantize(cls, weight: torch.Tensor, multiplier: float = 1.0) -> Int8Linear:
        return cls(*quantize_rows(weight, multiplier))

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, int8 weight-only"


def quantize_linears(module: nn.Module) -> tuple[int, int]:
    """Every ``nn.Linear`` in ``module`` replaced by its :class:`Int8Linear`, in place: (bytes before, after)."""
    before = after = 0
    for path, linear in [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]:
        parent, _, attr = path.rpartition(".")
        quantized = Int8Linear.quantize(linear.weight)
        setattr(module.get_submodule(parent), attr, quantized)
        before, after = before + linear.weight.nbytes, after + quantized.nbytes
    return before, after

