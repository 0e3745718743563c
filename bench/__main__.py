"""``python -m bench`` (:func:`bench.run.main`). A probe (a fresh process timing its own start-up) imports only what
it measures; a run first keeps the dependencies' warnings, which do not concern a benchmark user, off the terminal."""

import logging
import sys
import warnings

if sys.argv[1:2] == ["probe"]:
    from . import probe_main

    sys.exit(probe_main(*sys.argv[2:4]))
if not {"-h", "--help"} & set(sys.argv[1:]) and sys.argv[1:2] != ["prebuild"]:  # a run's second process: quiet
    print("[bench] starting: importing torch and transformers", file=sys.stderr, flush=True)
for category in (DeprecationWarning, FutureWarning):  # our code issues none: they are the dependencies' notes
    warnings.filterwarnings("ignore", category=category)
warnings.filterwarnings("ignore", category=UserWarning, module=r"(torch|torchao|transformers)(\.|$)")
logging.getLogger("torch._inductor").setLevel(logging.ERROR)  # torchao's and pytree's: bench/__init__.py
from transformers.utils import logging as transformers_logging  # noqa: E402 - after the filters it installs

transformers_logging.set_verbosity_error()
transformers_logging.disable_progress_bar()
from .run import main  # noqa: E402

sys.exit(main())
