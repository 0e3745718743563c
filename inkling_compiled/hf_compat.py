"""The transformers versions this package runs on, and the one difference between them that it touches.

The floor is pyproject's (``transformers>=5.23``; ``make test-floor`` runs the tests that use transformers on exactly
that release). 5.24 renamed every model's cache argument from ``past_key_values`` to ``cache``; both forwards also
take ``**kwargs``, so passing the other version's name is silently swallowed and the forward runs without a cache.
:func:`cache_argument` reads the name from the forward's signature instead.

The version is read from the installed distribution's metadata, so that importing this module (and the package)
does not import transformers: a process that loads a checkpoint directory and runs packaged steps never does
(docs/architecture.md, "What importing costs").
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import re
import sys

MIN_TRANSFORMERS = (5, 23)
CACHE_ARGUMENTS = ("cache", "past_key_values")  # 5.24 and later, 5.23


def installed_version() -> str:
    """The transformers version this process runs: the imported module's, else the installed distribution's."""
    module = sys.modules.get("transformers")
    if module is not None:
        return module.__version__
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError("inkling_compiled needs transformers, which is not installed "
                          f"(pip install 'transformers>={'.'.join(map(str, MIN_TRANSFORMERS))}')") from None


def check_transformers_version(version: str | None = None) -> None:
    """Raise ImportError unless ``version`` (default: the installed one) is at least :data:`MIN_TRANSFORMERS`."""
    version = version or installed_version()
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or tuple(map(int, found.groups())) < MIN_TRANSFORMERS:
        floor = ".".join(map(str, MIN_TRANSFORMERS))
        raise ImportError(f"inkling_compiled needs transformers >= {floor}; found transformers {version} "
                          f"(pip install 'transformers>={floor}')")


def cache_argument(model: object) -> str:
    """The keyword under which ``model``'s forward takes its KV cache (``cache`` or ``past_key_values``)."""
    return _cache_argument_of(type(model))


@functools.cache
def _cache_argument_of(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    for name in CACHE_ARGUMENTS:
        if name in parameters:
            return name
    raise TypeError(f"{model_class.__name__}.forward takes none of {', '.join(CACHE_ARGUMENTS)} "
                    f"(transformers {installed_version()}): cannot pass it a cache")


check_transformers_version()  # on import (the package imports this module first), before any Inkling class is needed
