"""A step's records (``kvdist.events.recorder``) as vLLM events, in the publisher's
process (or thread): one :class:`~kvdist.events.wire.BlockStored` per run of chained blocks stored
into one medium (each hash the parent of the next, token ids concatenated), one
:class:`~kvdist.events.wire.BlockRemoved` per run of removals from one medium, in the
order the cache made the changes, so that applying them in order gives each tier's
blocks exactly.

State, per global slot (lists indexed by slot, like the manager's arrays): the wire
hash of the cached block there and what it is beyond its hash — ``(parent wire hash or
None, its token ids)``, the ids as the :class:`msgspec.Raw` bytes of their msgpack list,
encoded once when the block is registered, so that each later move of the block sends
them again with no int object made and nothing encoded — as the records so far leave
them, moved with the block; and the hashes cached in any tier (the prefix index's
keys), which tell a registered block that is new from one that stays private. A block
landed from another replica is known by its hash alone (``UNKNOWN``: no parent, no
tokens).

An event's ``token_ids`` is therefore a :class:`msgspec.Raw`, which encodes to exactly
the bytes of the list of ints: one block's, or the blocks' of a chained run under one
list header."""

from __future__ import annotations

from array import array

import msgspec

from ..blocks import DISK, GPU, HOST, SlotSpace
from ..prefix import MASK64, chain_hashes, digest_bytes
from .recorder import CLEARED, DROPPED, LANDED, MOVED, REGISTERED, Record, StepRecords, records
from .wire import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["UNKNOWN", "EventBuilder", "list_header"]

UNKNOWN: tuple[None, None] = (None, None)  # a landed block: its hash alone
_NO_TOKENS = msgspec.Raw(b"\x90")  # an empty list


def list_header(n: int) -> bytes:
    """The msgpack header of a list of ``n`` items."""
    if n <= 15:
        return bytes((0x90 | n,))
    return (b"\xdc" + n.to_bytes(2, "big")) if n <= 0xFFFF else (b"\xdd" + n.to_bytes(4, "big"))


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
        self._encode = msgspec.msgpack.Encoder().encode
        self._skip = len(list_header(block_size))  # a block's encoded ids past their list header
        self._out: list[KVCacheEvent] = []
        # Of each event in _out: None (no token ids), the Raw of its one block, or the
        # Raws of its blocks (a chained run, joined under one header at the end).
        self._parts: list[msgspec.Raw | list[msgspec.Raw] | None] = []

    def _medium(self, slot: int) -> str:
        return MEDIA[(slot >= self._host) + (slot >= self._disk)]

    def events(self, step: StepRecords) -> list[KVCacheEvent]:
        """The events of one step's records (``BlockRecorder.hand_over``)."""
        self._out, self._parts = [], []
        drops: list[Record] = []  # waiting for the moves they came between
        for r in records(step, self._block_size):
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
                self._append(AllBlocksCleared(), None)
        if drops:
            self._moves([], [], drops)
        out, parts = self._out, self._parts
        self._out, self._parts = [], []
        tpb, skip = self._block_size, self._skip
        for ev, p in zip(out, parts):
            if type(p) is list:
                body = b"".join(memoryview(r)[skip:] for r in p)
                ev.token_ids = msgspec.Raw(list_header(len(p) * tpb) + body)
        return out

    def _append(self, ev: KVCacheEvent, parts: msgspec.Raw | None) -> None:
        self._out.append(ev)
        self._parts.append(parts)

    def _registered(self, slots: list[int], tokens: array, parent128: int | None) -> None:
        held, tpb, gpu, encode = self._held, self._block_size, MEDIA[GPU], self._encode
        hashes_at, info = self._hash, self._info
        hashes = chain_hashes(self._salt if parent128 is None else digest_bytes(parent128),
                              memoryview(tokens).cast("B"), 0, len(slots), tpb)
        ids = tokens.tolist()
        parent = None if parent128 is None else parent128 & MASK64
        t = 0
        for s, h in zip(slots, hashes):
            h &= MASK64
            if h not in held:  # else the block stays private: cached elsewhere already
                held.add(h)
                hashes_at[s] = h
                info[s] = rec = (parent, msgspec.Raw(encode(ids[t : t + tpb])))
                self._stored(gpu, h, rec)
            parent = h
            t += tpb

    def _moves(self, srcs: list[int], dsts: list[int], drops: list[Record]) -> None:
        if drops:
            self._moves_and_drops(srcs, dsts, drops)
            return
        hashes, info, bs, host, disk = self._hash, self._info, self._block_size, self._host, self._disk
        out, parts = self._out, self._parts
        first = True
        for s, t in zip(srcs, dsts):
            h = hashes[s]
            assert h is not None, f"a move from slot {s}, which holds no cached block"
            hashes[t], hashes[s] = h, None
            parent, tok = info[t] = info[s]
            info[s] = None
            if first:  # it may join a BlockRemoved before the run
                self._removed(MEDIA[(s >= host) + (s >= disk)], h)
                first = False
            else:  # removals and stores alternate from here: none joins another
                out.append(BlockRemoved([h], MEDIA[(s >= host) + (s >= disk)]))
                parts.append(None)
            out.append(BlockStored([h], parent, _NO_TOKENS if tok is None else tok, bs, None,
                                   MEDIA[(t >= host) + (t >= disk)], None))
            parts.append(tok)

    def _moves_and_drops(self, srcs: list[int], dsts: list[int], drops: list[Record]) -> None:
        """``_moves`` with the drops that came before and between them, in order."""
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
            self._append(BlockRemoved([h], medium), None)

    def _stored(self, medium: str, h: int, info: tuple) -> None:
        """Store block ``h`` of ``info`` (parent, token ids) into ``medium``: it joins
        the BlockStored before when that one ends with its parent in the same medium
        and both have token ids."""
        parent, tok = info
        out, parts = self._out, self._parts
        last = out[-1] if out else None
        if (type(last) is BlockStored and last.medium == medium and tok is not None
                and parent is not None and last.block_hashes[-1] == parent and parts[-1] is not None):
            last.block_hashes.append(h)
            p = parts[-1]
            if type(p) is list:
                p.append(tok)
            else:
                parts[-1] = [p, tok]
        else:
            self._append(BlockStored([h], parent, _NO_TOKENS if tok is None else tok, self._block_size,
                                     None, medium, None), tok)
