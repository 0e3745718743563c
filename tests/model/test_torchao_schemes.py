"""torchao configs as ``InklingMTP.quantize_`` schemes (``inkling_compiled.model.torchao_schemes``): what torchao
quantizes and what it must leave alone, its output against ours, global Inductor settings untouched, all or nothing
when torchao refuses, and a quiet import. The compiled drafter over a torchao model is covered in
tests/runtime/test_quantized_drafting.py."""

import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from inkling_compiled import InklingMTP
from inkling_compiled.arguments import ArgumentError
from inkling_compiled.model import torchao_schemes
from inkling_compiled.testing.synthetic import cached_checkpoint, load_hf_target
from tests.helpers import draft_rows, random_mtp

pytestmark = pytest.mark.floor  # make test-floor: exercises a dependency at its lowest version

BF16 = torch.bfloat16
ao = torchao_schemes.import_quantization()


def test_the_depth_linears_become_torchao_tensors_and_nothing_else_changes():
    mtp = random_mtp(dtype=BF16)
    linears = {n: m.weight.nbytes for n, m in mtp.layers.named_modules() if isinstance(m, nn.Linear)}
    kept = {n: p for n, p in mtp.named_parameters() if n.removeprefix("layers.").removesuffix(".weight") not in linears}
    assert mtp.quantize_(ao.Int8WeightOnlyConfig()) is mtp

    after = dict(mtp.named_parameters())
    for name in linears:
        assert type(after[f"layers.{name}.weight"]).__name__ == "Int8Tensor", name
    for name, param in kept.items():  # norms, short convs, relative-bias tables, global scale, embedding, head
        assert after[name] is param and param.dtype == BF16, name
    q = mtp.quantization
    assert (q.scheme, q.head, q.depth_bytes_before) == ("torchao:Int8WeightOnlyConfig", True, sum(linears.values()))
    out_features = sum(mtp.get_submodule(f"layers.{n}").weight.shape[0] for n in linears)
    # int8 weights, torchao's fp32 scales and (symmetric, all zero) int8 zero points
    assert q.depth_bytes == sum(linears.values()) // 2 + (4 + 1) * out_features
    c = mtp.config
    assert q.head_copy_bytes == c.logits_vocab_size * (c.hidden_size + 2)  # our int8 head copy: 1/muP in its scales


def test_the_targets_head_stays_shared_and_unchanged():
    checkpoint = cached_checkpoint("tiny")
    target = load_hf_target(checkpoint, dtype=BF16)
    head = target.get_output_embeddings().weight
    before = head.detach().clone()
    mtp = InklingMTP.from_pretrained(checkpoint, target=target, quantize=ao.Int8WeightOnlyConfig())
    assert mtp.lm_head_weight is head and torch.equal(head, before) and head.dtype == BF16
    assert mtp.quantization.scheme == "torchao:Int8WeightOnlyConfig"


@torch.no_grad()
def test_torchao_int8_agrees_with_ours():
    """The same symmetric per-row int8; torchao keeps fp32 scales where ours are rounded to bf16. Measured (random
    tiny, both depths' rows): hidden states up to 4.7 differ by 0.047 from ours and 0.063 from bf16 (ours: 0.063),
    logits up to 16 by 0.16 from ours and 0.19 from bf16 (ours: 0.20), the same top-1 everywhere."""
    reference = random_mtp(dtype=BF16)
    ours, theirs = random_mtp(dtype=BF16).quantize_("int8"), random_mtp(dtype=BF16).quantize_(ao.Int8WeightOnlyConfig())
    rows = draft_rows(reference)
    want, mine, got = (m(*rows).float() for m in (reference, ours, theirs))
    assert (got - mine).abs().max() <= 0.02 * want.abs().max()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    logits = [m.compute_logits(m(*rows)).float() for m in (reference, ours, theirs)]
    assert (logits[2] - logits[1]).abs().max() <= 0.02 * logits[0].abs().max()
    assert torch.equal(logits[2].argmax(-1), logits[1].argmax(-1))


def test_applying_a_config_changes_no_global_inductor_setting():
    """torchao's configs default to set_inductor_config=True, which sets global Inductor options when applied."""
    config = ao.Int8WeightOnlyConfig()
    assert config.set_inductor_config
    before = torch._inductor.config.get_config_copy()
    random_mtp(dtype=BF16).quantize_(config)
    assert torch._inductor.config.get_config_copy() == before
    assert config.set_inductor_config  # the caller's config object is not modified either


