"""Parse and format byte counts ("512MiB", 2.00 GiB), and take the ints and bools that options take."""

from __future__ import annotations

import operator
import re
from fractions import Fraction
from typing import Any

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, whole: bool = False) -> int:
    """Convert a byte count such as ``1024``, ``"512MiB"`` or ``"1.5 GB"`` (KiB and K: 1024, KB: 1000) to bytes.

    Rounded down, unless ``whole``: then a size that is not a whole number of bytes (``"0.1B"``) is refused.
    """
    if not isinstance(value, str):
        count = as_int(value)  # numpy's ints too, as range takes them
        if count is None:
            raise TypeError(f"a memory size must be an int or a str like '512MiB', got {value!r}")
        value = count
        if value < 0:
            raise ValueError(f"a memory size must be >= 0 bytes, got {value}")
        return value
    match = _PATTERN.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {value!r} as a memory size; use a number of bytes or a number "
            "with one of the units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    # Exact arithmetic: "2.01 KB" is 2010 bytes, where floats give 2009.99...
    exact = Fraction(match.group(1)) * _UNITS[unit]
    if whole and exact.denominator != 1:
        raise ValueError(f"a memory size must be a whole number of bytes, got {value!r} ({float(exact)} bytes)")
    return int(exact)


def format_bytes(count: int | float) -> str:
    """Format a byte count the way PyTorch's OOM messages do (``"2.00 GiB"``)."""
    size = float(count)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{int(size)} bytes" if unit == "bytes" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} TiB"


def format_free(count: int) -> str:
    """Format a reading of free memory, where ``-1`` means it could not be read and ``2**63 - 1`` no limit (meta)."""
    if count < 0:
        return "unknown memory"
    return "unlimited memory" if count >= _NO_LIMIT else format_bytes(count)


_NO_LIMIT = 2**63 - 1  # what free_memory reads on the meta device, which stores no data


def as_int(value: Any) -> int | None:
    """Return ``value`` as an int where Python's ``range`` takes it (numpy's ints too), else ``None``; never a bool."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        return None
    if str(getattr(value, "dtype", "")) in ("torch.bool", "bool"):  # a boolean tensor or array has __index__ too
        return None
    try:
        return operator.index(value)
    except (TypeError, RuntimeError):  # a float tensor, an array of several, a meta tensor: no int to give
        return None


def type_name(value: object) -> str:
    """Name the type of ``value`` as a reader would look for it: ``float``, but ``numpy.bool``."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def check_flag(name: str, value: object) -> None:
    """Raise ``TypeError`` unless ``value`` is a Python bool."""
    if not isinstance(value, bool):
        # numpy's bool_ prints as a bool: say that Python's is the one taken.
        hint = "" if type(value).__module__ == "builtins" else ": give a Python bool, True or False"
        raise TypeError(f"{name} must be a bool, got {type_name(value)} {value!r}{hint}")


def checked_dim(dim: object) -> int:
    """Return ``dim``, a dimension to split along, as an int (numpy's too); ``TypeError`` for anything else."""
    number = as_int(dim)
    if number is None:
        raise TypeError(f"dim must be an int, got {type_name(dim)} {dim!r}")
    return number
