"""A step's records (``kvdist.events.recorder``) as vLLM events, on the publisher's
thread: one :class:`~kvdist.events.wire.BlockStored` per run of chained blocks stored
into one medium (each hash the parent of the next, token ids concatenated), one
:class:`~kvdist.events.wire.BlockRemoved` per run of removals from one medium, in the
order the cache made the changes, so that applying them in order gives each tier's
blocks exactly.

State, per global slot (lists indexed by slot, like the manager's arrays): the wire
hash of the cached block there and what it is beyond its hash — ``(parent wire hash or
None, its int32 token ids)``, an array the garbage collector need not follow — as the
records so far leave them, moved with the block; and the hashes cached in any tier (the
prefix index's keys), which tell a registered block that is new from one that stays
private. A block landed from another replica is known by its hash alone (``UNKNOWN``:
no parent, no tokens)."""

from __future__ import annotations

from array import array

from ..blocks import DISK, GPU, HOST, SlotSpace
from ..prefix import MASK64, chain_hashes, digest_bytes
from .recorder import CLEARED, DROPPED, LANDED, MOVED, REGISTERED, Record
from .wire import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["UNKNOWN", "EventBuilder"]

UNKNOWN: tuple[None, None] = (None, None)  # a landed block: its hash alone


class EventBuilder:
    """Turns each step's records into its events (module docstring); one per stream,
    fed every record in order."""

    def __init__(self, space: SlotSpace, block_size: int, salt: bytes):
        self._salt = salt  # the parent of a sequence's first block (KVLayout.hash_salt)
        self._host, self._disk = space.base[HOST], space.base[DISK]
        self._block_size = block_size
        self._hash: list[int | None] = [None] * space.total
        self._info: list[tuple | None] = [None] * space.total
        self._held: set[int] = set()

    def _medium(self, slot: int) -> str:
        return MEDIA[GPU if slot < self._host else (HOST if slot < self._disk else DISK)]

    def events(self, records: list[Record]) -> list[KVCacheEvent]:
        self._out: list[KVCacheEvent] = []
        self._tokens: list[array | None] = []  # of each event in _out: a BlockStored's token ids
        drops: list[Record] = []  # waiting for the moves they came between
        for r in records:
            kind = r[0]
            if kind == DROPPED:
                drops.append(r)
                continue
            if kind == MOVED:
                self._moves(r[1], r[2], drops)
                drops = []
                continue
            if drops:
                self._moves([], [], drops)
                drops = []
            if kind == REGISTERED:
                self._registered(*r[1:])
            elif kind == LANDED:
                _, slot, h = r
                self._hash[slot] = h
                self._info[slot] = UNKNOWN
                self._held.add(h)
                self._stored(self._medium(slot), h, UNKNOWN)
            else:
                assert kind == CLEARED, f"unknown record {r!r}"
                n = len(self._hash)
                self._hash, self._info = [None] * n, [None] * n
                self._held.clear()
                self._out.append(AllBlocksCleared())
                self._tokens.append(None)
        if drops:
            self._moves([], [], drops)
        out, self._out = self._out, []
        for ev, tokens in zip(out, self._tokens):
            if tokens is not None:
                ev.token_ids = tokens.tolist()
        return out

    def _registered(self, slots: list[int], tokens: array, start: int, end: int,
                    parent128: int | None) -> None:
        held, tpb, t, gpu = self._held, self._block_size, 0, MEDIA[GPU]
        slots, tokens = slots[start:end], tokens[start * tpb : end * tpb]  # copies: the step may extend them
        hashes = chain_hashes(self._salt if parent128 is None else digest_bytes(parent128),
                              memoryview(tokens).cast("B"), 0, end - start, tpb)
        parent = None if parent128 is None else parent128 & MASK64
        for s, h in zip(slots, hashes):
            h &= MASK64
            if h not in held:  # else the block stays private: cached elsewhere already
                held.add(h)
                self._hash[s] = h
                info = self._info[s] = (parent, tokens[t : t + tpb])
                self._stored(gpu, h, info)
            parent = h
            t += tpb

    def _moves(self, srcs: list[int], dsts: list[int], drops: list[Record]) -> None:
        hashes, info, medium = self._hash, self._info, self._medium
        d = 0
        for i, (s, t) in enumerate(zip(srcs, dsts)):
            while d < len(drops) and drops[d][2] <= i:
                self._dropped(drops[d][1])
                d += 1
            h = hashes[s]
            assert h is not None, f"a move from slot {s}, which holds no cached block"
            hashes[t], hashes[s] = h, None
            rec = info[t] = info[s]
            info[s] = None
            self._removed(medium(s), h)
            self._stored(medium(t), h, rec)
        for r in drops[d:]:
            self._dropped(r[1])

    def _dropped(self, slot: int) -> None:
        h = self._hash[slot]
        assert h is not None, f"a drop of slot {slot}, which holds no cached block"
        self._hash[slot] = self._info[slot] = None
        self._held.discard(h)
        self._removed(self._medium(slot), h)

    def _removed(self, medium: str, h: int) -> None:
        last = self._out[-1] if self._out else None
        if type(last) is BlockRemoved and last.medium == medium:
            last.block_hashes.append(h)
        else:
            self._out.append(BlockRemoved(block_hashes=[h], medium=medium))
            self._tokens.append(None)

    def _stored(self, medium: str, h: int, info: tuple) -> None:
        parent, tokens = info
        out = self._out
        last = out[-1] if out else None
        if (type(last) is BlockStored and last.medium == medium and tokens is not None
                and parent is not None and last.block_hashes[-1] == parent and self._tokens[-1] is not None):
            last.block_hashes.append(h)
            self._tokens[-1] += tokens  # an array: one copy, no int objects
        else:
            out.append(BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=[],
                                   block_size=self._block_size, lora_id=None, medium=medium, lora_name=None))
            self._tokens.append(None if tokens is None else array("i", tokens))
