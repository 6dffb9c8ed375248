"""Sizes in bytes: reading them from a config (``64MiB``, ``2GB``) and writing them for
people (``1.50 GiB``)."""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["MAX_SIZE", "GiB", "gib", "parse_size"]

GiB = 1 << 30
MAX_SIZE = (1 << 63) - 1  # sizes travel as int64 (numpy, torch, MPI)

_UNITS = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object) -> int:
    """Bytes from an int or a string with a unit (``64MiB``, ``2GB``, ``1.5GiB``)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError("a size must be an int (bytes) or a string like '64MiB'")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE_RE.match(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError("a size must look like 4096, '64MiB', '2GiB' or '500MB'")
        n = int(Fraction(m.group(1)) * _UNITS[m.group(2).lower()])  # exact: no float overflows to inf
    if n < 0:
        raise ValueError("a size cannot be negative")
    if n > MAX_SIZE:
        raise ValueError(f"a size is at most {MAX_SIZE:,} bytes (8 EiB)")
    return n


def gib(nbytes: int | float, digits: int = 2) -> str:
    """``nbytes`` in GiB for people, e.g. ``gib(3 << 29)`` is ``"1.50 GiB"``."""
    return f"{nbytes / GiB:.{digits}f} GiB"
