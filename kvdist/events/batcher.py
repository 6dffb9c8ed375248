"""A step's records (``kvdist.events.recorder``) as vLLM events: one
:class:`~kvdist.events.wire.BlockStored` per run of chained blocks stored into one
medium (each hash the parent of the next, token ids concatenated), one
:class:`~kvdist.events.wire.BlockRemoved` per run of removals from one medium, in the
order the cache made the changes, so that applying them in order gives each tier's
blocks exactly. Runs on the publisher's thread."""

from __future__ import annotations

from .recorder import CLEARED, REMOVED, Record
from .wire import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["events_of"]


def events_of(records: list[Record], block_size: int) -> list[KVCacheEvent]:
    events: list[KVCacheEvent] = []
    last: KVCacheEvent | None = None
    for r in records:
        kind = r[0]
        if kind == CLEARED:
            last = AllBlocksCleared()
            events.append(last)
            continue
        medium = MEDIA[r[1]]
        h = r[2]
        if kind == REMOVED:
            if type(last) is BlockRemoved and last.medium == medium:
                last.block_hashes.append(h)
            else:
                last = BlockRemoved(block_hashes=[h], medium=medium)
                events.append(last)
            continue
        parent, tokens = r[3]
        if (type(last) is BlockStored and last.medium == medium and tokens is not None
                and parent is not None and last.block_hashes[-1] == parent and last.token_ids):
            last.block_hashes.append(h)
            last.token_ids.extend(tokens)
        else:
            last = BlockStored(block_hashes=[h], parent_block_hash=parent,
                               token_ids=[] if tokens is None else tokens.tolist(),
                               block_size=block_size, lora_id=None, medium=medium, lora_name=None)
            events.append(last)
    return events
