"""The counters of one rank's cache, written by the layers that do the counted work:
admission (hits, prompt tokens), the block pool (moves, evictions, drops) and the
manager's step (steps). ``KVCache.stats`` reports them."""

from __future__ import annotations

from dataclasses import dataclass, field

from .transfer import ROUTE_NAMES

__all__ = ["CacheCounters"]


@dataclass(slots=True)
class CacheCounters:
    hit_tokens: list[int] = field(default_factory=lambda: [0, 0, 0])  # by tier the block was in
    prompt_tokens: int = 0
    blocks_moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROUTE_NAMES, 0))
    evictions: list[int] = field(default_factory=lambda: [0, 0, 0])  # by tier evicted from
    dropped: int = 0
    # of which host blocks dropped, not demoted, to make room for an offload while the
    # disk was still writing the slots demoted before (BlockPool.drop_behind_disk)
    dropped_behind_disk: int = 0
    steps: int = 0
