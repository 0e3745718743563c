"""The benchmark (``python -m bench``, ``make bench``): measurement modules registered in :data:`bench.run.SECTIONS`;
bench/README.md lists them and says how to add one."""

import logging

# transformers imports torchao (where installed) with its models; that import logs a load failure for each CUDA-only
# extension library on a CPU build, and torch's pytree a deprecation for each of its enum registrations
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
