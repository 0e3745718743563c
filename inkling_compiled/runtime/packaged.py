"""Draft steps packaged ahead of time: ``torch.export`` + AOTInductor, run with no Dynamo at call time
(docs/compile.md §12).

A *step* here is a function of static input buffers that reads tensors held elsewhere and writes some of them in
place: the drafter's window prologue (its committed rows) and its depth step (one depth's parameters, the shared
embedding / head, and that depth's cache). Packaging one:

- ``torch.export.export(strict=True)`` traces it the way ``torch.compile`` does (Dynamo), so every op keeps the
  source stack our passes check (non-strict export records only ``forward`` frames, and the head's fusion would not
  fire). The tensors the step reads are the exported module's parameters and buffers (found by identity, under the
  names of the *state* module given with it), so none of them is baked into the program.
- AOTInductor compiles it with ``package_constants_in_so=False``: the package holds code only, no weight and no
  cache byte. Our passes run during that compile (Inductor reads the post-grad slot; the FX graph cache is off so
  that they really run) and their match counts are recorded.
- At load, ``load_constants(user_managed=True)`` binds the package's constants to the tensors of a state module of
  the same layout: the loaded step reads the model's parameters (shared with the target) and writes the caller's
  cache. One package file serves every checkpoint of one config and dtype, and every depth of one geometry (loaded
  once per depth, each runner bound to that depth's tensors); loading copies nothing. The loaded step keeps
  references to those tensors (the package holds their raw pointers); an in-place update of a weight is seen, a
  replaced Parameter is not (load again).

A package is a directory holding ``manifest.json`` (what it was built for, the caller's layout, per step its file,
checksum, inputs (a dynamic dim as its [lowest, highest]), constants and matches) and one ``.pt2`` per step, written
atomically; :func:`read_manifest` (which checks the type of every field loading reads), :func:`mismatch` and
:func:`load_step` read it back, each with an error naming what is wrong.

A drafter's package (:func:`save_rounds`, :func:`load_rounds`, behind ``Drafter.save_compiled`` /
``Drafter.load_compiled``) holds, per (batch bucket, rows, greedy/sampled) bucket, the window prologue (K > 1) and
one depth step per depth geometry, which every depth of that geometry runs over its own parameters and cache. Saved
with a ``rows`` range (the round cache's entries, ``runtime/round_cache.py``), each bucket's steps are exported with
the window's rows dynamic in it, and the one package serves every window width in the range that the drafter's calls
run as. At load the layout is checked against the inputs each step was exported for: a step run at another width
would draft wrong tokens without an error.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import reprlib
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from .. import arguments, passes
from ..arguments import ArgumentError
from ..atomic_files import build_directory_atomically
from ..model.cache import DepthCache
from ..model.mtp import InklingMTP, MTPDepth

MANIFEST = "manifest.json"
FORMAT = "inkling_compiled.packaged/3"  # 3: a dynamic dim of a step's inputs recorded as its [lowest, highest]
# What every package is compiled with, on top of the caller's Inductor options: no constants in the package; every
# parameter kept a constant (Inductor otherwise inlines small ones by value: the MLP's 1-element global_scale would be
# frozen at the saving checkpoint's value); and a real compile (a cache hit skips our passes and records no matches).
AOTI_OPTIONS = {"aot_inductor.package_constants_in_so": False, "always_keep_tensor_constants": True,
                "fx_graph_cache": False}
# compared at load, in this order
BUILT_FOR = ("config", "dtype", "quantization", "num_speculative_tokens", "device", "torch", "passes",
             "tensor_parallel")


def _is_count(value, minimum: int = 1) -> bool:
    return type(value) is int and value >= minimum  # a JSON int: not a bool, not a float


def _is_list(value, check, *, empty: bool = False) -> bool:
    return isinstance(value, list) and (empty or len(value) > 0) and all(map(check, value))


def _is_bucket(value) -> bool:
    return (isinstance(value, list) and len(value) == 3 and _is_count(value[0]) and _is_count(value[1])
            and type(value[2]) is bool)


def _is_rows(value) -> bool:
    return value is None or (isinstance(value, list) and len(value) == 2 and all(map(_is_count, value))
                             and value[0] <= value[1])


def _is_file_name(value) -> bool:
    return isinstance(value, str) and value not in ("", "..") and Path(value).name == value  # no path: one file here


# What read_manifest checks of the fields that loading uses, as key -> (check, what the value must be); the other
# built_for fields are only compared (a value of any type that differs is a mismatch).
BUILT_FOR_FIELDS = {"num_speculative_tokens": (_is_count, "an int >= 1"),
                    "config_fields": (lambda v: isinstance(v, dict), "an object")}
STEP_FIELDS = {"file": (_is_file_name, "the name of a file in the package"),
               "sha256": (lambda v: isinstance(v, str), "a string"),
               "constants": (lambda v: isinstance(v, dict), "an object"),
               "inputs": (lambda v: _is_list(v, lambda i: isinstance(i, dict) and isinstance(i.get("shape"), list),
                                             empty=True), "a list of objects with a 'shape' list")}
# what a drafter's package records of the drafter, to rebuild it at load
LAYOUT_FIELDS = {"max_batch_size": (_is_count, "an int >= 1"), "max_length": (_is_count, "an int >= 1"),
                 "batch_buckets": (lambda v: _is_list(v, _is_count), "a non-empty list of ints >= 1"),
                 "graph_rows": (lambda v: _is_list(v, _is_count, empty=True), "a list of ints >= 1"),
                 "buckets": (lambda v: _is_list(v, _is_bucket), "a non-empty list of [batch, rows, sampled]"),
                 "depth_steps": (lambda v: _is_list(v, lambda j: _is_count(j, 0)), "a non-empty list of ints >= 0"),
                 "rows": (_is_rows, "null or [lowest, highest] ints >= 1")}


class PackageError(ValueError):
    """A package directory that cannot be read or written: missing, incomplete, corrupt, or in the way."""


class PackageMismatch(PackageError):
    """A readable package built for something else; ``fields`` names what differs (of :data:`BUILT_FOR`)."""

    def __init__(self, directory, differences: dict[str, str]):
        self.fields = tuple(differences)
        self.reason = f"the packaged steps in {directory} were built for another setup: " + "; ".join(
            differences.values())
        super().__init__(self.reason + ". Package them again here (save_compiled), or load with fallback=True to run "
                         "the usual step instead")


# ------------------------------------------------------------------------------------------------ what a step reads

def _holder(tensors: Mapping[str, torch.Tensor]) -> nn.Module:
    """A module registering ``tensors`` (the caller's own objects, not copies) as its buffers."""
    holder = nn.Module()
    for name, tensor in tensors.items():
        holder.register_buffer(name, tensor)
    return holder


def depth_state(model: InklingMTP, layer: MTPDepth, cache: DepthCache) -> nn.Module:
    """What one depth's step reads besides its inputs, under the names its package's constants carry: the depth's
    parameters (``layer.<name>``), the model's tensors outside its depths (``shared.<name>``: embedding, norms, head)
    and the depth's cache (``cache.<field>``). The same layout for every depth of one geometry."""
    state = nn.Module()
    state.layer = layer
    state.shared = nn.Module()
    for name, child in model.named_children():
        if name != "layers":
            state.shared.add_module(name, child)
    for name, parameter in model.named_parameters(recurse=False):
        state.shared.register_parameter(name, parameter)
    state.cache = _holder({f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)})
    return state


