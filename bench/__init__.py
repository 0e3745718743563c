"""The benchmark (``python -m bench``; bench/README.md), and the child's side of :func:`bench.harness.run_probe`,
reached before anything heavy is imported (a start-up probe times those imports)."""

import importlib
import json
import logging

# transformers imports torchao (where installed) with its models; that import logs a load failure for each CUDA-only
# extension library on a CPU build, and torch's pytree a deprecation for each of its enum registrations
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

PROBE_PREFIX = "BENCH_PROBE: "


def probe_main(function: str, args_json: str) -> int:
    """``bench.<module>.<function>(args)``, its result printed for the parent to read."""
    module, name = function.rsplit(".", 1)
    result = getattr(importlib.import_module(f"bench.{module}"), name)(json.loads(args_json))
    print(PROBE_PREFIX + json.dumps(result), flush=True)
    return 0
