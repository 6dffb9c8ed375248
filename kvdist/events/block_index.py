"""What each replica caches, as its events say, and the longest cached prefix of a
prompt on each: the index a prefix-aware router keeps. Block hashes are the wire hashes
(``kvdist.events.wire``); a prompt's come from :func:`prompt_hashes`. Every medium
counts as cached here; ``media`` narrows a lookup."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..layout import KVLayout
from ..prefix import chain_hashes, token_bytes
from .wire import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, wire_hash

__all__ = ["ClusterBlocks", "ReplicaBlocks", "prompt_hashes"]


def prompt_hashes(tokens: Sequence[int], layout: KVLayout) -> list[int]:
    """The wire hashes of the full blocks of a prompt, as a kvdist cache of ``layout``
    (model geometry, dtype and tokens per block: every replica's) publishes them."""
    tpb = layout.tokens_per_block
    n = len(tokens) // tpb
    hashes = chain_hashes(layout.hash_salt(), token_bytes(tokens[: n * tpb]), 0, n, tpb)
    return [wire_hash(h) for h in hashes]


class ReplicaBlocks:
    """The block hashes one replica holds, per medium (``"GPU"``, ``"CPU"``, ``"DISK"``)."""

    def __init__(self) -> None:
        self.media: dict[str, set[int]] = {m: set() for m in MEDIA}

    def apply(self, batch: KVEventBatch) -> None:
        """Apply a batch's events in order."""
        media = self.media
        for ev in batch.events:
            if type(ev) is BlockStored:
                media.setdefault(ev.medium, set()).update(ev.block_hashes)
            elif type(ev) is BlockRemoved:
                media.setdefault(ev.medium, set()).difference_update(ev.block_hashes)
            elif type(ev) is AllBlocksCleared:
                for held in media.values():
                    held.clear()

    def prefix_blocks(self, hashes: Iterable[int], media: Iterable[str] | None = None) -> int:
        """How many leading ``hashes`` this replica holds, each in any of ``media``
        (default: every medium)."""
        sets = [self.media.get(m, set()) for m in (self.media if media is None else media)]
        n = 0
        for h in hashes:
            if not any(h in s for s in sets):
                break
            n += 1
        return n

    def __len__(self) -> int:
        return sum(len(s) for s in self.media.values())


class ClusterBlocks:
    """A :class:`ReplicaBlocks` per replica, fed batches tagged with their replica
    (``data_parallel_rank``)."""

    def __init__(self, num_replicas: int):
        self.replicas = [ReplicaBlocks() for _ in range(num_replicas)]

    def apply(self, batch: KVEventBatch, replica: int | None = None) -> None:
        """Apply ``batch`` to ``replica`` (default: the batch's ``data_parallel_rank``)."""
        r = batch.data_parallel_rank if replica is None else replica
        assert r is not None and 0 <= r < len(self.replicas), f"batch of unknown replica {r!r}"
        self.replicas[r].apply(batch)

    def prefix_blocks(self, hashes: Sequence[int], media: Iterable[str] | None = None) -> list[int]:
        """The cached prefix of ``hashes`` on each replica, in blocks."""
        media = None if media is None else list(media)
        return [rb.prefix_blocks(hashes, media) for rb in self.replicas]
