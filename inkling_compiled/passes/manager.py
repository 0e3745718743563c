"""The one object Inductor sees: the fusions (``fusion.py``) run in order behind a single ``CustomGraphPass``.

The :class:`PassManager` runs each fusion module's rewrites (``fuse_draft_input``, ``fold_mup_scale``) on the
post-grad graph, counts matches per fusion, and names itself by :func:`~inkling_compiled.passes.fusion.pass_uuid`
(a hash of the files those rewrites depend on), so Inductor's FX graph cache keys on the pass source instead of
bypassing the cache. Patterns are traced lazily, on the first graph the manager sees (or
:meth:`PassManager.ensure_registered`), so building the manager costs no tracing.

This module subclasses Inductor's pass types, so importing it imports ``torch._inductor`` (and Dynamo with it):
``passes/__init__.py`` imports it only once Inductor is loaded (docs/compile.md §1).

:class:`ChainedPass` lets the manager share ``post_grad_custom_post_pass`` with a pass a user put there first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch._inductor import custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass

from .fusion import Fusion, pass_sources, pass_uuid

COUNTER_KEY = "inkling_passes"  # torch._dynamo.utils.counters[COUNTER_KEY][fusion name] += matches

# Recent torch hands post passes of this class an ``is_inference`` flag; releases without it only call plain passes.
_InferenceAwarePass = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", None)


class PassManager(CustomGraphPass):
    """Runs its fusions in order on a post-grad graph; ``match_counts()`` tells what fired since ``reset_counts()``."""

    def __init__(self, fusions: Sequence[Fusion], extra_sources: Iterable[str] = ()):
        names = [f.name for f in fusions]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate fusion names: {names}")
        self.fusions = tuple(fusions)
        self.sources = pass_sources(self.fusions, extra_sources)
        self._counts: Counter[str] = Counter()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fusions)

    def ensure_registered(self) -> None:
        """Trace every pattern now (otherwise done on the first graph the manager sees)."""
        for fusion in self.fusions:
            fusion.ensure_registered()

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._dynamo.utils import counters

        for fusion in self.fusions:
            n = fusion.apply(graph)
            if n:
                self._counts[fusion.name] += n
                counters[COUNTER_KEY][fusion.name] += n

    def uuid(self) -> str:
        return pass_uuid(self.sources, self.names)

    def match_counts(self) -> dict[str, int]:
        """Matches per fusion (in pass order) since construction or the last :meth:`reset_counts`."""
        return {name: self._counts[name] for name in self.names}

    def reset_counts(self) -> None:
        self._counts.clear()

    def __deepcopy__(self, memo) -> PassManager:
        # Dynamo deep-copies the whole Inductor config on every compile (to log it); a copy of the traced patterns
        # would be slow and pointless (this object is shared state by design: its counts).
        return self

    def __repr__(self) -> str:
        return f"PassManager({', '.join(self.names)})"


class ChainedPass(_InferenceAwarePass or CustomGraphPass):  # type: ignore[misc]
    """A user's pre-existing post pass (``theirs``: one pass or a list of them) followed by ours.

    ``theirs`` is kept as given, so uninstalling puts back exactly what was there. The uuid is the tuple of the
    members' uuids, or None (Inductor then bypasses its cache) when a member cannot name itself.
    """

    def __init__(self, theirs: Any, ours: CustomGraphPass):
        self.theirs = theirs
        self.ours = ours
        self.passes = (*(theirs if isinstance(theirs, (list, tuple)) else (theirs,)), ours)

    def __call__(self, graph: torch.fx.Graph, is_inference: bool | None = None) -> None:
        for p in self.passes:
            if _InferenceAwarePass is not None and isinstance(p, _InferenceAwarePass):
                p(graph, is_inference=bool(is_inference))
            else:
                p(graph)

    def uuid(self) -> tuple[Any, ...] | None:
        ids = []
        for p in self.passes:
            uid = p.uuid() if isinstance(p, CustomGraphPass) else None
            if not uid:
                return None
            ids.append(uid)
        return tuple(ids)

    def __deepcopy__(self, memo) -> ChainedPass:
        return self  # see PassManager.__deepcopy__

    def __repr__(self) -> str:
        return f"ChainedPass({self.theirs!r} then {self.ours!r})"
