"""The start-up benchmark (``bench.startup``): its import probe in a fresh process (which also shows the lazy import
boundary from the benchmark's side), and the verdict lines of a result (the measurement itself runs under
``python -m bench.startup``, not in CI)."""

import dataclasses
import os

from bench import report
from bench.startup import GOALS, HEAVY, RoundFigures, StartupResult, _spawn, lines


def test_the_import_probe_times_both_imports_and_finds_no_heavy_module():
    found = _spawn("imports", {}, dict(os.environ), timeout=300)
    assert found["import_torch_s"] > 0 and found["import_package_s"] > 0
    assert found["imported"] == []


def test_each_goal_is_judged_and_printed():
    rounds = RoundFigures(median_ms={"round_1": 0.1, "round_k": 0.6, "round_k_steps": 1.8, "floor_k": 0.25},
                          p10_ms={}, p90_ms={}, build_s={"round_k": 100.0}, same_drafts={"round_k": True})
    rounds.p10_ms = rounds.p90_ms = rounds.median_ms
    result = StartupResult(preset="tiny8", k=8, threads=1, torch="2.13", processes=1, import_torch_s=2.0,
                           import_package_s=0.2, package_imported=[], first_draft_s=2.4, first_draft_import_s=2.2,
                           first_draft_imported=[], first_draft_packaged=True, rounds=rounds,
                           ratios={"first_draft_vs_import_torch": 1.2, "round_k_vs_round_1": 6.0,
                                   "round_k_vs_floor": 2.4, "round_k_steps_vs_round_k": 3.0,
                                   "floor_k_vs_round_1": 2.5, "overhead_per_depth_us": 44.0},
                           goals={"first_draft_vs_import_torch": True, "import_package_s": True,
                                  "round_k_vs_round_1": False, "round_k_vs_floor": False})
    record = dataclasses.asdict(result)
    text = "\n".join(lines(record))
    assert set(result.goals) == set(GOALS)
    assert "round_k_vs_round_1                  6.00  goal <= 3.0: MISSED" in text
    assert "first_draft_vs_import_torch         1.20  goal <= 1.3: met" in text
    assert f"imported: none of {', '.join(HEAVY)}" in text
    assert "GEMMs alone cost 2.50x the whole K = 1 round" in text and "44 us per depth" in text


def test_the_runner_judges_the_four_goals_from_the_section():
    record = {"import_package_s": 0.2, "ratios": {"first_draft_vs_import_torch": 1.4, "round_k_vs_round_1": 2.5,
                                                  "round_k_vs_floor": 1.5}}
    result = {"settings": {"device": "cpu", "dtype": "float32"}, "startup": record}
    found = {g["id"]: g["met"] for g in report.evaluate_goals(result)}
    assert found["startup_first_draft_vs_import_torch"] is False and found["startup_import_package"] is True
    assert found["startup_round_k_vs_round_1"] is True and found["startup_round_k_vs_floor"] is True
