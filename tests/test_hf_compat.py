"""The transformers floor: the version check on import and the cache argument read off the forward's signature.

`make test-floor` runs this file (with the speculative, parity and checkpoint tests) on pyproject's lowest allowed
versions, where the forward still calls its cache ``past_key_values``.
"""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, InklingForCausalLM

from inkling_compiled import hf_compat
from inkling_compiled.runtime import speculative
from tests.helpers import randomize_, tiny_text_config

pytestmark = pytest.mark.floor  # make test-floor: exercises a dependency at its lowest version

ROOT = Path(__file__).resolve().parents[1]


def test_target_step_continues_the_cache():
    """The prefill fills the cache and the next step reads it: equal to one forward over the whole sequence."""
    target = randomize_(InklingForCausalLM(tiny_text_config(attn_implementation="eager"))).eval()
    ids = torch.tensor([[5, 9, 17, 33, 2, 71, 8]])
    mask = torch.ones_like(ids)
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        speculative._target_step(target, ids[:, :-1], mask[:, :-1], cache, last_only=True)
        assert cache.get_seq_length() == ids.shape[1] - 1
        hidden, logits = speculative._target_step(target, ids[:, -1:], mask, cache, last_only=True)
        full_hidden, full_logits = speculative._target_step(target, ids, mask, DynamicCache(config=target.config),
                                                            last_only=True)
    torch.testing.assert_close(hidden, full_hidden[:, -1:])
    torch.testing.assert_close(logits, full_logits)


class _Renamed(torch.nn.Module):
    def forward(self, input_ids, cache=None, **kwargs): ...


class _Legacy(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, **kwargs): ...


class _NoCache(torch.nn.Module):
    def forward(self, input_ids, **kwargs): ...


def test_cache_argument_is_read_off_the_signature():
    assert hf_compat.cache_argument(_Renamed()) == "cache"
    assert hf_compat.cache_argument(_Legacy()) == "past_key_values"


def test_a_forward_without_a_cache_argument_is_a_clear_error():
    with pytest.raises(TypeError, match=r"_NoCache.forward takes none of cache, past_key_values \(transformers 5\."):
        hf_compat.cache_argument(_NoCache())


@pytest.mark.parametrize("version", ["5.22.2", "5.17.0", "4.57.6", "5.3.0", "nightly"])
def test_transformers_below_the_floor_is_rejected(version):
    with pytest.raises(ImportError, match=rf"needs transformers >= 5\.23; found transformers {version}"):
        hf_compat.check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.23.0", "5.24.0", "5.30.0.dev0", "6.0.0", "10.1"])
def test_transformers_at_or_above_the_floor_is_accepted(version):
    hf_compat.check_transformers_version(version)


def test_importing_the_package_on_old_transformers_names_the_version():
    code = "import transformers; transformers.__version__ = '5.17.0'; import inkling_compiled"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode != 0
    assert "ImportError: inkling_compiled needs transformers >= 5.23; found transformers 5.17.0" in run.stderr


def test_floor_is_pyproject_floor():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = ".".join(map(str, hf_compat.MIN_TRANSFORMERS))
    assert f"transformers>={floor}" in dependencies
