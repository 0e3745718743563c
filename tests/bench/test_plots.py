"""The report image: drawn from a small synthetic result holding every section a run writes, a valid PNG of the
size its layout gives, panels left out for the sections a run did not produce, and a benchmark run that ends with
the image's path (or, without matplotlib, with how to get it)."""

import builtins
import copy
import json
import re
import struct

import pytest

from bench import e2e as e2e_section
from bench import plots, report, run

pytestmark = pytest.mark.floor  # make test-floor: exercises a dependency at its lowest version

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk, after checking the signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def stats(median: float) -> dict:
    return {"median_ms": median, "p10_ms": 0.9 * median, "p90_ms": 1.2 * median, "min_ms": 0.8 * median, "n": 10}


def probe(first_call_s: float, hit: bool) -> dict:
    return {"first_call_s": first_call_s, "import_s": 3.0, "load_s": 0.2, "dynamo_total_s": first_call_s,
            "dynamo_s": 0.5, "backend_s": first_call_s - 0.5, "inductor_s": 0.0 if hit else first_call_s - 1.0,
            "breakdown_s": {}, "graphs": 1, "recompiles": 0, "recompile_steps": 3, "cache_counters": {},
            "fxgraph_cache_hit": int(hit), "fxgraph_cache_miss": int(not hit), "matches": {}, "cuda_graph": None,
            "probe_s": first_call_s + 4.0, "process_s": first_call_s + 4.5}


def latency(batch: int) -> dict:
    medians = {"eager": 2.0, "compiled_nopasses": 0.4, "compiled": 0.3, "compiled_call": 0.25,
               "hf_eager": 3.0, "gemm_floor": 0.05}
    return {"batch": batch, "context": 64, "max_length": 128,
            "variants": {name: stats(m * batch) for name, m in medians.items()},
            "ratios": {"speedup_vs_peer": {}, "speedup_vs_eager": {}, "x_floor": {}}, "gemms": None,
            "gemm_calls": None, "step_bytes": {"total": 100_000}, "bandwidth": None, "first_call_s": {},
            "errors": {}}


def method(tokens_per_s: float, k: int | None = 1, per_position: list[float] | None = None) -> dict:
    drafting = {"acceptance": sum(per_position) / k, "drafted": 10 * k, "accepted": 5, "rounds": 10,
                "accepted_length": 1 + sum(per_position), "acceptance_per_position": per_position,
                "per_sequence_accepted_length": 1 + sum(per_position)} if per_position else {}
    return {"k": k, "tokens_per_s": tokens_per_s, "ms_per_token": 1e3 / tokens_per_s, "new_tokens": 16,
            "seconds": 16 / tokens_per_s, "warmup_s": 0.1, "outputs_match_target": True,
            "speedup_vs_target": tokens_per_s / 50.0, "speedup_vs_hf_mtp": tokens_per_s / 30.0 if k else None,
            **drafting}


def batched_row(k: int) -> dict:
    mode = {"tokens_per_s": 100.0, "speedup_vs_target": 1.1, "accepted_length": 1.5, "vs_batch1": 0.95,
            "per_sequence_accepted_length": 1.6, "acceptance_per_position": [0.5] * k, "target_forwards": 20,
            "same_tokens": True}
    return {"lockstep": mode, "per_row": mode, "rollback": {"forward_ms": 5.0, "rollback_ms": 0.2, "share": 0.04,
                                                            "ragged_ms": 0.3, "rounds": 20, "ragged_rounds": 8}}


