"""The CUDA runtime library (libcudart) of this process: the one torch loaded, found in
``/proc/self/maps``, so that kvdist's own calls share its version and its last-error
slot; else one loaded by name."""

from __future__ import annotations

import ctypes

__all__ = ["load", "loaded_paths"]

_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


def loaded_paths() -> list[str]:
    """Paths of the libcudart copies this process has mapped, in map order (usually one)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            return list(dict.fromkeys(line.split()[-1] for line in maps if "libcudart.so" in line))
    except OSError:
        return []


def load() -> tuple[ctypes.CDLL | None, str | None]:
    """(library, its path or name): the runtime this process has loaded, else the first
    of ``libcudart.so.13``, ``.12``, ``.so`` that loads; (None, None) without one."""
    for name in loaded_paths()[:1] + list(_NAMES):
        try:
            return ctypes.CDLL(name), name
        except OSError:
            continue
    return None, None
