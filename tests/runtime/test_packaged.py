"""Packaged drafter rounds (torch.export + AOTInductor, docs/compile.md §12): the same drafts, hiddens and caches as
the eager drafter for K = 1 and K = 3 over 64 rounds and every accepted count, no Dynamo at call time, no weights
in the package, one step per depth geometry, clear errors for a mismatched, missing or damaged package (gpu marker:
CUDA graphs).

Two packages are built per module and reused, on a 3-depth model (sliding, full, sliding): K = 1 with the two decode
buckets (one and two rows: two AOTInductor compiles), and K = 3 with one bucket of four rows that every window of a
round falls in (``graph_rows=(4,)``: the prologue and one step per geometry, three compiles)."""

import json
import re
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from inkling_compiled.arguments import ArgumentError
from inkling_compiled.runtime import Drafter, PackageError, PackageMismatch, packaged
from inkling_compiled.testing.kernel_stats import aoti_package_sources, aoti_package_stats
from tests.helpers import random_mtp, tiny_text_config

pytestmark = pytest.mark.slow  # AOTInductor compiles shared by the module: minutes on 2 cores; CI runs them

BATCH, MAX_LENGTH, VOCAB, H = 2, 192, 250, 64
DEPTHS = dict(num_mtp_layers=3, mtp_local_layer_ids=[0, 2])  # depth 1 full attention, depths 0 and 2 sliding
ROUNDS = 64
KERNEL_DEFINITION = re.compile(r'extern "C"\s+void\s+(cpp_fused_\w+)\(')
SETUPS = {1: dict(graph_rows=None, rows=(1, 2)), 3: dict(graph_rows=(4,), rows=(4,))}


def tiny_mtp(seed=0, dtype=torch.float32, **overrides):
    model = random_mtp(tiny_text_config(**{**DEPTHS, **overrides}), seed=seed, dtype=dtype)
    model.lm_head_weight.mul_(30.0)  # peaked logits: drafts are not near-ties, so a wrong input changes them
    return model


def windows(k, rounds=ROUNDS):
    """New rows per round: a + 1 after a verification that accepted a of K drafts, a = 0..K in turn."""
    return [1 + i % (k + 1) for i in range(rounds)]


def decode(drafter, rows_per_round, temperature=0.0, seed=0, device="cpu"):
    """Round after round from position 0 over one fixed stream of committed rows, positions moving by 1..K+1
    (random tokens rather than accepted drafts: unchecked, as the loop calls, so that no validated call widens)."""
    length = sum(rows_per_round)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, length), generator=gen).to(device)
    hidden = torch.randn(BATCH, length, H, generator=gen).to(device=device, dtype=drafter.model.dtype)
    positions = torch.arange(length, device=device)[None].expand(BATCH, length).contiguous()
    sampler = torch.Generator(device=device).manual_seed(seed)
    results, start = [], 0
    for rows in rows_per_round:
        window = slice(start, start + rows)
        results.append(drafter.draft(ids[:, window], positions[:, window], hidden[:, window],
                                     temperature=temperature, generator=sampler, validate=start == 0))
        start += rows
    return results


def assert_same_drafts(results, expected):
    for got, want in zip(results, expected, strict=True):
        assert torch.equal(got.drafts, want.drafts)
        assert (got.hidden - want.hidden).abs().max() <= 1e-5


def assert_same_state(drafter, reference):
    """Every depth's cache, and with K > 1 the committed rows, equal the reference drafter's (the scratch slot
    included: padding rows of a sliding depth write NaN there in both)."""
    for theirs, ours in zip(reference.cache.depths, drafter.cache.depths, strict=True):
        for a, b in zip(theirs.tensors(), ours.tensors()):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0, equal_nan=True)
    if reference.history is not None:
        assert torch.equal(reference.history.positions, drafter.history.positions)
        assert torch.equal(reference.history.input_ids, drafter.history.input_ids)
        assert (reference.history.hidden - drafter.history.hidden).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def model():
    return tiny_mtp()


@pytest.fixture(scope="module")
def eager(model):
    """The eager drafter of each K: what the packages must draft (the compiled drafter against it:
    tests/runtime/test_drafter.py, test_drafter_depths.py)."""
    return {k: Drafter(model, BATCH, MAX_LENGTH, num_speculative_tokens=k, graph_rows=setup["graph_rows"],
                       compile=False) for k, setup in SETUPS.items()}


