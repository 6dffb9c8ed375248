"""Element types of the KV cache: the names a config may give and their sizes, and the
torch dtype behind a name or a numpy dtype. torch is imported by the functions that
return torch types only, so a config loads (and is checked) without it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["ITEMSIZE", "torch_dtype", "torch_dtype_of"]

ITEMSIZE = {  # bytes per element of each dtype a config may name
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a config's ``model.dtype`` names."""
    import torch

    assert name in ITEMSIZE, f"not a KV dtype: {name!r}"
    dt = getattr(torch, name, None)
    assert isinstance(dt, torch.dtype), f"torch has no dtype {name}"
    return dt


_OF_NUMPY: dict[np.dtype, torch.dtype] = {}


def torch_dtype_of(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of the same elements as numpy's ``dtype`` (memoized)."""
    t = _OF_NUMPY.get(dtype)
    if t is None:
        import torch

        t = _OF_NUMPY[dtype] = torch.from_numpy(np.empty(0, dtype)).dtype
    return t
