"""What admitting a prompt would do, as a value: ``CacheManager.plan`` computes it
without changing anything, ``CacheManager.commit`` applies it (nano-vllm's
``can_allocate`` -> ``allocate``; vLLM v1's ``get_computed_blocks`` -> ``allocate_slots``).

A plan is only valid for the cache state it was made in: it carries the manager's
``generation`` then, and ``commit`` refuses a plan made before any later change
(``CacheManager.refresh`` makes a current one from the same prompt without hashing
it again). Between the two a caller may act on the plan — the remote tier fetches its
``remote_hashes`` when it ``fits`` — and refresh it if that changed the cache."""

from __future__ import annotations

from array import array
from collections.abc import Hashable
from typing import NamedTuple

import numpy as np

from .blocks import DISK, GPU, HOST
from .prefix import digests_to_ints

__all__ = ["AdmissionPlan"]


class AdmissionPlan(NamedTuple):
    """Immutable; a tuple, which costs a fifth of a frozen dataclass to build (one per
    admission). ``tokens`` become the admitted sequence's own at commit."""

    seq_id: Hashable
    tokens: array  # int32 token ids (the plan's own copy)
    priority: int
    digests: np.ndarray  # [full blocks, 2] uint64: chained hashes (prefix.chain_digests); 0 rows, reuse off
    reusable: int  # leading blocks that may be reused: all full blocks but one leaving no token
    matched: int  # leading blocks cached here in any tier (before the recompute policy's cut)
    hits: np.ndarray  # the int64 slots reused, in prompt order (after the cut)
    hit_tiers: np.ndarray | None  # the tier of each matched block, when some are not on the GPU
    on_gpu: int  # hits already on the GPU
    need: int  # fresh GPU slots: for the blocks after the hits and for onboarding cold hits
    available: int  # GPU slots that can be had for it (free or evictable, hits aside)
    generation: int  # the manager's generation the plan was made in

    @property
    def fits(self) -> bool:
        """Whether ``commit`` finds its GPU slots (else it raises OutOfBlocksError)."""
        return self.need <= self.available

    @property
    def hashes(self) -> list[int]:
        """The chained hashes of every full block, as 128-bit ints ([] with reuse off)."""
        return digests_to_ints(self.digests)

    @property
    def remote_hashes(self) -> list[int]:
        """The reusable blocks after the local cached prefix: what another replica
        could supply."""
        return digests_to_ints(self.digests[self.matched:self.reusable])

    def hits_per_tier(self) -> tuple[int, int, int]:
        """Hits reused from each tier (GPU, host, disk)."""
        if self.hit_tiers is None:
            return len(self.hits), 0, 0
        out = np.bincount(self.hit_tiers[: len(self.hits)], minlength=3).tolist()
        return out[GPU], out[HOST], out[DISK]