def test_a_config_that_skips_a_linear_is_refused_and_nothing_changes():
    """Int4WeightOnlyConfig(group_size=256) on CPU leaves every tiny linear (in-features 64 / 128) as it was."""
    mtp = random_mtp(dtype=BF16)
    params = dict(mtp.named_parameters())
    with pytest.raises(ValueError, match=r"torchao's Int4WeightOnlyConfig left \['0.input_proj', .*\] unquantized "
                                         r"\(their shapes \[\(64, 128\)"):
        mtp.quantize_(ao.Int4WeightOnlyConfig(group_size=256))
    assert dict(mtp.named_parameters()) == params and mtp.quantization is None
    mtp.quantize_("int8")  # still a plain model: quantizing it works


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal (an sm89+ GPU has the kernel)")
def test_a_config_without_a_kernel_here_names_the_reason():
    mtp = random_mtp(dtype=BF16)
    params = dict(mtp.named_parameters())
    with pytest.raises(ValueError, match=r"torchao's Float8DynamicActivationFloat8WeightConfig cannot quantize the "
                                         r"depth linears here \(AssertionError: .*compute capability"):
        mtp.quantize_(ao.Float8DynamicActivationFloat8WeightConfig())
    assert dict(mtp.named_parameters()) == params and mtp.quantization is None


def test_float32_models_are_refused_for_torchao_configs_too():
    with pytest.raises(ArgumentError, match=r"bfloat16 activations, this model runs in torch.float32"):
        random_mtp().quantize_(ao.Int8WeightOnlyConfig())


def test_without_torchao_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # what `import` finds when it is not installed
    with pytest.raises(ImportError, match=r"torchao quantization schemes need torchao: pip install "
                                          r"'inkling_compiled\[torchao\]'"):
        torchao_schemes.import_quantization()


def test_is_config():
    assert torchao_schemes.is_config(ao.Int8WeightOnlyConfig())
    assert not any(torchao_schemes.is_config(s) for s in ("int8", None, 8, ao.Int8WeightOnlyConfig))


# torch's own line on a CUDA build of torch without a CUDA runtime (CI's floor venv: a CPU machine), which the first
# import of torch.utils.cpp_extension logs; a compile through torchao's tensors happens to import it, ours not
NO_CUDA_RUNTIME = re.compile(r"torch/utils/cpp_extension\.py:\d+\] (\[\d+/\d+\] )?No CUDA runtime is found")


def _run_quietly(code: str) -> list[str]:
    """The lines a fresh process running ``code`` prints, torch's log prefixes (time, pid) removed."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [re.sub(r"^[IWEDC]\d{4} [\d:.]+ +\d+ ", "", line) for line in (done.stdout + done.stderr).splitlines()]
    return [line for line in lines if not NO_CUDA_RUNTIME.match(line)]


def test_importing_torchao_through_us_prints_nothing():
    """torchao's import logs a line for each CUDA-only library it cannot load on a CPU build, and torch a pytree
    deprecation; compiling a model holding its tensors warns that AOT autograd's cache cannot hash them. None of it
    may reach the user: the process prints what the same compile with our own int8 scheme prints (nothing, on the
    CPU build of torch)."""
    def compile_first_linear(scheme: str) -> list[str]:
        return _run_quietly("import torch\n"
                            "from inkling_compiled.model import torchao_schemes\n"
                            "from tests.helpers import random_mtp\n"
                            f"scheme = {scheme}\n"
                            "mtp = random_mtp(dtype=torch.bfloat16).quantize_(scheme, head=False)\n"
                            "layer = mtp.layers[0].input_proj\n"
                            "torch.compile(layer)(torch.randn(1, 128, dtype=torch.bfloat16))\n")

    assert compile_first_linear("torchao_schemes.import_quantization().Int8WeightOnlyConfig()") == \
        compile_first_linear("'int8'")


def test_a_torchao_model_is_not_packaged():
    """AOTInductor compiles a torchao tensor's data into the package's code by value (seen: every depth linear),
    where a package must read the model's own tensors: refused before anything is built."""
    from inkling_compiled.runtime import Drafter
    from inkling_compiled.runtime.drafter import FAST_PATH_OFF

    mtp = random_mtp(dtype=BF16).quantize_(ao.Int8WeightOnlyConfig())
    drafter = Drafter(mtp, 1, 32, num_speculative_tokens=1, compile_options={"options": FAST_PATH_OFF["cpu"]})
    with pytest.raises(ValueError, match=r"a model quantized with a torchao scheme \(torchao:Int8WeightOnlyConfig\) "
                                         r"cannot be packaged.*use quantize='int8'"):
        drafter.save_compiled("/nonexistent/never-written")
