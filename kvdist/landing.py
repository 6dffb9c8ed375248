"""The remote tier's handle on one rank's manager (``kvdist.distributed.remote_plan.LocalSlots``):
the prompt's block hashes as ``add_sequence`` computes them, the local prefix, and
*landing slots* — free slots of a tier reserved (state LANDING) for blocks fetched
from another replica, which become ordinary cached blocks once the replica's ranks
agreed they arrived whole (``land``), or free slots again (``release``). Slots change
through the manager's :class:`~kvdist.block_pool.BlockPool` alone.

Every call changes the manager exactly as the same call does on the replica's other
TP ranks (they make the same calls in the same order), so their states stay equal."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .blocks import CACHED, GPU, HOST, LANDING, NO_SLOT
from .eviction import DEFAULT_PRIORITY
from .manager import CacheManager, token_array

__all__ = ["GPU", "HOST", "ManagerSlots"]


class ManagerSlots:
    """Landing slots and prefix lookups over ``manager`` (see the module docstring)."""

    def __init__(self, manager: CacheManager):
        self.m = manager
        self.tokens_per_block = manager.tpb
        self.host_base = manager.space.base[HOST]

    # -- lookups --------------------------------------------------------------------------------
    def block_hashes(self, tokens: Iterable[int]) -> list[int]:
        """The hashes of a prompt's full blocks, as ``add_sequence`` computes them (it
        may reuse all but one that would leave no token to compute)."""
        return self.m.block_hashes(token_array(tokens))

    def stamps_of(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(hash hi, hash lo) of the blocks in global ``slots``."""
        meta = self.m.meta
        return meta.hash_hi[slots], meta.hash_lo[slots]

    def cached(self, slots: np.ndarray) -> np.ndarray:
        """Per global slot: whether it holds a cached block."""
        return self.m.meta.state[slots] == CACHED

    def cached_prefix(self, hashes: list[int]) -> list[int]:
        """The slots of the leading ``hashes`` this rank holds in any tier (what
        ``add_sequence`` would reuse, as the cache is now)."""
        return self.m.index.match(hashes) if self.m.enable_reuse else []

    def tier_of(self, h: int) -> int | None:
        """The tier holding the block of hash ``h`` here, None if none does."""
        s = self.m.index.find(h)
        return None if s == NO_SLOT else self.m.space.tier_of(s)

    # -- landing slots ----------------------------------------------------------------------------
    def reserve(self, tier: int, n: int) -> list[int]:
        """Up to ``n`` slots of ``tier`` in state LANDING, evicting its coldest blocks as
        needed (the cascade's copies are queued); fewer when the tier runs out."""
        if not self.m.has_tier(tier):
            return []
        pool = self.m.pool
        out = []
        for _ in range(n):
            s = pool.reserve(tier)
            if s == NO_SLOT:
                break
            out.append(s)
        pool.submit_moves()
        return out

    def land(self, slot: int, h: int, priority: int = DEFAULT_PRIORITY) -> bool:
        """The fetched block of hash ``h`` in landing ``slot`` is whole and agreed: it
        becomes a cached block (most recently used). False when the hash is cached
        meanwhile (computed here): the slot is released instead."""
        return self.m.pool.land(slot, h, priority)

    def release(self, slot: int) -> None:
        """Return landing ``slot`` to its tier's free slots."""
        self.m.pool.release(slot)

    def landing_slots(self) -> np.ndarray:
        """Every slot in state LANDING (O(slots); for invariant checks)."""
        return np.flatnonzero(self.m.meta.state == LANDING)

    # -- copies made outside the engine ----------------------------------------------------------
    def pending_events(self, slots) -> list:
        """What a copy into ``slots`` made outside the transfer engine must follow (S2)."""
        return self.m.engine.pending_events(slots)

    def writes_pending(self, slots) -> np.ndarray:
        return self.m.engine.writes_pending(slots)

    @property
    def executor(self):
        return self.m.engine.executor

    def tier_base(self, tier: int) -> int:
        return self.m.space.base[tier]