def history_state(tensors: Mapping[str, torch.Tensor]) -> nn.Module:
    """What the window prologue reads and writes besides its inputs: the committed rows (``history.<name>``)."""
    state = nn.Module()
    state.history = _holder(tensors)
    return state


def _state_tensors(state: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(state.named_parameters(remove_duplicate=False)), **dict(state.named_buffers(remove_duplicate=False))}


class _Exported(nn.Module):
    """``step`` as the module ``torch.export`` takes: the state's modules are its children, so the parameters and
    buffers the step reaches (by identity) get the state's names. Outputs that are None are left out."""

    def __init__(self, step: Callable, state: nn.Module):
        super().__init__()
        for name, child in state.named_children():
            self.add_module(name, child)
        self.step = step

    def forward(self, *inputs):
        return tuple(t for t in self.step(*inputs) if t is not None)


def _describe(t: torch.Tensor, dynamic: Mapping[int, torch.export.Dim] | None = None) -> dict:
    """``t``'s shape, stride and dtype; a dim of ``dynamic`` recorded as the [lowest, highest] size it was exported
    for, so that the manifest says which sizes the step takes."""
    dynamic = dynamic or {}
    shape = [[dynamic[d].min, dynamic[d].max] if d in dynamic else size for d, size in enumerate(t.shape)]
    return {"shape": shape, "stride": list(t.stride()), "dtype": str(t.dtype)}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------------ what it was built for

