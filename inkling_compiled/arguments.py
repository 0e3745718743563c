"""The argument checks every entry point shares: one place, one message form ("NAME must be ..., got VALUE").

Entry points (``InklingMTP.from_pretrained`` / ``quantize_``, ``Drafter``, ``speculative_generate``, the command
line, the text-target helpers) check each public argument once, at their boundary, with these; code behind a
boundary trusts what it is given. The model's own tensor checks (shapes, ids against its table, caches) are in
``model/validation.py``.
"""

from __future__ import annotations

import argparse
import math
import numbers
import operator
import os
import sys
import tempfile
from pathlib import Path

import torch

# The most intra-op threads a --threads option takes: above the hardware threads of the largest hosts (a few hundred),
# where more only oversubscribe the cores, and far inside the C int torch.set_num_threads takes (10**20 was its
# "Overflow when unpacking long long" traceback).
MAX_THREADS = 1024

# Below this a sampling temperature is greedy decoding up to float rounding, and its reciprocal (or logits divided by
# it) overflows float32: it is refused, with 0 (greedy) as the way to ask for that.
MIN_TEMPERATURE = 1e-6


class ArgumentError(ValueError, TypeError):
    """A public argument of the wrong type or value. Both a ValueError and a TypeError, so that callers of either
    contract (the loop's ValueErrors, the loaders' TypeErrors for a wrong type) catch it."""


def is_int(value) -> bool:
    """A Python int that is not a bool (``True`` is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A real number that is not a bool: an int, a float, a NumPy scalar (whatever registers as numbers.Real)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_bool(name: str, value, *, optional: bool = False) -> None:
    if not (isinstance(value, bool) or optional and value is None):
        raise ArgumentError(f"{name} must be a bool{' or None' if optional else ''}, got {value!r}")


def integer(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int (anything with ``__index__`` but a bool), within [minimum, maximum] where given."""
    number = _index(value)
    if (number is None or (minimum is not None and number < minimum)
            or (maximum is not None and number > maximum)):
        raise ArgumentError(f"{name} must be an int{_bounds(minimum, maximum)}, got {value!r}")
    return number


def _index(value) -> int | None:
    """``operator.index(value)`` for anything but a bool; None where it is no integer (a float tensor or a
    NumPy array of more than one element has ``__index__`` but raises in it)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def positive_int(name: str, value) -> int:
    """``value`` as an int >= 1 (a bool or a float is not a count)."""
    return integer(name, value, minimum=1)


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments are one line naming the problem (exit status 2), without the usage text."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def refused(prog: str, error: BaseException) -> int:
    """A command's answer when the library refuses what it was given: the error's first line, exit status 2."""
    print(f"{prog}: error: {str(error).splitlines()[0] if str(error) else type(error).__name__}", file=sys.stderr)
    return 2


def nearest_existing(path: Path) -> Path:
    """``path`` itself or its nearest existing parent ("/" at least)."""
    return next(p for p in (path, *path.absolute().parents) if p.exists())


def positive_int_option(value: str) -> int:
    """An argparse type: an int >= 1 (argparse prints "argument --NAME: " before the message)."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value!r}")
    return number


def threads_option(value: str) -> int:
    """An argparse type: a count of torch intra-op threads, in [1, :data:`MAX_THREADS`]."""
    number = positive_int_option(value)
    if number > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be an int in [1, {MAX_THREADS}] (torch intra-op threads), "
                                         f"got {value!r}")
    return number


def writable_directory_option(value: str) -> Path:
    """An argparse type: a directory that exists or can be created, and, where it is new or empty (so something is
    to be written there), can be written in. Probed by making and removing a temporary directory in it or its
    nearest existing parent: the one test that /proc, a read-only mount or a missing permission answers truthfully
    (``os.access`` says yes to root). A directory holding files is left to the command (a cached result there is
    read, not written)."""
    if not value:
        raise argparse.ArgumentTypeError("must name a path, got ''")  # Path('') is the current directory
    directory = Path(value)
    try:
        if directory.is_symlink() and not directory.exists():
            raise argparse.ArgumentTypeError(f"{value!r} is a link to nothing")
        existing = nearest_existing(directory)
        if not existing.is_dir():
            raise argparse.ArgumentTypeError(f"{value!r} is not a directory" if existing == directory else
                                             f"{value!r} cannot be a directory: {str(existing)!r} is not one")
        if existing != directory or not any(directory.iterdir()):
            os.rmdir(tempfile.mkdtemp(prefix=".inkling-write-probe-", dir=existing))
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{value!r} is not writable ({e.strerror or e})") from None
    return directory