@pytest.fixture(scope="module")
def packages(eager, tmp_path_factory):
    root = tmp_path_factory.mktemp("packaged")
    return {k: eager[k].save_compiled(root / f"k{k}", batch_sizes=(BATCH,), rows=SETUPS[k]["rows"])
            for k in SETUPS}


@pytest.fixture
def copied(packages, tmp_path):
    """A copy of the K = 1 package, to damage or edit."""
    return shutil.copytree(packages[1], tmp_path / "copy")


def read_manifest(directory):
    return json.loads((directory / packaged.MANIFEST).read_text())


def edit_manifest(directory, edit):
    manifest = read_manifest(directory)
    edit(manifest)
    (directory / packaged.MANIFEST).write_text(json.dumps(manifest))
    return directory


@torch.no_grad()
@pytest.mark.parametrize("k", sorted(SETUPS))
def test_packaged_rounds_equal_the_eager_drafter_over_64_rounds_and_every_accepted_count(model, eager, packages, k):
    expected = decode(eager[k], windows(k))
    loaded = Drafter.load_compiled(packages[k], model)
    assert loaded.num_speculative_tokens == k
    assert loaded.packaged_buckets == tuple((BATCH, rows, False) for rows in SETUPS[k]["rows"])
    graphs = counters["stats"]["unique_graphs"]
    results = decode(loaded, windows(k))
    assert counters["stats"]["unique_graphs"] == graphs  # no Dynamo at call time ...
    assert "_depth_step" not in vars(loaded) and "_window_step" not in vars(loaded)  # ... nor a torch.compile wrapper
    assert_same_drafts(results, expected)
    assert all(result.drafts.shape == (BATCH, k) for result in results)
    assert_same_state(loaded, eager[k])


@torch.no_grad()
def test_loaded_with_compile_false_nothing_compiles_the_prefill_included(model, eager, packages):
    """A package holds the decode windows; the prompt's prefill (8 rows here) is another bucket, which
    ``compile=False`` runs eager, so that a process loading a package never compiles (docs/usage.md)."""
    rows = [8, *windows(1, 16)]
    expected = decode(eager[1], rows)
    loaded = Drafter.load_compiled(packages[1], model, compile=False)
    graphs = counters["stats"]["unique_graphs"]
    assert_same_drafts(decode(loaded, rows), expected)
    assert counters["stats"]["unique_graphs"] == graphs
    assert loaded.packaged_buckets == tuple((BATCH, r, False) for r in SETUPS[1]["rows"])


def test_one_step_per_depth_geometry_serves_every_depth_of_it(packages):
    manifest = read_manifest(packages[3])
    assert manifest["layout"]["depth_steps"] == [0, 1, 0]  # depth 2 runs depth 0's step (both sliding)
    assert sorted(manifest["steps"]) == ["b2-r4-greedy-depth0", "b2-r4-greedy-depth1", "b2-r4-greedy-window"]
    window = manifest["steps"]["b2-r4-greedy-window"]
    assert sorted(window["constants"]) == ["history.hidden", "history.input_ids", "history.positions"]
    depth = manifest["steps"]["b2-r4-greedy-depth0"]["constants"]
    assert {name.split(".")[0] for name in depth} == {"layer", "shared", "cache"}
    assert "shared.lm_head_weight" in depth and "layer.input_proj.weight" in depth and "cache.k" in depth


def test_packaged_compile_ran_our_passes_and_its_code_holds_the_addmm_and_one_fused_input_kernel(packages):
    for directory in packages.values():
        for name, step in read_manifest(directory)["steps"].items():
            if name.endswith("window"):
                continue
            assert step["matches"]["fuse_draft_input_embed"] == 1 and step["matches"]["fold_mup_scale"] == 1, name
            code = aoti_package_sources(directory / step["file"])
            kernels = sorted(set(KERNEL_DEFINITION.findall(code["kernel"])))
            stats = aoti_package_stats(directory / step["file"])
            assert stats.extern_calls.count("addmm") == 1  # the muP head: one GEMM, its scale folded in
            assert stats.cpp_kernels == len(kernels)
            inputs = [k for k in kernels if "embedding" in k]
            assert len(inputs) == 1 and "where" in inputs[0]  # gather + norms + concat: one kernel
            assert not [k for k in kernels if "_cat_" in k]