def config_record(config) -> dict:
    """The config's compared fields as JSON values (the checkpoint's raw config.json is not part of it)."""
    record = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.compare}
    return json.loads(json.dumps(record, default=dataclasses.asdict))


def device_kind(device: torch.device) -> str:
    """What generated code depends on: the CPU's vector ISA, or the GPU's compute capability."""
    if device.type == "cpu":
        return f"cpu {torch.backends.cpu.get_cpu_capability()}"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda sm_{major}{minor}"
    return device.type


def pass_version(inductor_options: Mapping):
    """The uuid of the post-grad custom pass a compile with these options runs (the caller's override, else the
    installed slot): our pass manager's uuid, a chain's list of uuids, or None for stock Inductor. Before Inductor is
    imported the slot can only come to hold our manager (the install pending) or nothing: read without importing it,
    so that loading a package costs no Inductor (docs/architecture.md §1)."""
    if "post_grad_custom_post_pass" in inductor_options:
        slot = inductor_options["post_grad_custom_post_pass"]
    elif passes.INDUCTOR in sys.modules:
        from torch._inductor import config

        slot = config.post_grad_custom_post_pass
    else:
        return passes.version() if passes.pending() else None
    if slot is None:
        return None
    uuid = slot.uuid() if callable(getattr(slot, "uuid", None)) else None
    return json.loads(json.dumps(uuid)) if uuid else f"unversioned {type(slot).__name__}"


def built_for(model: InklingMTP, inductor_options: Mapping, num_speculative_tokens: int) -> dict:
    """What a package of a K-depth round for ``model`` compiled with ``inductor_options`` in this process depends on
    (:data:`BUILT_FOR`; ``config_fields`` only to name the fields when the config differs)."""
    fields = config_record(model.config)
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    quantization = model.quantization
    return {"config": digest, "config_fields": fields, "dtype": str(model.dtype),
            "quantization": None if quantization is None else f"{quantization.scheme} head={quantization.head}",
            "num_speculative_tokens": num_speculative_tokens, "device": device_kind(model.device),
            "torch": torch.__version__, "passes": pass_version(inductor_options),
            # a rank's steps hold its shard sizes and vocab offset: a package serves only the rank that built it
            "tensor_parallel": None if (tp := model.parallel) is None else f"rank {tp.rank} of {tp.world_size}"}


def mismatch(directory, manifest: dict, here: dict) -> PackageMismatch | None:
    """The error naming every :data:`BUILT_FOR` field in which the package differs from ``here``, or None."""
    recorded = manifest["built_for"]
    differences = {}
    for key in BUILT_FOR:
        if recorded.get(key) == here[key]:
            continue
        if key == "config":
            theirs, ours = recorded.get("config_fields") or {}, here["config_fields"]
            named = [f"{f} {theirs.get(f)!r} vs {ours.get(f)!r}" for f in ours if theirs.get(f) != ours.get(f)]
            differences[key] = f"config {recorded.get(key)} vs this model's {here[key]} ({', '.join(named)})"
        else:
            differences[key] = f"{key} {recorded.get(key)!r} vs {here[key]!r} here"
    return PackageMismatch(directory, differences) if differences else None


def matches(directory, manifest: dict, here: dict, *, fallback: bool) -> bool:
    """Whether the package was built for ``here``; if not, the :class:`PackageMismatch`, or with ``fallback`` a
    warning (for the caller's caller: the user of ``Drafter.load_compiled``) and False."""
    problem = mismatch(directory, manifest, here)
    if problem is not None and not fallback:
        raise problem
    if problem is not None:
        warnings.warn(f"{problem.reason}; running the usual step instead", RuntimeWarning, stacklevel=3)
    return problem is None


# ------------------------------------------------------------------------------------------------ saving

