"""A minimal ``python -m bench run`` (quick, tiny, one section in process) writes its JSON after every section in the
shape of the section's dataclasses, prints the table with every goal, and appends to a results file only when
asked; the command line refuses bad options by name."""

import dataclasses
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from bench import e2e, harness, report, run, step, tp
from bench.probes import split_compile_times
from inkling_compiled.runtime import round_cache


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    json_path = out / "result.json"
    on_disk_before_e2e = {}

    def failing_e2e(ctx):  # stands in for the last section: what is on disk now is what a kill would leave
        on_disk_before_e2e.update(json.loads(json_path.read_text()))
        raise RuntimeError("no e2e in this test")

    argv = ["--quick", "--full", "--only", "latency,e2e", "--skip", "stock", "--threads", "1", "--json",
            str(json_path), "--record", str(out / "RESULTS.md")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(e2e, "measure", failing_e2e)
        result = run.run(argv)
    yield result, out, on_disk_before_e2e
    torch._dynamo.reset()  # drop the compiled step so later tests start from a clean Dynamo cache


def names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_json_holds_each_section_as_its_dataclass_after_every_section(quick):
    result, out, partial = quick
    on_disk = json.loads((out / "result.json").read_text())
    assert on_disk["schema"] == run.SCHEMA_ID and on_disk["partial"] is False
    assert on_disk["completed"] == ["tiny/latency", "e2e"]
    assert on_disk["e2e"] == {"error": "RuntimeError: no e2e in this test"}  # a failed section is recorded
    assert partial["partial"] is True and partial["completed"] == ["tiny/latency"]
    assert partial["configs"] == on_disk["configs"]
    latency = on_disk["configs"]["tiny"]["latency"]
    assert set(latency) == names(step.Latency) and set(latency["batches"]["1"]) == names(step.StepLatency)
    lat = latency["batches"]["1"]
    assert {"eager", "compiled", "compiled_call", "hf_eager", "gemm_floor"} == set(lat["variants"])
    assert all(set(v) == names(harness.Stats) for v in lat["variants"].values())
    assert lat["ratios"]["speedup_vs_peer"]["compiled"] > 0
    assert lat["ratios"]["x_floor"]["eager"] > 1  # the step is slower than its GEMMs alone
    assert lat["gemm_calls"] == sum(g["count"] for g in lat["gemms"]) > 0
    kernels = latency["kernels"]
    assert "no_passes" not in kernels  # stock skipped
    assert kernels["passes"]["kernels"] > 0 and kernels["passes"]["extern_calls"] > 0
    assert kernels["passes"]["launches"] == kernels["passes"]["kernel_launches"] + kernels["passes"]["extern_calls"]
    assert sum(kernels["matches_passes"].values()) >= 1  # our passes fired on the real step
    assert set(on_disk["configs"]["tiny"]) == {"model", "latency"}  # compile not asked; quant opt-in on tiny


def test_goals_are_printed_with_values_or_na(quick):
    result, _, _ = quick
    assert [g["id"] for g in result["goals"]] == [g.id for g in report.GOALS]
    vs_peer = result["goals"][0]
    assert vs_peer["id"] == "cpu_tiny_vs_transformers" and vs_peer["value"] > 0 and vs_peer["met"] in (True, False)
    assert all(g["met"] is None and g["note"].startswith("needs ") for g in result["goals"][1:])
    table = run.format_table(result)
    assert "goals (targets, not asserts)" in table and "tiny draft step, ms (compiled)" in table
    assert all(g["text"] in table for g in result["goals"])


def test_one_time_builds_are_counted_apart_from_the_measurement(quick, tmp_path, monkeypatch):
    assert quick[0]["one_time_s"] == {}  # nothing built once in that run
    assert report.wall_line(quick[0]) == f"wall time {quick[0]['wall_s']:.0f} s"
    monkeypatch.setenv(round_cache.ENV_VAR, str(tmp_path / "rounds"))
    log = logging.getLogger(round_cache.__name__)
    with harness.ONE_TIME.recording() as built:
        log.info("packaged", extra={"build_s": 90.0, "directory": str(tmp_path / "rounds" / "entry")})
        log.info("packaged", extra={"build_s": 5.0, "directory": str(tmp_path / "elsewhere")})  # a section's own
        built.add("the text target", 30.0)
    assert built.seconds["packaged K-depth rounds"] == 90.0
    assert set(built.seconds) == {"packaged K-depth rounds", "the text target"}
    assert log.handlers == [] and log.level == logging.NOTSET  # left as it was
    line = report.wall_line({"wall_s": 200.0, "one_time_s": {"packaged K-depth rounds": 90.0, "text target": 30.0}})
    assert line.startswith("wall time 200 s: measuring 80 s, one-time builds 120 s (packaged K-depth rounds 90 s")
    line = report.wall_line({"wall_s": 200.0, "one_time_s": {"waiting for the second process": 20.0},
                             "one_time_beside_s": 150.0})
    assert line == ("wall time 200 s: measuring 180 s, one-time builds 20 s (waiting for the second process 20 s; "
                    "and 150 s in a second process beside the measuring; cached: later runs skip them)")
    line = report.wall_line({"wall_s": 200.0, "one_time_s": {"waiting for the second process": 0.1},
                             "one_time_beside_s": 150.0})  # built beside, never waited for
    assert line == ("wall time 200 s: measuring 200 s, one-time builds 0 s (and 150 s in a second process beside the "
                    "measuring; cached: later runs skip them)")


def test_record_appends_an_entry(quick):
    result, out, _ = quick
    text = (out / "RESULTS.md").read_text()
    assert result["command"] in text and result["machine"]["torch"] in text and result["date"] in text


def test_the_default_run_is_the_headline_and_full_runs_every_part(tmp_path):
    default, full = run.parse_args([]), run.parse_args(["--full"])
    assert default.record is None and default.json_path.parent == run.OUT_DIR
    assert default.max_length == default.context + 64 and default.tp_world_sizes == (1, 2)
    only = run.parse_args(["--only", "tp,quant"])  # named: run even though off by default (--full / opt-in)
    assert only.runs("tp") and only.runs("quant", "tiny") and not only.runs("kernels")
    for part in ("kernels", "stock", "ksweep", "kcompile", "perrow", "packaged_latency", "kround_choices"):
        assert not default.runs(part) and full.runs(part), part
    assert all(default.runs(name) for name in ("compile", "latency", "e2e", "packaged", "peer", "floor"))
    assert not default.runs("quant", "tiny") and default.runs("quant", "small") and full.time_budget > 10
    assert run.parse_args(["--record"]).record == run.RESULTS_MD
    new = tmp_path / "new.md"
    assert run.parse_args(["--record", str(new)]).record == new and not new.exists()  # probed, not left behind
    assert run.parse_args(["--skip", "e2e,peer"]).skip == {"e2e", "peer"}
    assert run.parse_args(["--batch-sizes", "4,1,4"]).batch_sizes == (4, 1)  # a repeat was measured twice


@pytest.mark.parametrize("argv, ahead", [
    ([], ["e2e", "startup"]),
    (["--only", "startup"], []),  # the first section builds for itself: a second process would only be waited for
    (["--only", "e2e,startup"], ["startup"]),
    (["--full", "--only", "startup"], []),
])
def test_a_second_process_builds_only_for_sections_after_the_first(argv, ahead):
    s = run.parse_args(argv)
    assert run.built_ahead(s, [section for section in run.SECTIONS if run._selected(s, section)]) == ahead


@pytest.mark.parametrize("argv, message", [
    (["--skip", "compiel"], "--skip: unknown name(s) ['compiel']"),
    (["--only", "kernels"], "--only: unknown name(s) ['kernels']"),
    (["--no-compile"], "unrecognized arguments: --no-compile"),
    (["--batch-sizes", "1,x"], "--batch-sizes: must be comma-separated"),
    (["--with", "latency"], "--with: unknown name(s) ['latency']; choose from quant"),
    (["--with", "quant", "--skip", "quant"], "both skipped and asked for"),
    (["--only", "e2e", "--skip", "e2e"], "both skipped and asked for with --with / --only: ['e2e']"),
    (["--ks", "1,two"], "--ks: must be comma-separated integers, got '1,two'"),
    (["--e2e-ks", "0,4"], "each >= 1, got '0,4'"),
    (["--tp-world-sizes", "1,0"], "--tp-world-sizes: must name one or more integers, each >= 1, got '1,0'"),
    (["--context", "-1"], "argument --context: must be an int >= 1, got '-1'"),
    (["--threads", "0"], "argument --threads: must be an int >= 1, got '0'"),  # was silently 1
    (["--threads", str(10**20)], "argument --threads: must be an int in [1, 1024] (torch intra-op threads), got "
                                 "'100000000000000000000'"),  # was torch.set_num_threads' OverflowError
    (["--time-budget", "-1"], "argument --time-budget: must be a number > 0, got '-1'"),
    (["--probe-timeout", "nan"], "argument --probe-timeout: must be a number > 0, got 'nan'"),
    (["--e2e-tokens", "0"], "argument --e2e-tokens: must be an int >= 1, got '0'"),
    (["--k-seconds", "-1"], "argument --k-seconds: must be a number >= 0, got '-1'"),
    (["--config", "nope"], "argument --config: unknown name(s) ['nope']"),
    (["--config", ","], "argument --config: must name one or more presets"),
    (["--device", "tpu"], "argument --device: must be cpu or cuda (cuda:N), got 'tpu'"),
    (["--device", "cuda:99"], "argument --device: device='cuda:99' is not usable"),  # no machine has 100 GPUs
    (["--e2e-checkpoint", "/no/such/dir"], "argument --e2e-checkpoint: checkpoint '/no/such/dir': no such directory"),
    (["--only", ""], "argument --only: must name one or more of compile, latency,"),  # an empty --only ran everything
    (["--only", ","], "argument --only: must name one or more of compile, latency,"),
    (["--skip", ""], "argument --skip: must name one or more of compile, latency,"),
    (["--with", ""], "argument --with: must name one or more of quant, got ''"),
    (["--context", str(10**12)], "argument --context: the draft cache holds --context + 64 rows and tiny has "
                                 "model_max_length 4096: at most 4032, got 1000000000000"),
    (["--config", "small,tiny", "--context", "4033"], "tiny has model_max_length 4096: at most 4032, got 4033"),
    (["--tp-world-sizes", "100000"], "argument --tp-world-sizes: the tp section's small preset splits over 1, 2, 4, 8 "
                                     "ranks (one process each), got '100000'"),  # as many gloo processes
    (["--tp-world-sizes", "1,3"], "splits over 1, 2, 4, 8 ranks (one process each), got '1,3'"),  # 8 kv heads
    (["--record", "/no/such/dir/RESULTS.md"], "argument --record: '/no/such/dir/RESULTS.md' must be a file in an "
                                              "existing directory"),
    (["--record", "/proc/version"], "argument --record: cannot append to '/proc/version': "),  # before measuring
    (["--json", "."], "argument --json: '.' is a directory; name the file")])
def test_bad_arguments_name_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        run.parse_args(argv)
    lines = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith("python -m bench run: error: ")
    assert message in lines[0]


@pytest.mark.parametrize("name, message", [("a-file", "is not a directory"),
                                           ("empty", "holds no config.json: not a raw Inkling checkpoint directory")])
def test_the_e2e_checkpoint_must_be_a_checkpoint_directory(tmp_path, tiny_checkpoint, capsys, name, message):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        run.parse_args(["--e2e-checkpoint", str(tmp_path / name)])
    assert f"argument --e2e-checkpoint: checkpoint '{tmp_path / name}' {message}" in capsys.readouterr().err
    assert run.parse_args(["--e2e-checkpoint", str(tiny_checkpoint)]).e2e_checkpoint == tiny_checkpoint


def test_the_tp_section_runs_on_the_ranks_its_preset_splits_over():
    assert tp.world_sizes() == (1, 2, 4, 8)  # the small preset's 8 kv heads; at most the full-size comparison's T
    assert run.parse_args(["--tp-world-sizes", "8,1,4"]).tp_world_sizes == (8, 1, 4)


def test_an_unwritable_json_path_is_refused_before_anything_is_measured(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(run, "_section", lambda *a: pytest.fail("measured before the JSON could be written"))
    with pytest.raises(SystemExit, match=r"argument --json: cannot write .*a-file/result.json"):
        run.run(["--quick", "--only", "latency", "--json", str(blocker / "result.json")])


def test_help_is_only_the_help():
    """``--help`` prints the usage and nothing on stderr (no start-up progress line, no dependency's log line)."""
    env = {**os.environ, "PYTHONPATH": str(run.BENCH_DIR.parent)}
    done = subprocess.run([sys.executable, "-m", "bench", "run", "--help"], capture_output=True, text=True, env=env,
                          cwd=run.BENCH_DIR.parent, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m bench run") and done.stderr == ""
    assert "--tp-world-sizes" in done.stdout


def test_compile_time_split():
    times = {"_compile.compile_inner": 10.0, "OutputGraph.call_user_compiler": 8.5, "compile_fx_inner": 7.0,
             "bytecode_tracing": 1.0}
    split = split_compile_times(times)
    assert split["dynamo_s"] == pytest.approx(1.5) and split["backend_s"] == 8.5 and split["inductor_s"] == 7.0
    assert split["breakdown_s"] == {"bytecode_tracing": 1.0, "compile_fx_inner": 7.0}
    assert split_compile_times({})["dynamo_s"] == 0.0


def test_timing_interleaves_the_variants_and_summarises_block_samples():
    calls = []
    stats = harness.time_variants({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                  device=torch.device("cpu"), budget_s=0.3, rounds=2)
    assert set(stats) == {"a", "b"}
    assert all(s.n >= 1 and 0 < s.min_ms <= s.median_ms <= s.p90_ms for s in stats.values())
    assert set(calls) == {"a", "b"}
    assert harness.Stats.of([3.0, 1.0, 2.0]) == harness.Stats(2.0, 1.0, 3.0, 1.0, 3)
    with pytest.raises(ValueError, match="no samples"):
        harness.Stats.of([])


def test_a_probes_compiles_are_kept_for_the_run_and_its_own_files_left_as_they_were(tmp_path, monkeypatch):
    probe, own = tmp_path / "probe", tmp_path / "own"
    (probe / "fxgraph" / "ab").mkdir(parents=True)
    (probe / "fxgraph" / "ab" / "entry").write_text("the probe's")
    (probe / "kernel.so").write_text("the probe's")
    own.mkdir()
    (own / "kernel.so").write_text("the run's")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(own))
    harness.keep_compiles(str(probe))
    assert (own / "fxgraph" / "ab" / "entry").read_text() == "the probe's"
    assert (own / "kernel.so").read_text() == "the run's"
    assert sorted(p.name for p in own.rglob("*")) == ["ab", "entry", "fxgraph", "kernel.so"]  # no temporary left


def test_a_second_process_reports_each_section_and_the_run_goes_past_one_it_could_not_build():
    # with --full the startup section builds nothing ahead (it times its build into an empty cache); "bogus" is no
    # section, so its prebuild fails in the second process: the run then goes on and the section builds for itself
    second = harness.Prebuild(["startup", "bogus"], ["--full"])
    with harness.ONE_TIME.recording() as built:
        second.wait("startup")
        second.wait("bogus")
    second.close()
    assert second.done == {"startup": 0.0, "bogus": None} and second.process.returncode == 0
    assert built.seconds == {} and built.beside == 0.0  # nothing was built: no wait counts as a one-time build