@torch.no_grad()
def test_the_package_holds_no_weights_and_serves_another_checkpoint_of_the_config(packages):
    other = tiny_mtp(seed=1)
    for step in packages[3].glob("*.pt2"):
        data = step.read_bytes()
        for m in (other, tiny_mtp()):
            assert m.lm_head_weight[0, :8].numpy().tobytes() not in data
            assert m.layers[2].input_proj.weight[0, :8].numpy().tobytes() not in data
    scale = [m.layers[2].transformer_block.mlp.global_scale for m in (other, tiny_mtp())]
    assert scale[0] != scale[1]  # a 1-element parameter too: Inductor would otherwise inline it by value
    eager = Drafter(other, BATCH, MAX_LENGTH, num_speculative_tokens=3, graph_rows=(4,), compile=False)
    expected = decode(eager, windows(3, 8))
    loaded = Drafter.load_compiled(packages[3], other, compile=False)
    assert_same_drafts(decode(loaded, windows(3, 8)), expected)
    assert_same_state(loaded, eager)


@pytest.mark.parametrize("make, field, named", [
    (lambda: tiny_mtp(intermediate_size=128), "config", "intermediate_size 96 vs 128"),
    (lambda: tiny_mtp(dtype=torch.bfloat16), "dtype", "'torch.float32' vs 'torch.bfloat16'"),
])
def test_a_package_for_another_config_or_dtype_is_refused_naming_what_differs(packages, make, field, named):
    with pytest.raises(PackageMismatch, match="built for another setup") as raised:
        Drafter.load_compiled(packages[1], make())
    assert raised.value.fields == (field,) and named in str(raised.value)


def test_a_package_for_another_k_is_refused_naming_it(model, packages):
    with pytest.raises(PackageMismatch, match="num_speculative_tokens 3 vs 2 here") as raised:
        Drafter.load_compiled(packages[3], model, num_speculative_tokens=2)
    assert raised.value.fields == ("num_speculative_tokens",)
    with pytest.raises(ArgumentError, match=r"num_speculative_tokens must be an int in \[1, 3\]"):
        Drafter.load_compiled(packages[3], model, num_speculative_tokens=4)


# "cpu ZVECTOR" is s390x's vector ISA: never the one of the x86 machine running this (AVX512 and AVX2 both are)
def test_a_package_of_more_depths_than_the_model_loaded_is_named_as_the_packages_k(packages):
    shallow = tiny_mtp(num_mtp_layers=1, mtp_local_layer_ids=[0])
    for fallback in (False, True):
        with pytest.raises(ArgumentError, match=r"the package .* drafts K = 3, but the model has 1 loaded MTP depth"):
            Drafter.load_compiled(packages[3], shallow, fallback=fallback)


@pytest.mark.parametrize("field, recorded", [("torch", "2.11.0"), ("device", "cpu ZVECTOR"), ("passes", None)])
def test_a_package_recorded_for_another_torch_device_or_pass_version_is_refused(model, copied, field, recorded):
    directory = edit_manifest(copied, lambda m: m["built_for"].update({field: recorded}))
    with pytest.raises(PackageMismatch) as raised:
        Drafter.load_compiled(directory, model)
    here = packaged.built_for(model, {}, 1)[field]
    assert raised.value.fields == (field,) and f"{field} {recorded!r} vs {here!r} here" in str(raised.value)


@torch.no_grad()
def test_fallback_warns_and_drafts_with_the_usual_step(model, copied):
    directory = edit_manifest(copied, lambda m: m["built_for"].update(torch="2.11.0"))
    with pytest.warns(RuntimeWarning, match="torch '2.11.0'") as warned:
        drafter = Drafter.load_compiled(directory, model, fallback=True, compile=False)
    assert "fallback=True" not in str(warned[0].message)  # the hint of the error, to a caller who passed it
    assert drafter.packaged_buckets == () and (drafter.max_batch_size, drafter.max_length) == (BATCH, MAX_LENGTH)
    reference = Drafter(model, BATCH, MAX_LENGTH, compile=False, num_speculative_tokens=1)  # the package's K
    assert_same_drafts(decode(drafter, [1, 2]), decode(reference, [1, 2]))


