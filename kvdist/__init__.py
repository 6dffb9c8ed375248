"""kvdist: a multi-rank, tiered, paged KV cache for LLM serving.

    cfg = kvdist.load_config("configs/default.yaml")
    cache = kvdist.create(cfg)          # collective over a Dup of COMM_WORLD, or alone

See docs/design.md for how it is built and README.md for the per-step API."""

__all__ = [
    "CacheClosedError", "CacheConfig", "ConfigError", "ConsensusAbort", "ConsensusTimeout",
    "ConsistencyError", "HostTierUnavailable", "InitStatus", "KVCache", "KVDistError", "OutOfBlocksError",
    "StepOrderError", "create", "load_config", "select_device",
]
__version__ = "0.1.0"

from .config import CacheConfig, load_config
from .distributed.consensus import InitStatus
from .errors import (
    CacheClosedError,
    ConfigError,
    ConsensusAbort,
    ConsensusTimeout,
    ConsistencyError,
    HostTierUnavailable,
    KVDistError,
    OutOfBlocksError,
    StepOrderError,
)

# The cache itself needs torch, whose import costs seconds. Loading it on first use lets
# `python -m kvdist run` report a config mistake at once, before any of that.
_LAZY = {"KVCache": ".cache", "create": ".cache", "select_device": ".candidate"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvdist' has no attribute {name!r}")
