"""kvdist: a multi-rank, tiered, paged KV cache for LLM serving.

    cfg = kvdist.load_config("configs/default.yaml")
    cache = kvdist.create(cfg)          # collective over a Dup of COMM_WORLD, or alone

See DESIGN.md for the contract and README.md for the per-step API."""

from .config import CacheConfig, load_config
from .dist.consensus import InitStatus
from .errors import (
    ConfigError,
    ConsensusAbort,
    ConsensusTimeout,
    ConsistencyError,
    HostTierUnavailable,
    KVDistError,
    OutOfBlocksError,
)
from .local import select_device
from .service import KVCache, create

__version__ = "0.1.0"

__all__ = [
    "CacheConfig", "ConfigError", "ConsensusAbort", "ConsensusTimeout", "ConsistencyError",
    "HostTierUnavailable", "InitStatus", "KVCache", "KVDistError", "OutOfBlocksError",
    "create", "load_config", "select_device",
]