def test_a_missing_or_damaged_package_is_a_clear_error(model, copied, tmp_path):
    with pytest.raises(PackageError, match="not a directory"):
        Drafter.load_compiled(tmp_path / "nowhere", model)
    with pytest.raises(PackageError, match="holds no manifest.json"):
        Drafter.load_compiled(tmp_path, model)
    step = next(copied.glob("*.pt2"))
    data = bytearray(step.read_bytes())
    data[len(data) // 2] ^= 0xFF
    step.write_bytes(bytes(data))
    with pytest.raises(PackageError, match=f"{step.name} is corrupt"):
        Drafter.load_compiled(copied, model)
    step.unlink()
    with pytest.raises(PackageError, match=f"{step.name} is missing"):
        Drafter.load_compiled(copied, model)
    (copied / packaged.MANIFEST).write_text("{not json")
    with pytest.raises(PackageError, match="manifest.json is unreadable"):
        Drafter.load_compiled(copied, model)


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.update(format="other/9"), "not a package manifest of format"),
    (lambda m: m.pop("steps"), "'steps' must be an object"),
    (lambda m: m["layout"].pop("buckets"), "layout lacks 'buckets'"),
    (lambda m: m["steps"].pop("b2-r2-greedy-depth0"), "the manifest has no step 'b2-r2-greedy-depth0'"),
    # checked before the drafter allocates the cache the layout asks for (2**40 positions: terabytes)
    (lambda m: m["layout"].update(max_length=64), r"its layout has max_batch_size 2 and max_length 64, but step "
                                                  r"'b2-r1-greedy-depth0' was exported for a cache of \[batch, "
                                                  r"max_length \+ 1\] \[2, 193\]"),
    (lambda m: m["layout"].update(max_length=2**40), "max_length 1099511627776, but step"),
    (lambda m: m["layout"].update(max_batch_size=3), "its layout has max_batch_size 3 and max_length 192"),
])
def test_a_damaged_manifest_is_a_clear_error(model, copied, edit, match):
    with pytest.raises(PackageError, match=match):
        Drafter.load_compiled(edit_manifest(copied, edit), model)


def every_step(**values):
    return lambda manifest: [record.update(values) for record in manifest["steps"].values()]


@pytest.mark.parametrize("edit, named", [
    (lambda m: m["layout"].update(buckets=5), "layout.buckets must be a non-empty list of [batch, rows, sampled], "
                                              "got 5"),
    (lambda m: m["layout"].update(buckets=[1]), "layout.buckets must be a non-empty list of [batch, rows, sampled], "
                                                "got [1]"),
    (lambda m: m["layout"].update(buckets=None), "layout.buckets must be a non-empty list of [batch, rows, sampled], "
                                                 "got None"),
    (lambda m: m["layout"].update(buckets=[[1]]), "layout.buckets must be a non-empty list of [batch, rows, "
                                                  "sampled], got [[1]]"),
    (lambda m: m["layout"].update(buckets="abc"), "layout.buckets must be a non-empty list of [batch, rows, "
                                                  "sampled], got 'abc'"),
    (lambda m: m["layout"].update(depth_steps=[]), "layout.depth_steps must be a non-empty list of ints >= 0, got []"),
    (lambda m: m["layout"].update(depth_steps=0), "layout.depth_steps must be a non-empty list of ints >= 0, got 0"),
    (lambda m: m["layout"].update(depth_steps=[1]), "layout.depth_steps [1] are not this model's [0]"),
    (lambda m: m["layout"].update(rows="x"), "layout.rows must be null or [lowest, highest] ints >= 1, got 'x'"),
    (lambda m: m["layout"].update(max_batch_size="2"), "layout.max_batch_size must be an int >= 1, got '2'"),
    (lambda m: m["built_for"].update(num_speculative_tokens="1"),
     "built_for.num_speculative_tokens must be an int >= 1, got '1'"),
    (every_step(file=3), "steps['b2-r1-greedy-depth0'].file must be the name of a file in the package, got 3"),
    (every_step(file="../b2-r1-greedy-depth0.pt2"), "steps['b2-r1-greedy-depth0'].file must be the name of a file "
                                                    "in the package, got '../b2-r1-greedy-depth0.pt2'"),
    (every_step(constants=[]), "steps['b2-r1-greedy-depth0'].constants must be an object, got []"),
])
def test_a_manifest_field_of_the_wrong_type_or_shape_is_a_package_error_naming_it_and_its_value(model, copied, edit,
                                                                                                  named):
    """Each was a TypeError, ValueError, IndexError or AttributeError inside loading (or an ArgumentError about an
    argument the caller never gave)."""
    with pytest.raises(PackageError, match=re.escape(named)):
        Drafter.load_compiled(edit_manifest(copied, edit), model)


