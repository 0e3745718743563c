"""torchao weight-only configs as quantization schemes for the depth linears (docs/compile.md §11).

``InklingMTP.quantize_(config)`` with a torchao config instance (``Int8WeightOnlyConfig()``, on an H200
``Float8DynamicActivationFloat8WeightConfig()``, ...) hands each depth's ``nn.Linear`` modules to torchao's own
``quantize_``. The LM head is not a linear module but a Parameter shared with the target, and torchao has no place
for the 1/muP multiplier, so ``head=True`` still builds our draft-only int8 copy (``model/int8.py``).

torchao is the optional ``torchao`` extra, imported only here and only when such a scheme is used. Three of its
habits are kept out of the caller's process: a config's ``set_inductor_config=True`` (its default) would change
global Inductor settings for every later compile, so configs are applied with it off (the drafter's fast options
are scoped to its own compile instead); its import logs a load failure for each CUDA-only extension library on a CPU
build and a torch pytree deprecation, which are silenced; and compiling one of its tensor subclasses warns that AOT
autograd's cache cannot hash it, which is filtered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import warnings

import torch
from torch import nn

INSTALL_HINT = "pip install 'inkling_compiled[torchao]'"
_QUIET_LOGGERS = ("torchao", "torch.utils._pytree")  # the import-time lines named in the module doc


@contextlib.contextmanager
def quiet_import():
    """torchao's import-time log lines held back inside the block. transformers imports torchao (when installed)
    with its model classes, so the loaders of transformers targets import them in this block too."""
    loggers = [logging.getLogger(name) for name in _QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def import_quantization():
    """``torchao.quantization``, imported without its log lines; ImportError naming the extra without torchao."""
    try:
        with quiet_import():
            import torchao.quantization
    except ImportError as e:
        raise ImportError(f"torchao quantization schemes need torchao: {INSTALL_HINT}") from e
    warnings.filterwarnings("ignore", message=r".* does not implement _stable_hash_for_caching", category=UserWarning)
    return torchao.quantization


def is_config(scheme) -> bool:
    """Whether ``scheme`` is a torchao config instance (without importing torchao: a caller holding one has)."""
    config_module = sys.modules.get("torchao.core.config")
    return config_module is not None and isinstance(scheme, config_module.AOBaseConfig)


def scheme_name(config) -> str:
    return f"torchao:{type(config).__name__}"


def _is_subclass(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a torchao tensor (a traceable subclass); a weight it skipped stays a plain tensor."""
    return hasattr(weight, "__tensor_flatten__")


def nbytes(weight: torch.Tensor) -> int:
    """Bytes a weight holds: a torchao tensor's inner tensors (``__tensor_flatten__``; its ``nbytes`` is the logical
    high-precision size), else its own."""
    if _is_subclass(weight):
        names, _ = weight.__tensor_flatten__()
        return sum(nbytes(getattr(weight, name)) for name in names)
    return weight.nbytes


def quantize_linears(module: nn.Module, config) -> tuple[int, int]:
    """Every ``nn.Linear`` in ``module`` quantized in place by torchao with ``config``: (bytes before, after).

    All or nothing: when torchao fails (a ValueError with its reason: e.g. float8 GEMMs need an sm89+ GPU), or
    leaves a linear as it was (it skips shapes a config cannot take, e.g. an in-feature count that a group size does
    not divide, without saying so: a ValueError naming the linears), every weight is put back.
    """
    quantization = import_quantization()
    if getattr(config, "set_inductor_config", False):
        config = dataclasses.replace(config, set_inductor_config=False)
    linears = {name: m for name, m in module.named_modules() if isinstance(m, nn.Linear)}
    originals = {name: m.weight for name, m in linears.items()}
    try:
        try:
            quantization.quantize_(module, config)
        except Exception as e:  # torchao's own checks are bare asserts and library errors: name what failed
            raise ValueError(f"torchao's {type(config).__name__} cannot quantize the depth linears here "
                             f"({type(e).__name__}: {e})") from e
        unchanged = [name for name, m in linears.items() if not _is_subclass(m.weight)]
        if unchanged:
            raise ValueError(f"torchao's {type(config).__name__} left {unchanged} unquantized (their shapes "
                             f"{[tuple(originals[n].shape) for n in unchanged]} do not fit it)")
    except BaseException:
        for name, weight in originals.items():
            linears[name].weight = weight
        raise
    return sum(w.nbytes for w in originals.values()), sum(nbytes(m.weight) for m in linears.values())
