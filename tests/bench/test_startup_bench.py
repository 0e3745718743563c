"""The start-up benchmark (``bench.startup``): its import probe through ``harness.run_probe`` (which also shows the
lazy import boundary from the benchmark's side), the table of a result and the goals the runner judges from it (the
measurement itself runs in ``python -m bench run --only startup``, not in CI)."""

import dataclasses

from bench import report
from bench.harness import Stats, run_probe
from bench.probes import HEAVY
from bench.startup import Startup, lines


def test_the_import_probe_times_both_imports_from_a_child_that_had_not_imported_torch():
    found = run_probe("probes.imports", {}, cache_dir=None, timeout=300)
    assert found["torch_fresh"] is True
    assert found["import_torch_s"] > 0 and found["import_package_s"] > 0
    assert found["package_imported"] == []


def test_the_table_prints_every_figure_and_no_verdict():
    first = {"import_torch_s": 2.0, "import_package_s": 0.2, "package_imported": [], "torch_fresh": True,
             "import_s": 2.2, "model_s": 0.05, "ready_s": 0.1, "prefill_s": 0.01, "first_draft_s": 0.04,
             "to_first_draft_s": 2.4, "packaged": True, "imported": [], "dynamo_graphs": 0, "process_s": 2.5}
    rounds = {name: Stats(ms, ms, ms, ms, 3) for name, ms in
              {"round_1": 0.1, "round_k": 0.6, "round_k_steps": 1.8, "floor_k": 0.25}.items()}
    result = Startup("tiny8", 8, 1, "2.13", 5, first, rounds, {"round_k": 100.0}, {"round_k": True}, "an empty one",
                     {"first_draft_vs_import_torch": 1.2, "round_k_vs_round_1": 6.0, "floor_k_vs_round_1": 2.5,
                      "overhead_per_depth_us": 44.0})
    text = "\n".join(lines(dataclasses.asdict(result)))
    assert "import torch (spawn to done)            2.00 s" in text and "0.200 s on top" in text
    assert f"imported: none of {', '.join(HEAVY)}" in text and "round packaged: True" in text
    assert "2.40 s after the spawn: imports 2.20 (torch 2.00)" in text
    assert ["round_k", "0.6000", "0.6000-0.6000", "100.0", "s"] in [line.split() for line in text.splitlines()]
    assert "round_k_vs_round_1                 6.00" in text and "round_k_vs_round_1's bound" in text
    assert "44.00  (what the round adds to its GEMMs per depth" in text
    assert "round_k's packaged round from an empty one" in text
    assert "goal" not in text and "MISSED" not in text  # the verdicts are the goal table's (bench/report.py)


def test_the_runner_judges_the_four_goals_from_the_section():
    record = {"first_draft": {"import_package_s": 0.2},
              "ratios": {"first_draft_vs_import_torch": 1.4, "round_k_vs_round_1": 2.5, "round_k_vs_floor": 1.5}}
    result = {"settings": {"device": "cpu", "dtype": "float32"}, "startup": record}
    found = {g["id"]: g["met"] for g in report.evaluate_goals(result)}
    assert found["startup_first_draft_vs_import_torch"] is False and found["startup_import_package"] is True
    assert found["startup_round_k_vs_round_1"] is True and found["startup_round_k_vs_floor"] is True