def test_a_layout_serving_widths_its_steps_were_not_exported_for_is_refused(model, copied):
    """The K = 1 package's steps take one width each (1 and 2 rows); a layout claiming a range made the width-1 step
    run on 2- and 4-row windows and draft wrong tokens, with no error."""
    directory = edit_manifest(copied, lambda m: m["layout"].update(rows=[1, 5]))
    with pytest.raises(PackageError, match=re.escape("its layout has step 'b2-r1-greedy-depth0' run 2 sequences of "
                                                     "[1, 2, 4] rows, but the manifest records it exported for "
                                                     "[batch, rows] of [[2, 1], [2, 1], [2, 1]]")):
        Drafter.load_compiled(directory, model)


@torch.no_grad()
def test_a_packaged_drafter_refuses_to_draft_once_the_model_is_quantized(tmp_path):
    """quantize_ swaps the depth linears, and the packaged round kept reading the old ones: the old weights' drafts.
    A bfloat16 package of one bucket (int8 runs on bfloat16 models only): one AOTInductor compile."""
    model = tiny_mtp(dtype=torch.bfloat16)
    saver = Drafter(model, 1, MAX_LENGTH, num_speculative_tokens=1, compile=False)
    directory = saver.save_compiled(tmp_path / "bf16", batch_sizes=(1,), rows=(1,))
    loaded = Drafter.load_compiled(directory, model, compile=False)
    assert loaded.packaged_buckets == ((1, 1, False),)
    model.quantize_("int8")
    with pytest.raises(ValueError, match="quantization is now int8 head=True, but this Drafter was built for it with "
                                         "none: .* build a new Drafter after quantizing the model"):
        loaded.draft(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                     torch.zeros(1, 1, H, dtype=torch.bfloat16))


@torch.no_grad()
def test_a_packaged_drafter_refuses_a_model_whose_parameters_were_replaced(packages):
    """load_state_dict(assign=True) swaps the Parameters, which the packaged round reads by address: it kept drafting
    with the old ones. An in-place load (the default) is seen, and is not refused."""
    model = tiny_mtp()
    loaded = Drafter.load_compiled(packages[1], model, compile=False)
    rows = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, H))
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    model.load_state_dict(state)
    loaded.draft(*rows)
    model.load_state_dict(state, assign=True)
    with pytest.raises(ValueError, match=r"the model's parameters were replaced \(load_state_dict\(assign=True\), "
                                         r"say\) after this Drafter was built"):
        loaded.draft(*rows)


def test_save_under_a_file_is_an_argument_error_and_a_failed_write_a_package_error(eager, tmp_path, monkeypatch):
    """They were a FileExistsError naming the file in the way, and an OSError naming the temporary directory."""
    (tmp_path / "file").write_text("")
    with pytest.raises(ArgumentError, match=re.escape(f"directory '{tmp_path / 'file' / 'x'}' cannot be created: "
                                                      f"'{tmp_path / 'file'}' on its path is a file")):
        eager[1].save_compiled(tmp_path / "file" / "x")

    def fail(step, inputs, state, path, options, dynamic_shapes):
        raise PermissionError(13, "Permission denied", str(path))  # what a read-only directory's write raises

    monkeypatch.setattr(packaged, "_package", fail)
    with pytest.raises(PackageError, match=re.escape(f"the package {tmp_path / 'new'} could not be written: "
                                                     "[Errno 13] Permission denied")):
        eager[1].save_compiled(tmp_path / "new")
    assert [path.name for path in tmp_path.iterdir()] == ["file"]


def test_save_refuses_an_existing_directory_and_leaves_nothing_when_it_fails(eager, packages, tmp_path,
                                                                               monkeypatch):
    with pytest.raises(PackageError, match="already exists"):
        eager[1].save_compiled(packages[1])

    def fail(step, inputs, state, path, options, dynamic_shapes):
        path.write_bytes(b"half a package")
        raise RuntimeError("compiler crashed")

    monkeypatch.setattr(packaged, "_package", fail)
    with pytest.raises(RuntimeError, match="compiler crashed"):
        eager[1].save_compiled(tmp_path / "new")
    assert list(tmp_path.iterdir()) == []

    def another_writer_first(step, inputs, state, path, options, dynamic_shapes):  # during a minutes-long compile
        shutil.copytree(packages[1], tmp_path / "new", dirs_exist_ok=True)
        return {}

    monkeypatch.setattr(packaged, "_package", another_writer_first)
    with pytest.raises(PackageError, match=r"new appeared while this package was compiled: packages are not "
                                           "overwritten, and this one was discarded"):
        eager[1].save_compiled(tmp_path / "new")
    assert [p.name for p in tmp_path.iterdir()] == ["new"]  # theirs, whole; no temporary of ours beside it