def e2e_record() -> dict:
    methods = {"target": method(50.0, None), "target_loop": method(55.0, None),
               "hf_mtp": method(30.0, 2, [0.5, 0.3]), "ours_eager_k1": method(45.0, 1, [0.5]),
               "ours_compiled_k1": method(60.0, 1, [0.6]), "ours_compiled_k2": method(70.0, 2, [0.6, 0.4]),
               "ours_compiled_k4": method(90.0, 4, [0.6, 0.4, 0.3, 0.2])}
    methods["target"]["outputs_match_target"] = methods["hf_mtp"]["speedup_vs_hf_mtp"] = None
    rounds = {str(k): {"one_row_ms": stats(0.3 * k), "one_row_cpu_ms": 0.3 * k, "all_rows_ms": stats(0.4 * k),
                       "all_rows_cpu_ms": 0.4 * k, "cold_compile": None} for k in (1, 2, 4)}
    rounds["4"]["cold_compile"] = {"cpu_s": 30.0, "wall_s": 31.0, "graphs": 4, "recompiles_over_64_rounds": 0,
                                   "ratio_to_first": 1.5}
    batched = {"target": {"4": 90.0, "8": 120.0}, "ks": {k: {b: batched_row(int(k)) for b in ("4", "8")}
                                                         for k in ("1", "4")},
               "rollback_vs_context": [{"context": 64, "batch": 8, "k": 4, "forward_ms": 5.0, "rollback_ms": 0.2,
                                        "share": 0.04}]}
    return {"target": "distilled tiny8", "checkpoint": "/ckpt", "prompts": 1, "prompt_len": 8, "new_tokens": 16,
            "hf_mtp_depths": 2, "methods": methods, "rounds": rounds, "batched": batched, "distill": None}


def packaged_run():
    """A ``bench.packaged.Packaged``: the package's start-up probe and two latency variants."""
    startup = {"import_torch_s": 2.1, "import_package_s": 0.2, "package_imported": [], "torch_fresh": True,
               "import_s": 2.3, "model_s": 0.2, "ready_s": 0.05, "prefill_s": 0.01, "first_draft_s": 0.01,
               "to_first_draft_s": 2.8, "process_s": 2.9, "packaged": True, "imported": [], "dynamo_graphs": 0}
    stats = {"median_ms": 0.1, "p10_ms": 0.09, "p90_ms": 0.12, "min_ms": 0.08, "n": 10}
    return {"preset": "tiny", "k": 1, "batch": 1, "context": 64, "threads": 1, "device": "cpu", "dtype": "float32",
            "torch": "2.13.0", "package": {"save_s": 20.0, "bytes": 2_000_000, "steps": {}},
            "startup": {"package": startup},
            "latency": {"batch": 1, "context": 64, "k": 1, "variants": {"packaged": stats, "compiled": stats},
                        "same_drafts": {"packaged": True}},
            "errors": {}, "ratios": {"startup_package_s": 2.8}}


def synthetic_result() -> dict:
    """Every section a run can write, with made-up figures."""
    model = {"preset": "tiny", "weights": "checkpoint", "checkpoint": "/ckpt", "device": "cpu", "dtype": "float32",
             "hidden_size": 64, "vocab_size": 512, "logits_vocab_size": 500, "intermediate_size": 128,
             "depth0": {"sliding": True, "heads": 2, "kv_heads": 2, "head_dim": 32, "window": 8, "rel_extent": 8},
             "num_depths": 2, "mtp_parameters": 100_000}
    quant = {"batch": 1, "fp32_floor_ms": 0.05,
             "schemes": {name: {"step": stats(m), "step_bytes": b, "x_fp32_floor": m / 0.05, "compile_s": 9.0}
                         for name, m, b in (("fp32", 0.06, 400_000), ("bf16", 0.04, 200_000),
                                            ("int8_depths", 0.035, 150_000), ("int8_depths_head", 0.02, 100_000))},
             "errors": {}}
    result = {
        "schema": run.SCHEMA_ID, "command": "python -m bench run --quick", "date": "2026-12-01T00:00:00+00:00",
        "wall_s": 60.0, "partial": False, "completed": ["tiny/compile", "e2e"],
        "machine": {"cpu": "test CPU", "cores": 2, "gpu": None, "torch": "2.13.0", "transformers": "5.24.0",
                    "python": "3.11.7", "threads": 1, "platform": "linux", "triton": None},
        "settings": {"configs": ["tiny"], "device": "cpu", "dtype": "float32", "batch_sizes": [1, 4], "context": 64,
                     "max_length": 128, "threads": 1, "quick": True, "skip": []},
        "configs": {"tiny": {"model": model,
                             "compile": {"batch": 1, "cold": probe(15.0, False), "warm": probe(2.5, True),
                                         "warm_cache_hit": True, "error": None},
                             "latency": {"batches": {"1": latency(1), "4": latency(4)}, "kernels": None},
                             "packaged": packaged_run(),
                             "quant": quant}},
        "e2e": e2e_record(),
        "goals": [],
    }
    result["goals"] = report.evaluate_goals(result)
    return result


