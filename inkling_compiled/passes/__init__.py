"""Inductor passes for the MTP draft head: one manager in ``torch._inductor.config.post_grad_custom_post_pass``.

::

    from inkling_compiled import passes
    passes.install()            # idempotent; False (and nothing done) when INKLING_COMPILED_PASSES=0
    compiled = torch.compile(fn)
    passes.match_counts()       # {"fuse_draft_input_embed": 1, "fuse_draft_input": 0, "fold_mup_scale": 1}
    passes.uninstall()          # puts back whatever was in the slot before

Every compile in the process then runs the manager, but its patterns match only ops written in
``inkling_compiled/model/`` (:func:`~inkling_compiled.passes.fusion.emitted_by_model`): other models, the
transformers target included, compile as stock. Install before the first call of a compiled function: Inductor reads
the slot when it compiles. The post slot (not the pre one) matters: Inductor's own post-grad patterns would otherwise
undo the head's ``addmm`` on GPU. A pass a user already put in the slot keeps running, before ours (see
:class:`~inkling_compiled.passes.manager.ChainedPass`).
Installing imports nothing: while ``torch._inductor`` is not loaded yet, :func:`install` arms an import hook that
puts the manager into the slot the moment ``torch._inductor`` has finished importing, which every Inductor compile
(``torch.compile``, AOTInductor) does before it can read the slot; a process that only runs packaged steps never
pays for Inductor or Dynamo (docs/compile.md §1). Patterns are traced on the first graph the manager sees. Compiles
served from the FX graph cache do not run passes, so
counts only move on real compiles (the cache key holds the manager's uuid, a hash of the pass sources).

Shapes may be static or symbolic (a recompile for a new length still fuses), but ``torch.compile(dynamic=True)``
also turns Python floats into graph inputs: eps and the muP scale are then runtime tensors and nothing fuses
(correct, just unfused). The drafter compiles with ``dynamic=False``.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from . import fold_mup_scale, fuse_draft_input
from .fusion import Fusion, pass_sources, pass_uuid

if TYPE_CHECKING:
    from .manager import ChainedPass, PassManager

__all__ = ["ENV_VAR", "ChainedPass", "Fusion", "PassManager", "enabled_by_env", "install", "installed",
           "match_counts", "pass_manager", "pending", "reset_match_counts", "uninstall", "version"]

ENV_VAR = "INKLING_COMPILED_PASSES"  # "0" / "false" / "off" / "no": install() does nothing
_OFF = ("0", "false", "off", "no")
INDUCTOR = "torch._inductor"
FUSIONS = fuse_draft_input.FUSIONS + fold_mup_scale.FUSIONS  # in the order they run

_manager: PassManager | None = None


def __getattr__(name: str):
    # the manager's classes subclass Inductor's: importing them imports torch._inductor, so only when asked for
    if name in ("ChainedPass", "PassManager"):
        from . import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def pass_manager() -> PassManager:
    """The process-wide manager (all fusions, in order); built on first use, patterns traced on its first graph.
    Building it imports ``torch._inductor`` (which installs the manager if :func:`install` was called)."""
    global _manager
    if _manager is None:
        import torch._inductor  # noqa: F401 (first, not from manager.py: its import hook may build the manager)

        from .manager import PassManager

        if _manager is None:
            _manager = PassManager(FUSIONS)
    return _manager


def version() -> str:
    """``pass_manager().uuid()``, computed without importing Inductor (what a package records, docs/compile.md §12)."""
    return pass_uuid(pass_sources(FUSIONS), [f.name for f in FUSIONS])


# ------------------------------------------------------------------------------------------------ the lazy install


class _InstallAfterInductorImport:
    """A ``sys.meta_path`` finder that finds nothing itself: for ``torch._inductor`` it hands on the spec the other
    finders give, its loader made to run :func:`install` right after the package's code (Inductor's config, which
    holds the slot, is loaded by then; no compile can have started). It stays armed until that import succeeds."""

    def find_spec(self, name, path=None, target=None):
        if name != INDUCTOR:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        run_package = spec.loader.exec_module  # a loader object of this one import: patching it changes no other

        def exec_module(module):
            run_package(module)
            _disarm()
            install()

        spec.loader.exec_module = exec_module
        return spec


_hook = _InstallAfterInductorImport()


def pending() -> bool:
    """Whether an install waits for ``torch._inductor`` to be imported (the slot then holds exactly our manager)."""
    return _hook in sys.meta_path


def _disarm() -> None:
    if pending():
        sys.meta_path.remove(_hook)


def _inductor_loaded() -> bool:
    return INDUCTOR in sys.modules


def _slot():
    from torch._inductor import config

    return config


def _contains_ours(slot, ours: PassManager) -> bool:
    from .manager import ChainedPass

    if slot is ours:
        return True
    if isinstance(slot, ChainedPass):
        return slot.ours is ours or _contains_ours(slot.theirs, ours)
    if isinstance(slot, (list, tuple)):
        return any(_contains_ours(p, ours) for p in slot)
    return False


def _without_ours(slot, ours: PassManager):
    """``slot`` with our manager taken out, a chain collapsed back to what it wrapped."""
    from .manager import ChainedPass

    if slot is ours:
        return None
    if isinstance(slot, ChainedPass) and slot.ours is ours:
        return _without_ours(slot.theirs, ours)
    if isinstance(slot, (list, tuple)):
        kept = [q for q in (_without_ours(p, ours) for p in slot) if q is not None]
        return type(slot)(kept) if kept else None
    return slot


def enabled_by_env() -> bool:
    """False when ``INKLING_COMPILED_PASSES`` is 0 / false / off / no (read at each :func:`install`)."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in _OFF


def install() -> bool:
    """Put the manager into ``post_grad_custom_post_pass`` (chained after a pass already there), or, while
    ``torch._inductor`` is not imported, arm the hook that does so when it is. Idempotent.

    Returns whether the passes are (or will be, on Inductor's import) installed: False when
    ``INKLING_COMPILED_PASSES=0``.
    """
    if not enabled_by_env():
        return installed() if _inductor_loaded() else pending()
    if not _inductor_loaded():
        if not pending():
            sys.meta_path.insert(0, _hook)
        return True
    from .manager import ChainedPass

    _disarm()
    ours, config = pass_manager(), _slot()
    slot = config.post_grad_custom_post_pass
    if not _contains_ours(slot, ours):
        config.post_grad_custom_post_pass = ours if not slot else ChainedPass(slot, ours)
    return True


def uninstall() -> bool:
    """Take the manager out of the slot (or disarm the pending install), leaving any other pass as it was. Returns
    whether it was installed."""
    if pending():
        _disarm()
        return True
    if not _inductor_loaded():
        return False
    ours, config = pass_manager(), _slot()
    slot = config.post_grad_custom_post_pass
    if not _contains_ours(slot, ours):
        return False
    config.post_grad_custom_post_pass = _without_ours(slot, ours)
    return True


def installed() -> bool:
    """Whether the slot holds the manager now (imports Inductor, which completes a pending install)."""
    return _contains_ours(_slot().post_grad_custom_post_pass, pass_manager())


def match_counts() -> dict[str, int]:
    """Matches per fusion since the last :func:`reset_match_counts` (real compiles only, not cache hits)."""
    return pass_manager().match_counts()


def reset_match_counts() -> None:
    pass_manager().reset_counts()
