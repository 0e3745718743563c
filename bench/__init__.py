"""Benchmark of inkling_compiled (the main job): ``python -m bench.run`` / ``make bench``.

Modules: :mod:`bench.run` (CLI and orchestration), :mod:`bench.models` (what is compared), :mod:`bench.step`
(the one-token draft step every way it runs), :mod:`bench.floor` (GEMM-only floor), :mod:`bench.timing`,
:mod:`bench.compile_probe` (cold / warm compile in a subprocess), :mod:`bench.e2e` (speculative generation on a
self-distilled target), :mod:`bench.report` (goals, table, RESULTS.md; ``python -m bench.report`` draws a saved
result), :mod:`bench.plots` (the report image), :mod:`bench.records` (the JSON as typed records);
``bench/gpu_check.sh`` is the prepared GPU run.
"""