ALL_PANELS = 6  # step latency, acceptance per position, tokens/s and accepted length, draft round, start-up, quant


def test_the_synthetic_result_prints_as_a_run_would():
    """Every section's table reads the made-up records (the keys a run writes) and the headline lists them."""
    table = run.format_table(synthetic_result())
    for line in ("compile (draft step, fresh process)", "latency, batch 4 (ms)", "quantized step, batch 1 (ms)",
                 "start-up package", "end to end K = 4, tok/s", "end to end (distilled tiny8",
                 "draft rounds at batch 1", "left-padded batches", "rollback outside the loop", "tiny draft step, ms"):
        assert line in table, line


def test_report_is_a_png_of_the_layouts_size(tmp_path):
    drawn = plots.draw_report(synthetic_result(), tmp_path / "out" / "report.png")
    assert drawn.path == tmp_path / "out" / "report.png" and drawn.left_out == []
    assert len(drawn.panels) == ALL_PANELS
    assert png_size(drawn.path) == plots.figure_size(ALL_PANELS) == (1400, 3 * 450 + 100)  # 2 columns, 3 rows
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["report.png"]  # no temporary file left


def test_a_section_the_run_did_not_produce_leaves_its_panel_out(tmp_path):
    result = synthetic_result()
    result["e2e"]["rounds"] = {}  # the default run: no draft rounds
    del result["configs"]["tiny"]["quant"]
    drawn = plots.draw_report(result, tmp_path / "report.png")
    assert drawn.left_out == ["draft-round latency against K (e2e, --full)", "quantized step (quant)"]
    assert len(drawn.panels) == ALL_PANELS - 2
    assert "acceptance per draft position (e2e, batch 1)" in drawn.panels
    assert png_size(drawn.path) == plots.figure_size(ALL_PANELS - 2) == (1400, 2 * 450 + 100)


SKIPPED, FAILED = None, {"error": "RuntimeError: boom"}


def _with(result: dict, changes: dict) -> dict:
    """A copy of ``result`` with the value at each dotted path replaced."""
    result = copy.deepcopy(result)
    for path, value in changes.items():
        *parents, key = path.split(".")
        node = result
        for p in parents:
            node = node[p]
        node[key] = value
    return result


@pytest.mark.parametrize("changes, left_out, panels", [
    ({"e2e.rounds": {}}, ["draft-round latency against K (e2e, --full)"], ALL_PANELS - 1),
    ({"e2e": FAILED}, ["acceptance per position (e2e)", "tokens/s and accepted length against K (e2e)",
                       "draft-round latency against K (e2e, --full)"], ALL_PANELS - 3),
    ({"configs.tiny.compile": SKIPPED, "configs.tiny.packaged": SKIPPED}, ["start-up (compile, packaged)"],
     ALL_PANELS - 1),
    ({"configs.tiny.quant": FAILED}, ["quantized step (quant)"], ALL_PANELS - 1),
    ({"configs.tiny.latency": {}}, ["step latency (latency)"], ALL_PANELS - 1),
])
def test_each_missing_or_failed_section_loses_exactly_its_panels(changes, left_out, panels):
    result = _with(synthetic_result(), changes)
    drawn, missing = plots.plan(result)
    assert missing == left_out and len(drawn) == panels


def test_nothing_measured_writes_no_file(tmp_path):
    result = _with(synthetic_result(), {"e2e": SKIPPED, "configs": {}})
    drawn = plots.draw_report(result, tmp_path / "report.png")
    assert drawn.path is None and drawn.panels == [] and list(tmp_path.iterdir()) == []
    assert plots.report_line(result, tmp_path / "r.json") == ("report: nothing to draw (no section of this run "
                                                              "produced a figure)")


def test_the_k_panels_draw_ours_compiled_eager_and_transformers_by_k():
    lines = plots.by_method(synthetic_result()["e2e"])
    assert {line: [m["k"] for m in ms] for line, ms in lines.items()} == {
        "ours": [1, 2, 4], "ours, eager drafter": [1], "transformers generate(use_mtp=True)": [2]}
    assert lines["ours"][2]["acceptance_per_position"] == [0.6, 0.4, 0.3, 0.2]
    assert plots.by_method(None) == {} and plots.by_method(FAILED) == {}


