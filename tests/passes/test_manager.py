"""The manager and its installation: slot handling (chaining, uninstall, env switch), lazy patterns, counts, uuid,
and the FX graph cache being used (not bypassed) with the passes installed."""

import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import inkling_compiled.passes as passes
from inkling_compiled.model.head import mup_logits
from inkling_compiled.passes import fold_mup_scale, fuse_draft_input, manager
from inkling_compiled.passes.fusion import Fusion
from inkling_compiled.passes.manager import ChainedPass, PassManager
from inkling_compiled.testing.kernel_stats import compile_fresh

REPO = Path(__file__).resolve().parents[2]


class RecordingPass(CustomGraphPass):
    """A user's own post pass: records that it ran."""

    def __init__(self, uid="user-pass-v1"):
        self.calls = 0
        self.uid = uid

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return self.uid


def _head(hidden, weight):
    return mup_logits(hidden, weight, 24.0, 90)


# --- the slot --------------------------------------------------------------------------------------------------


def test_install_is_idempotent_and_uninstall_empties_the_slot(empty_slot):
    assert not passes.installed()
    assert passes.install() and passes.install()
    assert inductor_config.post_grad_custom_post_pass is passes.pass_manager()  # the one object, not a list
    assert passes.installed()
    assert passes.uninstall()
    assert inductor_config.post_grad_custom_post_pass is None and not passes.installed()
    assert not passes.uninstall()


def test_env_switch_turns_install_off(empty_slot, monkeypatch):
    monkeypatch.setenv(passes.ENV_VAR, "0")
    assert not passes.install()
    assert inductor_config.post_grad_custom_post_pass is None
    monkeypatch.setenv(passes.ENV_VAR, "1")
    assert passes.install()


@pytest.mark.parametrize("theirs", ["pass", "list", "callable"])
def test_a_users_pass_is_chained_and_restored(empty_slot, theirs):
    user = RecordingPass()
    plain_calls = []
    original = {"pass": user, "list": [user], "callable": plain_calls.append}[theirs]
    inductor_config.post_grad_custom_post_pass = original
    assert passes.install() and passes.install()
    slot = inductor_config.post_grad_custom_post_pass
    assert isinstance(slot, ChainedPass) and slot.theirs is original and slot.ours is passes.pass_manager()
    if theirs == "callable":
        assert slot.uuid() is None  # cannot name the user's pass: Inductor must bypass its cache, not guess
    else:
        assert slot.uuid() == (user.uid, passes.pass_manager().uuid())
    assert passes.uninstall()
    restored = inductor_config.post_grad_custom_post_pass
    assert restored == original if theirs == "list" else restored is original  # (the config may copy a list)


def test_chained_pass_runs_both(empty_slot):
    user = RecordingPass()
    hidden, weight = torch.randn(2, 3, 64), torch.randn(96, 64)
    inductor_config.post_grad_custom_post_pass = user
    passes.install()
    torch._dynamo.reset()
    before = passes.match_counts()["fold_mup_scale"]
    with inductor_config.patch(fx_graph_cache=False):
        out = torch.compile(_head)(hidden, weight)
    torch._dynamo.reset()
    assert user.calls == 1
    assert passes.match_counts()["fold_mup_scale"] == before + 1
    torch.testing.assert_close(out, _head(hidden, weight), rtol=1e-5, atol=1e-5)


def test_config_copies_share_the_manager():
    # Dynamo deep-copies the Inductor config on every compile (for its logs): the manager must not be copied.
    ours = passes.pass_manager()
    assert copy.deepcopy(ours) is ours
    chain = ChainedPass(RecordingPass(), ours)
    assert copy.deepcopy(chain) is chain


# --- the manager -----------------------------------------------------------------------------------------------


def test_patterns_are_traced_on_first_use_only():
    registered = []
    fusion = Fusion("probe", registered.append, [__file__])
    probe = PassManager([fusion])
    assert registered == [] and not fusion.registered  # building the manager traced nothing
    graph = torch.fx.symbolic_trace(lambda x: x + 1).graph
    probe(graph)
    probe(graph)
    assert registered == [fusion.patterns]
    assert probe.match_counts() == {"probe": 0}


def test_counts_per_fusion_and_reset(empty_slot):
    hidden, weight = torch.randn(2, 3, 64), torch.randn(96, 64)
    run = compile_fresh(_head, hidden, weight, passes=True)
    assert run.matches == {"fuse_draft_input_embed": 0, "fuse_draft_input": 0, "fold_mup_scale": 1}
    passes.reset_match_counts()
    assert passes.match_counts() == {name: 0 for name in passes.pass_manager().names}


def test_uuid_hashes_the_sources(tmp_path):
    ours = passes.pass_manager()
    assert ours.uuid() == ours.uuid()
    for module in (fuse_draft_input, fold_mup_scale, manager):
        assert module.__file__ in ours.sources
    for model_file in ("norm.py", "depth_input.py", "head.py"):  # patterns are traced from these
        assert any(s.endswith(os.path.join("model", model_file)) for s in ours.sources)

    def manager_over_copy(folder, edit=None):
        folder.mkdir()
        files = []
        for src in ours.sources:
            dst = folder / f"{len(files)}_{Path(src).name}"
            shutil.copy(src, dst)
            files.append(str(dst))
        if edit:
            Path(files[0]).write_text(Path(files[0]).read_text() + edit)
        return PassManager([Fusion(n, lambda p: None, files) for n in ours.names])

    same = manager_over_copy(tmp_path / "a").uuid()
    assert manager_over_copy(tmp_path / "b").uuid() == same  # contents, not paths
    assert manager_over_copy(tmp_path / "c", edit="\n# changed\n").uuid() != same


# --- FX graph cache: keyed on the uuid, hit by a second process ------------------------------------------------

_CACHE_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from torch._dynamo.utils import counters
    import inkling_compiled.passes as passes
    from inkling_compiled.model.head import mup_logits

    torch.manual_seed(0)
    passes.install()
    hidden, weight = torch.randn(2, 3, 64), torch.randn(96, 64)
    out = torch.compile(lambda h, w: mup_logits(h, w, 24.0, 90))(hidden, weight)
    print(json.dumps({
        "uuid": passes.pass_manager().uuid(),
        "installed": passes.installed(),
        "hit": counters["inductor"]["fxgraph_cache_hit"],
        "miss": counters["inductor"]["fxgraph_cache_miss"],
        "bypass": counters["inductor"]["fxgraph_cache_bypass"],
        "matches": passes.match_counts()["fold_mup_scale"],
        "checksum": out.double().sum().item(),
    }))
""")


def _run_cache_script(cache_dir):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    env.pop(passes.ENV_VAR, None)
    done = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_hits_the_fx_graph_cache(tmp_path):
    first = _run_cache_script(tmp_path)
    second = _run_cache_script(tmp_path)
    assert first["installed"] and first["bypass"] == 0 and first["miss"] >= 1 and first["matches"] == 1
    assert second["hit"] >= 1 and second["miss"] == 0 and second["bypass"] == 0
    assert second["matches"] == 0  # served from the cache: the pass did not run again
    assert second["uuid"] == first["uuid"] == passes.pass_manager().uuid()  # stable across processes
    assert second["checksum"] == first["checksum"]
