"""How the package's and the benchmark's modules depend on each other: no import cycles (read statically from every
module's imports, function-level ones included), and ``import inkling_compiled`` loads no training, testing or
benchmark code."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCANNED = (REPO / "inkling_compiled", REPO / "bench")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for root in SCANNED for p in sorted(root.rglob("*.py"))}


def _imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its body (relative imports resolved). ``from X
    import a`` names the module ``X.a`` when that is a module, else ``X`` (where ``a`` is defined)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
    return {name for name in found if name in known and name != module}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_is_read_correctly():
    modules = _modules()
    graph = {m: _imported(m, p, set(modules)) for m, p in modules.items()}
    assert "inkling_compiled.model.mtp" in graph["inkling_compiled.runtime.drafter"]  # `from ..model.mtp import`
    assert "inkling_compiled.passes" in graph["inkling_compiled"]  # `from . import passes`
    assert "inkling_compiled.training.distill" in graph["inkling_compiled.generate"]  # a function-level import
    assert {"bench.harness", "bench.step"} <= graph["bench.packaged"]  # `from . import step as S`, `from .harness`
    assert "inkling_compiled.runtime" in graph["bench.probes"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_package_and_the_benchmark_have_no_import_cycles():
    modules = _modules()
    graph = {m: _imported(m, p, set(modules)) for m, p in modules.items()}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# ------------------------------------------------------------------------------------------------ what importing costs
# The lazy boundary (docs/architecture.md, "What importing costs"): the package and its runtime import neither
# Inductor, Dynamo nor transformers; the passes still reach every Inductor compile, through an import hook.

HEAVY = ("torch._inductor", "torch._dynamo", "transformers")


def _run(code: str, *args: str, **env) -> subprocess.CompletedProcess:
    """A fresh interpreter running ``code`` with ``args``; it must succeed."""
    environment = {k: v for k, v in os.environ.items() if k != "INKLING_COMPILED_PASSES"} | env
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=environment, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _fresh(code: str, **env) -> dict:
    """The JSON a fresh interpreter prints last after running ``code``."""
    return json.loads(_run(code, **env).stdout.strip().splitlines()[-1])


# One interpreter for four facts, in the order that keeps each one clean: the modules ``import inkling_compiled``
# loads, then those its runtime and passes add, then what installing the passes imports, then (last: it imports
# transformers) loading a transformers target.
_IMPORTS = """
import json, sys
import inkling_compiled
package = sorted(sys.modules)
import inkling_compiled.runtime, inkling_compiled.passes as p
runtime = sorted(sys.modules)
p.install()
install = [p.installed(), "torch._inductor.pattern_matcher" in sys.modules]
from inkling_compiled.testing.synthetic import load_hf_target
load_hf_target(sys.argv[1])
print(json.dumps({"package": package, "runtime": runtime, "install": install}))
"""


@pytest.fixture(scope="module")
def imports(tiny_checkpoint) -> dict:
    """What ``_IMPORTS`` found, and the interpreter's whole stderr (``"stderr"``)."""
    done = _run(_IMPORTS, str(tiny_checkpoint), TRANSFORMERS_VERBOSITY="error")
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"stderr": done.stderr}


def test_importing_the_package_loads_no_training_testing_or_benchmark_code(imports):
    loaded = imports["package"]
    assert "inkling_compiled.passes" in loaded  # (what the package does import: its passes, installed)
    tooling = [m for m in loaded if m.startswith(("inkling_compiled.training", "inkling_compiled.testing", "bench.",
                                                  "tests.")) or m in ("inkling_compiled.generate", "bench", "tests")]
    assert tooling == []


def test_importing_the_package_and_runtime_imports_no_compiler_and_no_transformers(imports):
    loaded = imports["runtime"]
    assert [m for m in loaded if m.split(".")[0] == "transformers" or m.startswith(HEAVY[:2])] == []


def test_installing_the_passes_imports_no_pattern_matcher(imports):
    # (measured against whatever the package itself imports, so this stays about the passes; moved here from
    # tests/passes/test_manager.py to share the interpreter)
    installed, matcher = imports["install"]
    assert installed and (not matcher or "torch._inductor.pattern_matcher" in imports["package"])


def test_loading_a_transformers_target_prints_no_torchao_import_lines(imports):
    """transformers imports torchao (when installed) with its model classes; torchao then logs a load failure per
    CUDA-only extension on a CPU build and torch a pytree deprecation: noise our loaders hold back."""
    stderr = imports["stderr"]
    assert "torchao" not in stderr and "_pytree" not in stderr, stderr


_SLOT = ("import json, sys, torch, inkling_compiled.passes as p; {before}"
         "f = torch.compile(lambda x: x + 1); from torch._inductor import config; "
         "slot = config.post_grad_custom_post_pass; "
         "print(json.dumps([repr(slot), slot is p.pass_manager() if slot is not None else None]))")


def test_the_passes_reach_the_slot_when_torch_compile_imports_inductor():
    assert _fresh(_SLOT.format(before=""))[1] is True


def test_the_env_switch_and_uninstall_before_inductor_keep_it_stock():
    assert _fresh(_SLOT.format(before=""), INKLING_COMPILED_PASSES="0")[0] == "None"
    assert _fresh(_SLOT.format(before="assert p.uninstall() and not p.uninstall(); "))[0] == "None"


def test_the_slot_of_an_inductor_imported_first_gets_the_passes_at_once():
    before = "import torch._inductor.config as c; assert c.post_grad_custom_post_pass is None; "
    code = "import json, sys, torch; " + before + (
        "import inkling_compiled.passes as p; print(json.dumps(c.post_grad_custom_post_pass is p.pass_manager()))")
    assert _fresh(code) is True


def test_building_the_manager_first_installs_that_manager_and_its_uuid_is_the_version():
    code = ("import json, inkling_compiled.passes as p; v = p.version(); m = p.pass_manager(); "
            "from torch._inductor import config; print(json.dumps([v == m.uuid(), "
            "config.post_grad_custom_post_pass is m]))")
    assert _fresh(code) == [True, True]