def test_the_vllm_reference_is_self_consistent():
    """Mean accepted length = 1 + the sum of the per-position acceptance (docs/protocol.md §6.8)."""
    for k, per_position in plots.VLLM_ACCEPTANCE.items():
        assert len(per_position) == k
        assert round(1 + sum(per_position) / 100, 2) == plots.VLLM_MEAN_ACCEPTED_LENGTH[k]


def _hide_matplotlib(monkeypatch):
    real_import = builtins.__import__

    def without_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_matplotlib)


@pytest.mark.parametrize("has_matplotlib", [True, False])
def test_the_benchmark_ends_with_the_reports_path_or_how_to_get_it(has_matplotlib, tmp_path, monkeypatch, capsys):
    e2e = synthetic_result()["e2e"]
    e2e["rounds"] = {}
    monkeypatch.setattr(e2e_section, "measure", lambda ctx: e2e)
    if not has_matplotlib:
        _hide_matplotlib(monkeypatch)
    json_path = tmp_path / "result.json"
    run.run(["--only", "e2e", "--json", str(json_path)])
    last = capsys.readouterr().out.splitlines()[-1]
    if has_matplotlib:
        assert last == f"report: {tmp_path / 'result.png'}"
        assert png_size(tmp_path / "result.png") == plots.figure_size(2)  # acceptance, tokens/s and accepted length
    else:
        assert last == plots.MISSING_HINT.format(json=json_path)
        assert "pip install -e '.[plots]'" in last and f"python -m bench report {json_path}" in last
        assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_report_command_redraws_a_saved_result(tmp_path, capsys):
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(synthetic_result()))
    assert run.main(["report", str(saved), "--out", str(tmp_path / "again.png")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{saved}: complete") and out.endswith(f"{tmp_path / 'again.png'}\n")
    assert png_size(tmp_path / "again.png") == plots.figure_size(ALL_PANELS)


def report_(path, *args):
    return run.main(["report", str(path), *args])


def assert_refused(capsys, pattern: str, path, *args) -> None:
    """``python -m bench report`` refuses with one line that matches ``pattern``, exit status 2."""
    assert report_(path, *args) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m bench report: error: "), lines
    assert re.search(pattern, lines[0]), lines[0]


def test_report_command_names_what_is_wrong(tmp_path, monkeypatch, capsys):
    assert_refused(capsys, "no-such.json: no such file", tmp_path / "no-such.json")
    (tmp_path / "garbled.json").write_text("{")
    assert_refused(capsys, "garbled.json: not a readable JSON file", tmp_path / "garbled.json")
    old = synthetic_result()
    old["schema"] = "inkling-bench/1"
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert_refused(capsys, r"not a `python -m bench run` result of schema .* 'inkling-bench/1'", tmp_path / "old.json")
    edited = synthetic_result()
    del edited["configs"]["tiny"]["latency"]["batches"]
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    assert_refused(capsys, r"edited.json does not hold what a `python -m bench run` of schema inkling-bench/\d+ "
                   r"writes \(edited\?\): KeyError 'batches'", tmp_path / "edited.json")
    huge = synthetic_result()
    huge["wall_s"] = 10**400  # JSON's integers have no bound; a float of it has
    (tmp_path / "edited.json").write_text(json.dumps(huge))
    assert_refused(capsys, r"edited.json does not hold what .* \(edited\?\): OverflowError", tmp_path / "edited.json")
    (tmp_path / "good.json").write_text(json.dumps(synthetic_result()))
    assert_refused(capsys, r"cannot write .*good.json/report.png: .*; choose another place with --out",
                   tmp_path / "good.json", "--out", str(tmp_path / "good.json" / "report.png"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edited.json", "garbled.json", "good.json", "old.json"]
    _hide_matplotlib(monkeypatch)
    assert_refused(capsys, r"matplotlib is not installed.*pip install -e '\.\[plots\]'", tmp_path / "good.json")
    assert not (tmp_path / "good.png").exists()