def _bounds(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    return f" >= {minimum}" if minimum is not None else f" <= {maximum}" if maximum is not None else ""


def size_tuple(name: str, values) -> tuple[int, ...]:
    """Sorted distinct sizes from an iterable of ints >= 1."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ArgumentError(f"{name} must be a tuple of ints >= 1, got {values!r}")
    return tuple(sorted({positive_int(f"each of {name}", v) for v in values}))


def token_id(name: str, value, vocab: int, why: str = "") -> int:
    """``value`` as a token id in [0, vocab): an int (anything with ``__index__`` but a bool: a NumPy integer, a
    0-d integer tensor)."""
    tensor_ok = not isinstance(value, torch.Tensor) or value.dim() == 0 and _is_integer_dtype(value.dtype)
    number = _index(value) if tensor_ok else None
    if number is None or not 0 <= number < vocab:
        raise ArgumentError(f"{name} must be a token id in [0, {vocab}){why}, got {value!r}")
    return number


def token_ids(name: str, value, vocab: int) -> list[int]:
    """An id, a sequence of ids or an integer tensor of ids as a list of ids in [0, vocab); None is []."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        if not _is_integer_dtype(value.dtype) or value.dim() > 1:
            raise ArgumentError(f"{name} must be token ids in [0, {vocab}) (an int, a list or a 0-d / 1-d integer "
                                f"tensor), got a {value.dtype} tensor of shape {tuple(value.shape)}")
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [token_id(f"each of {name}", v, vocab) for v in value]
    return [token_id(name, value, vocab)]


def temperature(value) -> float:
    """A sampling temperature: 0 (greedy) or a finite number >= :data:`MIN_TEMPERATURE`."""
    if not is_number(value) or not (value == 0 or MIN_TEMPERATURE <= value < math.inf):
        raise ArgumentError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} (smaller ones "
                            f"are greedy decoding up to rounding, and overflow float32 as 1 / temperature), got "
                            f"{value!r}")
    return float(value)


def top_p(value) -> float:
    if not is_number(value) or not 0.0 < value <= 1.0:
        raise ArgumentError(f"top_p must be in (0, 1], got {value!r}")
    return float(value)


def generator(value, device: torch.device) -> None:
    """None, or a ``torch.Generator`` of ``device``'s type (what sampling on it needs)."""
    if value is None:
        return
    if not isinstance(value, torch.Generator):
        raise ArgumentError(f"generator must be a torch.Generator (or None), got {type(value).__name__}")
    if value.device.type != device.type:
        raise ArgumentError(f"generator is on {value.device}, the model on {device}: sampling needs a generator of "
                            f"the model's device (torch.Generator(device={device.type!r}))")


def device(value, name: str = "device", *, runs: bool = False) -> torch.device | None:
    """The torch.device named by ``value`` (None passes), usable here: an absent backend or index fails now, not
    mid-load. ``runs``: it must also compute (the meta device, which loading accepts, holds no data)."""
    if value is None:
        return None
    try:
        resolved = torch.device(value)
        torch.empty(1, device=resolved)
    except (RuntimeError, AssertionError, TypeError, NotImplementedError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ArgumentError(f"{name}={value!r} is not usable: {reason}") from e
    if runs and resolved.type == "meta":
        raise ArgumentError(f"{name}={value!r} is not usable: a meta device holds no data to run on")
    if resolved.type == "cpu" and resolved.index not in (None, 0):  # torch puts its tensors on 'cpu' all the same
        raise ArgumentError(f"{name}={value!r} is not usable: torch has one CPU device, 'cpu'")
    return resolved


def dtype(name: str, value, allowed) -> torch.dtype | None:
    """None or one of the ``allowed`` torch dtypes."""
    if value is not None and (not isinstance(value, torch.dtype) or value not in allowed):
        supported = f"None or one of {sorted(map(str, allowed))}"
        got = value if isinstance(value, torch.dtype) else f"{type(value).__name__} {value!r}"
        raise ArgumentError(f"{name} must be {supported}, got {got}")
    return value


def path(name: str, value) -> Path:
    """``value`` as a Path; it must be a non-empty str or os.PathLike."""
    if not isinstance(value, (str, os.PathLike)):
        raise ArgumentError(f"{name} must be a str or os.PathLike, got {type(value).__name__} {value!r}")
    if not os.fspath(value):  # Path("") is the working directory: a save there would overwrite its files
        raise ArgumentError(f"{name} must name a path, got {value!r}")
    return Path(value)


def existing_directory(name: str, value) -> Path:
    """``value`` as the Path of an existing directory ('' is refused by :func:`path`, not taken for the current one)."""
    directory = path(name, value)
    if not directory.exists():
        raise ArgumentError(f"{name} {str(directory)!r}: no such directory")
    if not directory.is_dir():
        raise ArgumentError(f"{name} {str(directory)!r} is not a directory")
    return directory


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def ids_below(name: str, ids: torch.Tensor, limit: int, table: str, what: str = "id") -> None:
    """ArgumentError naming an id of ``ids`` outside [0, ``limit``) of the ``table`` they index (an index error
    inside the embedding, a device assert on CUDA); one host sync for both ends."""
    low, high = torch.stack(torch.aminmax(ids)).tolist() if ids.numel() else (0, 0)
    if low < 0 or high >= limit:
        raise ArgumentError(f"{name} hold {what} {low if low < 0 else high}, outside {table} [0, {limit})")


def integer_tensor(name: str, value, *, ndim: int) -> torch.Tensor:
    """A tensor of ``ndim`` dims of any integer dtype, as int64 (converted once, here: a uint8 tensor is then never
    taken for a boolean mask, nor an int16 one refused deep inside an index op)."""
    if not isinstance(value, torch.Tensor):
        raise ArgumentError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ArgumentError(f"{name} must have {ndim} dims, got shape {tuple(value.shape)}")
    if not _is_integer_dtype(value.dtype):
        raise ArgumentError(f"{name} must be an integer tensor, got {value.dtype}")
    return value.long()