def save(directory, steps: Mapping[str, tuple[Callable, Sequence[torch.Tensor], nn.Module]], *,
         built_for: dict, layout: dict, inductor_options: Mapping,
         dynamic_shapes: Mapping[str, tuple] | None = None, cache: bool = False) -> Path:
    """Export and package each ``name -> (step, example inputs, state)`` into a new ``directory`` (atomically: it
    appears complete or not at all); ``layout`` is the caller's record of how to rebuild the states;
    ``dynamic_shapes`` gives a step's inputs' dynamic dims (``torch.export``'s spec, one entry per input). Checked
    before any compile: ArgumentError when a file is in the directory's way, PackageError when it exists, is a link,
    or appears while compiling (``cache``: a round-cache entry, where a concurrent builder's copy wins instead)."""
    directory = Path(directory)
    if directory.is_symlink():  # dangling, or to an empty directory: the rename after the compile would fail
        raise PackageError(f"{directory} is a symbolic link: a package is written as a new directory; name a path "
                           "that does not exist")
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise PackageError(f"{directory} already exists: packages are not overwritten; remove it or choose another "
                           "directory")
    nearest = arguments.nearest_existing(directory.absolute().parent)
    if not nearest.is_dir():
        raise ArgumentError(f"directory {str(directory)!r} cannot be created: {str(nearest)!r} on its path is a file")

    def build(temporary: Path) -> None:
        records = {name: _package(step, inputs, state, temporary / f"{name}.pt2", inductor_options,
                                  (dynamic_shapes or {}).get(name))
                   for name, (step, inputs, state) in steps.items()}
        manifest = {"format": FORMAT, "built_for": built_for, "layout": layout,
                    "threads": torch.get_num_threads(),  # CPU kernels keep the thread count they were compiled with
                    "steps": records}
        (temporary / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")

    try:
        return build_directory_atomically(directory, build, complete=MANIFEST, first_wins=cache)
    except FileExistsError:
        raise PackageError(f"{directory} appeared while this package was compiled: packages are not overwritten, "
                           "and this one was discarded; remove it or choose another directory") from None
    except OSError as e:  # a read-only or full disk: named with the package, not the temporary directory beside it
        raise PackageError(f"the package {directory} could not be written: {e}") from e


def _package(step: Callable, inputs: Sequence[torch.Tensor], state: nn.Module, path: Path,
             inductor_options: Mapping, dynamic_shapes: tuple | None = None) -> dict:
    """One step exported and compiled into ``path``; its manifest record."""
    from torch._functorch import config as functorch_config
    from torch._inductor import aoti_compile_and_package
    from torch._inductor import config as inductor_config

    from ..passes import pass_manager

    start = time.perf_counter()
    with warnings.catch_warnings():
        # torch's packaging deep-copies its own tree specs, and copying a LeafSpec trips torch's deprecation of it
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`", category=FutureWarning)
        with torch.no_grad():
            program = torch.export.export(_Exported(step, state), tuple(inputs), strict=True,  # forward(*inputs)
                                          dynamic_shapes=None if dynamic_shapes is None else (dynamic_shapes,))
        baked = sorted(program.constants)
        if baked:  # a tensor the step reads that is not in the state would be frozen into the package
            raise PackageError(f"the step reads tensors outside its state (the model's, its cache's): {baked}")
        before = pass_manager().match_counts()
        # AOTInductor writes its platform keys into the global aot_inductor.metadata dict: patched with a copy, so
        # Inductor's config is left as it was, else every later compile of the process would miss the FX graph cache
        metadata = dict(inductor_config.aot_inductor.metadata)
        with functorch_config.patch(enable_autograd_cache=False), \
                inductor_config.patch({"aot_inductor.metadata": metadata}):
            aoti_compile_and_package(program, package_path=str(path),
                                     inductor_configs={**inductor_options, **AOTI_OPTIONS})
    after = pass_manager().match_counts()
    signature = program.graph_signature
    read = {*signature.parameters, *signature.buffers}
    tensors = _state_tensors(state)
    kept = set(_load(path, next(iter(tensors.values())).device).get_constant_fqns())
    if read - kept:  # never expected (AOTI_OPTIONS): the package would ignore these tensors of the model it serves
        raise PackageError(f"AOTInductor compiled {sorted(read - kept)} into the step by value")
    specs = dynamic_shapes or (None,) * len(inputs)
    return {"file": path.name, "sha256": _sha256(path), "inputs": [_describe(t, d) for t, d in zip(inputs, specs)],
            "constants": {name: _describe(tensors[name]) for name in sorted(kept)},
            "matches": {k: after[k] - before.get(k, 0) for k in after}, "seconds": time.perf_counter() - start}


# ------------------------------------------------------------------------------------------------ loading

def _field_problems(where: str, record: dict, fields: Mapping[str, tuple[Callable, str]]) -> list[str]:
    """Each of ``fields`` that ``record`` lacks, or holds a value of the wrong type or shape in (named, abridged)."""
    problems = []
    for key, (check, what) in fields.items():
        if key not in record:
            problems.append(f"{where} lacks {key!r}")
        elif not check(record[key]):
            problems.append(f"{where}.{key} must be {what}, got {reprlib.repr(record[key])}")
    return problems


def read_manifest(directory, layout_fields: Mapping[str, tuple[Callable, str]] | None = None) -> dict:
    """The package's manifest, checked once for every field loading reads (:data:`BUILT_FOR_FIELDS`,
    :data:`STEP_FIELDS`, and ``layout_fields`` in its layout: :data:`LAYOUT_FIELDS` for a drafter's), so that a
    damaged one is a PackageError naming the field and its value, not a TypeError deep in loading; PackageError
    naming the directory or file when it is missing, unreadable or not a package manifest."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise PackageError(f"no package at {directory}: not a directory")
    if not path.is_file():
        raise PackageError(f"{directory} holds no {MANIFEST}: not a package")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackageError(f"{path} is unreadable: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise PackageError(f"{path} is not a package manifest of format {FORMAT!r} (found {found!r})")
    problems = [f"{key!r} must be an object" for key in ("built_for", "layout", "steps")
                if not isinstance(manifest.get(key), dict)]
    if not problems:
        problems = _field_problems("built_for", manifest["built_for"], BUILT_FOR_FIELDS)
        for name, record in manifest["steps"].items():
            problems += (_field_problems(f"steps[{name!r}]", record, STEP_FIELDS) if isinstance(record, dict)
                         else [f"steps[{name!r}] must be an object, got {reprlib.repr(record)}"])
        problems += _field_problems("layout", manifest["layout"], layout_fields or {})
    if problems:
        raise PackageError(f"{path} is damaged: {'; '.join(problems)}")
    return manifest


def load_step(directory, manifest: dict, name: str, state: nn.Module) -> PackagedStep:
    """Step ``name`` of the package, bound to ``state``'s tensors (which must look as they did when it was saved)."""
    directory = Path(directory)
    record = manifest["steps"].get(name)
    if record is None:
        raise PackageError(f"{directory}: the manifest has no step {name!r} (it has {sorted(manifest['steps'])})")
    tensors = _state_tensors(state)
    wrong = [f"{c} (recorded {want}, found {_describe(tensors[c]) if c in tensors else 'nothing'})"
             for c, want in record["constants"].items() if c not in tensors or _describe(tensors[c]) != want]
    if wrong:
        raise PackageError(f"step {name!r} of the package in {directory} needs tensors this model and drafter do not "
                           "have: " + "; ".join(wrong))
    device = next(iter(tensors.values())).device
    return PackagedStep(directory / record["file"], record["sha256"], {c: tensors[c] for c in record["constants"]},
                        device)


def _load(path: Path, device: torch.device):
    """The AOTInductor runner in ``path``, single-threaded: no events between runs, which a CUDA graph capture could
    not record. The C++ loader itself: ``torch._inductor.package.load_package`` adds only a device check (ours is
    :func:`device_kind`) that costs a second of imports and compiler probing in a fresh process."""
    return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", True, 1,
                                                 -1 if device.index is None else device.index)


class PackagedStep:
    """One packaged step bound to the caller's tensors: ``step(*inputs)`` -> list of output tensors."""

    def __init__(self, path: Path, sha256: str, constants: dict[str, torch.Tensor], device: torch.device):
        if not path.is_file():
            raise PackageError(f"{path} is missing from its package")
        if _sha256(path) != sha256:
            raise PackageError(f"{path} is corrupt: its contents are not what the manifest recorded (sha256)")
        try:
            loader = _load(path, device)
            loader.load_constants(constants, False, True, True)  # active buffer, check all given, user-managed
        except RuntimeError as e:
            raise PackageError(f"{path} could not be loaded: {e}") from e
        self.path = path
        self._constants = constants  # the package holds their raw pointers: keep them alive
        self._loader = loader
        self._run = loader.run  # the C++ call, without the pytree handling of AOTICompiledModel.__call__

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        return self._run(inputs)

    def __repr__(self) -> str:
        return f"PackagedStep({self.path})"


# ------------------------------------------------------------------------------------------------ a drafter's rounds

def _step_name(key: tuple[int, int, bool], step: str) -> str:
    """The file stem of one packaged step of a bucket: ``window`` or ``depth<k>`` (k: the first depth of a geometry)."""
    batch, rows, sampled = key
    return f"b{batch}-r{rows}-{'sampled' if sampled else 'greedy'}-{step}"


def geometry_depths(drafter) -> list[int]:
    """For each depth 0..K-1 of ``drafter``, the first depth of its geometry: the one whose step every depth of it
    runs."""
    geometries = drafter.model.config.depths
    return [next(j for j in range(k + 1) if geometries[j] == geometries[k])
            for k in range(drafter.num_speculative_tokens)]


def _history_state(drafter) -> nn.Module:
    rows = drafter.history
    return history_state({"input_ids": rows.input_ids, "positions": rows.positions, "hidden": rows.hidden})


def _depth_state(drafter, k: int) -> nn.Module:
    return depth_state(drafter.model, drafter.model.layers[k], drafter.cache.depths[k])


def widths(drafter, rows: Sequence[int]) -> list[int]:
    """The window widths in ``rows`` (lowest, highest) that the drafter's calls run as (``Drafter.bucket``)."""
    low, high = rows
    return sorted({w for r in range(low, high + 1) if low <= (w := drafter.bucket(1, r)[1]) <= high})


def save_rounds(drafter, directory, buckets: Sequence, rows: tuple[int, int] | None = None, *,
                cache: bool = False) -> Path:
    """Package the round of each of ``buckets`` (the drafter's static buffers of a bucket, as example inputs) of a
    ``Drafter`` into the new ``directory``, with the drafter's layout; ``Drafter.save_compiled`` documents it. With
    ``rows`` (lowest, highest; the lowest at least 2, which export does not specialize), the window's rows are
    dynamic in that range: each bucket's steps then serve every width of :func:`widths`. ``cache``: ``directory``
    is an entry of the round cache, where a concurrent builder's copy serves as well as ours (:func:`save`)."""
    if drafter._freezing:  # frozen weights are compiled into the code: the package could not read the model's own
        raise ValueError("save_compiled: this drafter compiles with Inductor freezing (a quantized model's fast "
                         "path, docs/compile.md §11), which folds the weights into the code; package with "
                         "compile_options={'options': {'freezing': False}}")
    model = drafter.model
    scheme = model.quantization.scheme if model.quantization is not None else ""
    if scheme.startswith("torchao:"):  # AOTInductor would compile its tensors' int8 data into the code by value
        raise ValueError(f"save_compiled: a model quantized with a torchao scheme ({scheme}) cannot be packaged: "
                         "AOTInductor flattens its weight tensors into constants of the code, which a package "
                         "that reads the model's own tensors cannot have; use quantize='int8'")
    steps = {}
    for buffers in buckets:
        inputs = (buffers.input_ids, buffers.positions, buffers.hidden)
        if drafter.history is not None:
            steps[_step_name(buffers.key, "window")] = (drafter._window, inputs, _history_state(drafter))
        sampling = (buffers.noise[0], buffers.inv_temperature) if buffers.sampled else ()
        for k in sorted(set(geometry_depths(drafter))):
            step = functools.partial(drafter._depth, model.layers[k], drafter.cache.depths[k])
            steps[_step_name(buffers.key, f"depth{k}")] = (step, inputs + sampling, _depth_state(drafter, k))
    dynamic = None
    if rows is not None and rows[1] > rows[0]:  # ids, positions, hidden: [batch, rows, ...]; the sampling inputs not
        dim = torch.export.Dim("rows", min=rows[0], max=rows[1])
        dynamic = {name: ({1: dim},) * 3 + (None,) * (len(given) - 3) for name, (_, given, _) in steps.items()}
    layout = {"max_batch_size": drafter.max_batch_size, "max_length": drafter.max_length,
              "graph_rows": drafter.graph_rows,
              # the buckets a new Drafter given these rebuilds, with the same largest graph bucket
              "batch_buckets": [b for b in drafter.batch_buckets if b <= drafter.graph_batch_limit],
              "buckets": [buffers.key for buffers in buckets], "depth_steps": geometry_depths(drafter),
              "rows": None if rows is None else list(rows)}
    options = drafter._inductor_options
    return save(directory, steps, built_for=built_for(model, options, drafter.num_speculative_tokens), layout=layout,
                inductor_options=options, dynamic_shapes=dynamic, cache=cache)


def _takes(size, width: int) -> bool:
    """Whether an input dim the manifest records (its size, or a dynamic dim's [lowest, highest]) takes ``width``."""
    if isinstance(size, list) and len(size) == 2 and all(map(_is_count, size)):
        return size[0] <= width <= size[1]
    return size == width


def _check_exported(directory, manifest: dict, key: tuple[int, int, bool], served: list[int]) -> None:
    """PackageError unless the manifest records every step of bucket ``key`` exported for its batch and every width
    in ``served`` (their first three inputs: ids, positions, hidden): the layout says which widths a bucket serves,
    and a step run at a width it was not exported for drafts wrong tokens, with no error."""
    prefix, batch = _step_name(key, ""), key[0]
    for name, record in manifest["steps"].items():
        if not name.startswith(prefix):
            continue
        shapes = [given["shape"][:2] for given in record["inputs"][:3]]
        if len(shapes) < 3 or not all(len(s) == 2 and s[0] == batch and all(_takes(s[1], w) for w in served)
                                      for s in shapes):
            raise PackageError(f"{directory} is damaged: its layout has step {name!r} run {batch} sequences of "
                               f"{served} rows, but the manifest records it exported for [batch, rows] of {shapes}")


def check_cache_size(directory, manifest: dict) -> None:
    """PackageError unless the layout's ``max_batch_size`` and ``max_length`` are those of the cache each depth step
    was exported against (``cache.k``: [batch, max_length + 1, ...]); checked before a drafter allocates a cache of
    that size, which an edited manifest could make any size."""
    layout = manifest["layout"]
    want = [layout["max_batch_size"], layout["max_length"] + 1]
    for name, record in manifest["steps"].items():
        k = record["constants"].get("cache.k")
        shape = k.get("shape") if isinstance(k, dict) else None
        if k is not None and (not isinstance(shape, list) or shape[:2] != want):
            raise PackageError(f"{directory} is damaged: its layout has max_batch_size {want[0]} and max_length "
                               f"{want[1] - 1}, but step {name!r} was exported for a cache of [batch, max_length + 1] "
                               f"{shape[:2] if isinstance(shape, list) else shape}")


def load_rounds(drafter, directory, manifest: dict) -> dict[tuple[int, int, bool], functools.partial]:
    """Bucket key -> the packaged round of that bucket, its steps bound to ``drafter``'s model and cache (the drafter
    built from the manifest's layout, :func:`read_manifest` with :data:`LAYOUT_FIELDS`); a package saved with a
    ``rows`` range gives each bucket's round under the key of every width of :func:`widths`. The layout is checked
    against the model's depth geometries and the inputs each step was exported for."""
    layout = manifest["layout"]
    if layout["depth_steps"] != geometry_depths(drafter):
        raise PackageError(f"{directory} is damaged: layout.depth_steps {layout['depth_steps']} are not this "
                           f"model's {geometry_depths(drafter)} (per depth, the first depth of its geometry)")
    window = _history_state(drafter) if drafter.history is not None else None
    rounds = {}
    for key in (tuple(key) for key in layout["buckets"]):
        batch, width, sampled = key
        served = [width] if layout["rows"] is None else widths(drafter, layout["rows"])
        _check_exported(directory, manifest, key, served)
        prologue = None if window is None else load_step(directory, manifest, _step_name(key, "window"), window)
        depths = [load_step(directory, manifest, _step_name(key, f"depth{step}"), _depth_state(drafter, j))
                  for j, step in enumerate(layout["depth_steps"])]
        round_ = functools.partial(drafter._round, prologue, depths)
        rounds.update({(batch, w, sampled): round_ for w in served})
    return rounds