@pytest.mark.parametrize("link_to", ["missing", "empty"])
def test_save_refuses_a_symbolic_link_before_compiling(eager, tmp_path, link_to):
    (tmp_path / "empty").mkdir()
    (tmp_path / "p").symlink_to(tmp_path / link_to)
    with pytest.raises(PackageError, match="p is a symbolic link: a package is written as a new directory"):
        eager[1].save_compiled(tmp_path / "p")


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_sizes=(3,)), r"batch_sizes must be at most the drafter's max_batch_size 2, got \(3,\)"),
    (dict(rows=(0,)), "each of rows must be an int >= 1"),
    (dict(sampled=1), "sampled must be a bool"),
    (dict(batch_sizes=()), r"batch_sizes must name at least one size, got \(\)"),  # was an empty package
    (dict(rows=[]), r"rows must name at least one size, got \(\)"),
    (dict(rows=(1, MAX_LENGTH + 1)), rf"rows must be at most the drafter's max_length {MAX_LENGTH}, got \(1, "),
])
def test_save_compiled_arguments_are_checked(eager, tmp_path, kwargs, match):
    with pytest.raises(ArgumentError, match=match):
        eager[1].save_compiled(tmp_path / "p", **kwargs)
    assert not (tmp_path / "p").exists()


def test_a_quantized_drafter_with_frozen_weights_is_not_packaged(tmp_path):
    model = tiny_mtp(dtype=torch.bfloat16).quantize_("int8")
    with pytest.raises(ValueError, match="compiles with Inductor freezing"):
        Drafter(model, BATCH, MAX_LENGTH).save_compiled(tmp_path / "p")
    assert not (tmp_path / "p").exists()


def test_a_step_reading_a_tensor_outside_its_state_is_not_packaged(model, eager, tmp_path):
    stray = torch.ones(H)
    state = packaged.depth_state(model, model.layers[0], eager[1].cache.depths[0])
    with pytest.raises(PackageError, match="reads tensors outside its state"):
        packaged.save(tmp_path / "p", {"step": (lambda x: (model.compute_logits(x * stray),), (torch.zeros(2, H),),
                                                state)}, built_for={}, layout={}, inductor_options={})
    assert not (tmp_path / "p").exists()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@torch.no_grad()
def test_packaged_rounds_replay_as_graphs_on_cuda_like_the_compiled_ones(tmp_path):
    """K = 3, greedy and sampled, fp32 so that the two compiles agree to rounding (a bf16 near-tie could flip a
    token): the whole packaged round (prologue and every depth's step) is captured as one CUDA graph."""
    model = tiny_mtp().cuda()
    graphs = Drafter(model, BATCH, MAX_LENGTH, num_speculative_tokens=3, cuda_graphs=True, graph_rows=(4,))
    directory = graphs.save_compiled(tmp_path / "cuda", rows=(4,), batch_sizes=(BATCH,), sampled=True)
    manifest = read_manifest(directory)
    assert all(step["matches"]["fold_mup_scale"] == 1 for name, step in manifest["steps"].items()
               if not name.endswith("window"))
    loaded = Drafter.load_compiled(directory, model)
    assert loaded.packaged_buckets == ((BATCH, 4, False), (BATCH, 4, True))
    for temperature in (0.0, 0.8):
        expected = decode(graphs, windows(3, 16), temperature, device="cuda")
        results = decode(loaded, windows(3, 16), temperature, device="cuda")
        assert_same_drafts(results, expected)
        for got, want in zip(results, expected):
            assert (got.draft_probs is None) == (temperature == 0)
            assert got.draft_probs is None or (got.draft_probs - want.draft_probs).abs().max() <= 1e-5
        assert loaded._shapes[(BATCH, 4, temperature > 0)].graph is not None  # captured, then replayed
    assert_same_state(loaded, graphs)
