"""Inductor passes for the MTP draft head: one manager in ``torch._inductor.config.post_grad_custom_post_pass``.

::

    from inkling_compiled import passes
    passes.install()            # idempotent; False (and nothing done) when INKLING_COMPILED_PASSES=0
    compiled = torch.compile(fn)
    passes.match_counts()       # {"fuse_draft_input_embed": 1, "fuse_draft_input": 0, "fold_mup_scale": 1}
    passes.uninstall()          # puts back whatever was in the slot before

Every compile in the process then runs the manager, but its patterns match only ops written in
``inkling_compiled/model/`` (:func:`~inkling_compiled.passes.manager.emitted_by_model`): other models, the
transformers target included, compile as stock. Install before the first call of a compiled function: Inductor reads
the slot when it compiles. The post slot (not the pre one) matters: Inductor's own post-grad patterns would otherwise
undo the head's ``addmm`` on GPU. A pass a user already put in the slot keeps running, before ours (see
:class:`~inkling_compiled.passes.manager.ChainedPass`).
Installing costs the import of ``torch._inductor`` (about a second on a small CPU) and no pattern tracing: patterns
are traced on the first graph the manager sees. Compiles served from the FX graph cache do not run passes, so
counts only move on real compiles (the cache key holds the manager's uuid, a hash of the pass sources).

Shapes may be static or symbolic (a recompile for a new length still fuses), but ``torch.compile(dynamic=True)``
also turns Python floats into graph inputs: eps and the muP scale are then runtime tensors and nothing fuses
(correct, just unfused). The drafter compiles with ``dynamic=False``.
"""

from __future__ import annotations

import os

from torch._inductor import config as inductor_config

from . import fold_mup_scale, fuse_draft_input
from .manager import ChainedPass, Fusion, PassManager

__all__ = ["ENV_VAR", "ChainedPass", "Fusion", "PassManager", "enabled_by_env", "install", "installed",
           "match_counts", "pass_manager", "reset_match_counts", "uninstall"]

ENV_VAR = "INKLING_COMPILED_PASSES"  # "0" / "false" / "off" / "no": install() does nothing
_OFF = ("0", "false", "off", "no")

_manager: PassManager | None = None


def pass_manager() -> PassManager:
    """The process-wide manager (all fusions, in order); built on first use, patterns traced on its first graph."""
    global _manager
    if _manager is None:
        _manager = PassManager(fuse_draft_input.FUSIONS + fold_mup_scale.FUSIONS)
    return _manager


def _contains_ours(slot, ours: PassManager) -> bool:
    if slot is ours:
        return True
    if isinstance(slot, ChainedPass):
        return slot.ours is ours or _contains_ours(slot.theirs, ours)
    if isinstance(slot, (list, tuple)):
        return any(_contains_ours(p, ours) for p in slot)
    return False


def _without_ours(slot, ours: PassManager):
    """``slot`` with our manager taken out, a chain collapsed back to what it wrapped."""
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
    """Put the manager into ``post_grad_custom_post_pass`` (chained after a pass already there). Idempotent.

    Returns whether the passes are installed afterwards: False when ``INKLING_COMPILED_PASSES=0``.
    """
    if not enabled_by_env():
        return installed()
    ours = pass_manager()
    slot = inductor_config.post_grad_custom_post_pass
    if _contains_ours(slot, ours):
        return True
    inductor_config.post_grad_custom_post_pass = ours if not slot else ChainedPass(slot, ours)
    return True


def uninstall() -> bool:
    """Take the manager out of the slot, leaving any other pass as it was. Returns whether it was installed."""
    ours = pass_manager()
    slot = inductor_config.post_grad_custom_post_pass
    if not _contains_ours(slot, ours):
        return False
    inductor_config.post_grad_custom_post_pass = _without_ours(slot, ours)
    return True


def installed() -> bool:
    return _contains_ours(inductor_config.post_grad_custom_post_pass, pass_manager())


def match_counts() -> dict[str, int]:
    """Matches per fusion since the last :func:`reset_match_counts` (real compiles only, not cache hits)."""
    return pass_manager().match_counts()


def reset_match_counts() -> None:
    pass_manager().reset_counts()
