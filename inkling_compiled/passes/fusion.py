"""What one fusion is, and the helpers its patterns are written with; importing this module imports no Inductor.

A :class:`Fusion` names a rewrite, the function that fills its ``PatternMatcherPass`` (called on first use) and the
source files its behaviour depends on. :func:`register` makes each pattern fire only on ops the model wrote
(:func:`emitted_by_model`), so that any other model compiled next to ours, the transformers target included, stays
stock. :func:`pass_uuid` names a set of fusions by the contents of those files: Inductor's FX graph cache keys on it,
and a package records it (docs/compile.md §2), which is why it must be computable without importing Inductor
(``passes.version()``, used when loading a package in a process that never compiles).

The manager that runs fusions in Inductor's post-grad slot is ``manager.py``; Inductor's pattern matcher and
post-grad modules are imported where used, not here.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import re
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import model as model_package

if TYPE_CHECKING:
    from torch._inductor.pattern_matcher import Match, PatternMatcherPass

# The files every manager's behaviour depends on besides its fusions' own: this module and the manager's.
MACHINERY_SOURCES = (__file__, os.path.join(os.path.dirname(__file__), "manager.py"))


def trace(fn: Callable[..., Any], args: Sequence[Any], **kwargs: Any) -> torch.fx.GraphModule:
    """The ``trace_fn`` of every pattern here: Inductor's inference tracer, functionalized, views as reshapes.

    Written ``(fn, args, **kwargs)`` because torch 2.11 calls it with two arguments and 2.13 adds
    ``get_decomp_fn=``. Functionalizing turns an in-place op into the out-of-place one the post-grad graph holds;
    ``view`` becomes ``reshape`` because that is all the post-grad graph has by the time our pass runs.
    """
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.pattern_matcher import fwd_only

    gm = fwd_only(torch.func.functionalize(fn), args, **kwargs)
    view_to_reshape(gm)
    gm.recompile()
    return gm


def trace_without_round_trips(fn: Callable[..., Any], args: Sequence[Any], **kwargs: Any) -> torch.fx.GraphModule:
    """:func:`trace`, then ``convert(convert(x, d1), d2)`` collapsed to ``convert(x, d2)`` (or ``x``).

    torch 2.11's joint-graph ``pointless_convert`` does this to the real graph before post-grad passes run, even when
    the inner cast is a lossy rounding (fp32 -> bf16 -> fp32: the round trip between the two embedding norms); 2.13
    keeps such roundings. Patterns traced both ways match the graph whichever torch built it.
    """
    gm = trace(fn, args, **kwargs)
    convert = torch.ops.prims.convert_element_type.default
    for node in list(gm.graph.nodes):
        inner = node.args[0] if node.target is convert else None
        if not (isinstance(inner, torch.fx.Node) and inner.target is convert):
            continue
        source, dtype = inner.args[0], node.args[1]
        source_dtype = source.meta["val"].dtype if isinstance(source, torch.fx.Node) else None
        if source_dtype == dtype:
            node.replace_all_uses_with(source)
        else:
            node.args = (source, dtype)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def register(search, replace, example_inputs, patterns: PatternMatcherPass, extra_check: Callable[[Match], bool],
             scalar_workaround: dict[str, float], *, retrace: bool = True, tracer=trace) -> None:
    """``register_replacement`` with :func:`trace`: ``search`` and ``replace`` take the same arguments;
    ``example_inputs`` fix only dtypes and ranks; ``scalar_workaround`` names the literal arguments (eps, scale)
    and the stand-in value traced for each.

    Every pattern also requires :func:`emitted_by_model`. The first match ignores every int, float, list and dtype
    literal. With ``retrace`` (the default), Inductor then
    re-traces ``search`` at the match's real shapes and dtypes and requires the graph to equal that trace exactly.
    A search with reshapes cannot use that under dynamic shapes: the re-trace spells each symbolic size as its own
    expression, while the graph computes it once for several reshapes. ``retrace=False`` keeps the first pattern,
    and ``extra_check`` must then verify the literals that matter itself.
    """
    from torch._inductor.pattern_matcher import PatternPrettyPrinter, gen_pattern, register_replacement

    def check(match: Match) -> bool:
        return emitted_by_model(match) and extra_check(match)

    if retrace:
        # Skip a pattern that traces identically to one registered before (2-D and 3-D often do); torch versions
        # without the flag neither check nor skip, which is harmless (a duplicate entry never matches twice).
        skips = "skip_duplicates" in inspect.signature(register_replacement).parameters
        skip = {"skip_duplicates": True} if skips else {}
        register_replacement(search, replace, list(example_inputs), tracer, patterns, extra_check=check,
                             scalar_workaround=scalar_workaround, **skip)
        return
    pattern = gen_pattern(search, list(example_inputs), tracer, scalar_workaround)
    seen = patterns.__dict__.setdefault("_inkling_seen", set())
    key = PatternPrettyPrinter.run(pattern)
    if key in seen:  # 2-D and 3-D or two dtypes can trace to one pattern
        return
    seen.add(key)
    register_replacement(search, replace, list(example_inputs), tracer, patterns, extra_check=check,
                         scalar_workaround=scalar_workaround, search_fn_pattern=pattern)


# Directories whose code the passes may rewrite: the model's modules (the patterns are traced from its functions).
MODEL_SOURCE_DIRS = (os.path.dirname(os.path.realpath(model_package.__file__)),)
_TORCH_DIR = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
_FRAME_FILE = re.compile(r'^\s*File "(.+)", line \d+, in ', re.M)


@functools.lru_cache(maxsize=4096)
def _innermost_caller(stack_trace: str) -> str | None:
    """The file of the innermost frame outside torch (``F.pad`` and friends add torch's own frames below it)."""
    for file in reversed(_FRAME_FILE.findall(stack_trace)):
        path = os.path.realpath(file)
        if not path.startswith(_TORCH_DIR):
            return path
    return None


def emitted_by_model(match: Match) -> bool:
    """Every matched op that names its source was written in the model's modules, and at least one does.

    Dynamo records each op's Python stack as ``meta["stack_trace"]``; AOTAutograd copies it onto the ATen ops it
    traces, and Inductor's own rewrites before ours copy it onto their replacements, so every post-grad node of the
    model's graphs carries one (torch 2.13). Ops without one say nothing either way. A look-alike in other code
    (``F.linear(x / c, W)``, an RMSNorm + cat of its own) is left alone; the tests on the real model graph fail
    should a torch release stop carrying the stack over.
    """
    dirs = tuple(d.rstrip(os.sep) + os.sep for d in MODEL_SOURCE_DIRS)
    named = False
    for node in match.nodes:
        stack_trace = node.meta.get("stack_trace")
        caller = _innermost_caller(stack_trace) if stack_trace else None
        if caller is None:
            continue
        if not caller.startswith(dirs):
            return False
        named = True
    return named


def same_shape(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Sizes provably equal, symbolic ones included (never adds a guard)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def tensor_meta(match: Match, name: str) -> torch.Tensor | None:
    """The fake tensor a pattern argument was bound to, or None when it is not a tensor-valued node."""
    node = match.kwargs.get(name)
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def is_python_scalar(value: Any) -> bool:
    """A literal int or float baked into the graph (not a bool, tensor, node or symbolic value)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Fusion:
    """One named rewrite: a ``PatternMatcherPass`` that ``fill(patterns)`` registers its patterns into on first use."""

    def __init__(self, name: str, fill: Callable[[PatternMatcherPass], None], sources: Iterable[str]):
        self.name = name
        self.sources = tuple(sources)  # files whose text decides what this fusion does (hashed into the uuid)
        self._fill = fill
        self._patterns: PatternMatcherPass | None = None  # created and filled on first use

    @property
    def patterns(self) -> PatternMatcherPass:
        self.ensure_registered()
        return self._patterns

    @property
    def registered(self) -> bool:
        return self._patterns is not None

    def ensure_registered(self) -> None:
        if self._patterns is not None:
            return
        from torch._dynamo.utils import counters
        from torch._inductor.pattern_matcher import PatternMatcherPass
        from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

        patterns = PatternMatcherPass(pass_name=f"inkling_{self.name}")
        # The same isolation Inductor's own lazy pattern init uses: trace on fresh fake tensors, outside any
        # compile's fake mode or tracing context, and leave Inductor's counters as they were.
        saved = counters["inductor"].copy()
        with torch._guards.tracing(None), unset_fake_temporarily(), FakeTensorMode():
            self._fill(patterns)
        counters["inductor"] = saved
        self._patterns = patterns

    def apply(self, graph: torch.fx.Graph) -> int:
        self.ensure_registered()
        return self.patterns.apply(graph)

    def __repr__(self) -> str:
        return f"Fusion({self.name!r})"


def pass_sources(fusions: Iterable[Fusion], extra_sources: Iterable[str] = ()) -> tuple[str, ...]:
    """Every file whose text decides what a manager of ``fusions`` does, sorted."""
    files = {*MACHINERY_SOURCES, *extra_sources}
    for fusion in fusions:
        files.update(fusion.sources)
    return tuple(sorted(files))


def pass_uuid(sources: Iterable[str], names: Iterable[str]) -> str:
    """SHA-256 of the files' contents (not their paths, so two checkouts of one source share the FX graph cache) and
    the fusion names (a manager over a subset of the fusions is another pass)."""
    digest = hashlib.sha256()
    for path in sources:
        with open(path, "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    digest.update(",".join(names).encode())
    return digest.hexdigest()
