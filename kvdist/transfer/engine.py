"""The transfer engine: turns a stream of single-block copies into ordered batches.

Rules enforced here (DESIGN §4):

* S1 — pending copies are tracked per *physical slot*, in the global slot space where
  slot 0 of one tier never aliases slot 0 of another. (``tracking="block"`` keys them
  by the block's identity and ``tracking="local"`` by tier-local index instead; both
  are the bugs S1 forbids, kept so the tests can show that they corrupt.)
* S2 — a copy into slot D waits for every pending read of D and the pending write to
  D; a copy out of S waits for the pending write to S. Inside one batch copies have no
  order (a batched DMA or gather kernel runs them in parallel), so a copy that would
  conflict with the open batch closes that batch first.
* S4 — after ``begin_step`` every copy waits for the compute stream as it was then.
* S5 — ``before_compute`` submits everything and makes compute wait for it.

The engine never touches memory: an executor does the copies and owns the streams
and events. Per-slot state is two int32 arrays indexed by tracking key (8 bytes a
slot): the id of the last batch that wrote the slot and of the last that read it.
Events live only for batches in flight (a dict id -> event), so a stale id simply
matches nothing, and the Python work per step is a few numpy operations per batch
plus a small constant per copy, independent of how many blocks exist.

One read entry per slot is exact because a batch that reads a slot with a pending
read from another batch is made to wait for that batch too (reads rarely repeat
before a write; the cost is an occasional extra wait, never a missing one). Ids wrap
at 2**31 (no batch stays in flight that long): a stale id that matches a newer batch
only adds a spurious wait."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..blocks import DISK, GPU, HOST, SlotSpace

ALL_RULES = frozenset({"S2", "S4", "S5"})

DIRECTIONS = {
    (GPU, HOST): "offload",
    (HOST, GPU): "onboard",
    (HOST, DISK): "demote",
    (GPU, DISK): "spill",
    (DISK, GPU): "fetch",
}
STREAM_OF = {"offload": "offload", "onboard": "onboard", "demote": "disk", "spill": "disk",
             "fetch": "disk"}
# DIRECTIONS as a table indexed [source tier][destination tier] (None: no such move).
_DIRECTION_OF = tuple(tuple(DIRECTIONS.get((a, b)) for b in (GPU, HOST, DISK)) for a in (GPU, HOST, DISK))


@dataclass(slots=True)
class _Batch:
    direction: str
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    rkeys: list[int] = field(default_factory=list)  # tracking key read, per copy
    wkeys: list[int] = field(default_factory=list)  # tracking key written, per copy
    reads: set[int] = field(default_factory=set)
    writes: set[int] = field(default_factory=set)


@dataclass(slots=True)
class TransferStats:
    copies: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS.values(), 0))
    batches: int = 0
    conflict_flushes: int = 0
    waits: int = 0  # dependencies handed to the executor (distinct batches and S4 events)


_ID_MASK = 0x7FFFFFFF
_NONE = -1


class TransferEngine:
    """Orders and batches block copies between tiers; see the module docstring."""

    def __init__(self, space: SlotSpace, executor, *, rules: frozenset[str] = ALL_RULES,
                 tracking: str = "slot", block_id: Callable[[int], object] | None = None):
        assert rules <= ALL_RULES, f"unknown rules {set(rules) - ALL_RULES}"
        assert tracking in ("slot", "block", "local"), f"unknown tracking {tracking!r}"
        assert tracking != "block" or block_id is not None, "block tracking needs block_id"
        self.space = space
        self._b1, self._b2 = space.base[HOST], space.base[DISK]
        self.executor = executor
        self.rules = rules
        self.tracking = tracking
        self._block_id = block_id
        self._open: dict[str, _Batch] = {}
        n = max(space.total, 1)
        self._last_write = np.full(n, _NONE, dtype=np.int32)  # key -> id of the last batch writing it
        self._last_read = np.full(n, _NONE, dtype=np.int32)  # key -> id of the last batch reading it
        self._events: dict[int, object] = {}  # batch id -> event, batches in flight only
        self._keys: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # batch id -> (read, written) keys
        self._next_id = 0
        self._interned: dict[object, int] = {}  # tracking="block": block id -> key
        self._stream_last: dict[str, object] = {}
        self._compute_event = None
        self.stats = TransferStats()

    # -- keys ---------------------------------------------------------------------------
    def _key(self, slot: int, content_of: int) -> int:
        if self.tracking == "slot":
            return slot
        if self.tracking == "local":
            return self.space.local(slot)
        ident = self._block_id(content_of)
        key = self._interned.get(ident)
        if key is None:
            key = self._interned[ident] = len(self._interned)
            if key >= len(self._last_write):
                grow = np.full(len(self._last_write), _NONE, dtype=np.int32)
                self._last_write = np.concatenate((self._last_write, grow))
                self._last_read = np.concatenate((self._last_read, grow))
        return key

    # -- submission -----------------------------------------------------------------------
    def copy(self, src: int, dst: int) -> None:
        """Queue a copy of the block in global slot ``src`` into global slot ``dst``."""
        # The per-block hot path: tier by comparison, no calls when tracking by slot.
        b1, b2 = self._b1, self._b2
        direction = _DIRECTION_OF[(src >= b1) + (src >= b2)][(dst >= b1) + (dst >= b2)]
        assert direction is not None and dst < self.space.total, f"no copy from slot {src} to slot {dst}"
        if self.tracking == "slot":
            ks, kd = src, dst
        else:
            ks, kd = self._key(src, src), self._key(dst, src)
        if "S2" in self.rules and self._open:
            for b in [b for b in self._open.values()
                      if ks in b.writes or kd in b.writes or kd in b.reads]:
                self.stats.conflict_flushes += 1
                self._flush(b.direction)
        b = self._open.get(direction)
        if b is None:
            b = self._open[direction] = _Batch(direction)
        b.src.append(src)
        b.dst.append(dst)
        if self.tracking != "slot":
            b.rkeys.append(ks)
            b.wkeys.append(kd)
        b.reads.add(ks)
        b.writes.add(kd)

    def copy_many(self, src, dst) -> None:
        """Queue ``src[i] -> dst[i]`` for all i (global slots, one direction), exactly as
        ``copy`` would one by one, at a small fraction of its per-block cost when the
        copies are free of hazards among themselves (the usual case)."""
        s = np.asarray(src, dtype=np.int64)
        d = np.asarray(dst, dtype=np.int64)
        assert s.shape == d.shape and s.ndim == 1, "src and dst must be 1-D and of one length"
        if len(s) == 0:
            return
        sl, dl = s.tolist(), d.tolist()
        tiers = np.searchsorted(np.asarray(self.space.base[1:]), s, side="right"), \
            np.searchsorted(np.asarray(self.space.base[1:]), d, side="right")
        uniform = (tiers[0] == tiers[0][0]).all() and (tiers[1] == tiers[1][0]).all()
        if (self.tracking != "slot" or not uniform or len(set(dl)) < len(dl)
                or not set(sl).isdisjoint(dl)):
            for a, b in zip(sl, dl):  # mixed directions or hazards inside: one by one
                self.copy(a, b)
            return
        direction = _DIRECTION_OF[int(tiers[0][0])][int(tiers[1][0])]
        assert direction is not None and int(d.max()) < self.space.total and int(s.min()) >= 0, \
            f"no copy from slot {sl[0]} to slot {dl[0]}"
        if "S2" in self.rules and self._open:
            touched = set(sl)
            touched.update(dl)
            for b in [b for b in self._open.values()
                      if not b.writes.isdisjoint(touched) or not b.reads.isdisjoint(dl)]:
                self.stats.conflict_flushes += 1
                self._flush(b.direction)
        b = self._open.get(direction)
        if b is None:
            b = self._open[direction] = _Batch(direction)
        b.src.extend(sl)
        b.dst.extend(dl)
        b.reads.update(sl)
        b.writes.update(dl)

    def _flush(self, direction: str) -> None:
        b = self._open.pop(direction)
        rk = np.array(b.src if self.tracking == "slot" else b.rkeys, dtype=np.int64)
        wk = np.array(b.dst if self.tracking == "slot" else b.wkeys, dtype=np.int64)
        self.stats.copies[direction] += len(b.src)
        deps: list = []
        if "S2" in self.rules and self._events:
            # Writes wait for the last write and the reads since; reads for the last
            # write; and a read for an earlier pending read (keeps one read entry exact).
            lw, lr = self._last_write, self._last_read
            ids = np.unique(np.concatenate((lw[rk], lw[wk], lr[wk], lr[rk])))
            events = self._events
            deps = [events[i] for i in ids.tolist() if i in events]
        if "S4" in self.rules and self._compute_event is not None:
            deps.append(self._compute_event)
        self.stats.waits += len(deps)
        base_s = self.space.base[self.space.tier_of(b.src[0])]
        base_d = self.space.base[self.space.tier_of(b.dst[0])]
        stream = STREAM_OF[direction]
        src_local = (np.array(b.src, dtype=np.int64) - base_s).tolist() if base_s else b.src
        dst_local = (np.array(b.dst, dtype=np.int64) - base_d).tolist() if base_d else b.dst
        ev = self.executor.submit(stream, direction, src_local, dst_local, deps)
        bid = self._next_id
        self._next_id = (bid + 1) & _ID_MASK
        self._events[bid] = ev
        self._keys[bid] = (rk, wk)
        self._last_read[rk] = bid
        self._last_write[wk] = bid
        self._last_read[wk] = _NONE  # this batch waited for those reads: it stands for them now
        self._stream_last[stream] = ev
        self.stats.batches += 1

    def flush(self) -> None:
        """Submit every open batch (they are mutually independent by construction)."""
        for direction in list(self._open):
            self._flush(direction)

    # -- step barriers ----------------------------------------------------------------------
    def begin_step(self) -> None:
        """S4: copies queued from now on wait for the compute stream's work so far."""
        self.flush()
        self._prune()
        self._compute_event = self.executor.record_compute() if "S4" in self.rules else None

    def before_compute(self) -> None:
        """S5: submit every queued copy; the compute stream waits for all of them."""
        self.flush()
        if "S5" in self.rules and self._stream_last:
            self.executor.compute_wait(list(self._stream_last.values()))

    def synchronize(self) -> None:
        """The host waits until every queued copy has run."""
        self.flush()
        self.executor.synchronize()
        self._events.clear()
        self._keys.clear()
        self._stream_last.clear()

    def last_event(self, stream: str):
        """The event of the last batch submitted on ``stream`` ("offload", "onboard",
        "disk"), None once it is known complete."""
        return self._stream_last.get(stream)

    def pending_slots(self) -> int:
        """Keys with a copy possibly still in flight (bounded by blocks in motion)."""
        if not self._keys:
            return 0
        return len(np.unique(np.concatenate([k for pair in self._keys.values() for k in pair])))

    @property
    def nbytes(self) -> int:
        """Per-slot tracking memory (8 bytes a slot), for metadata accounting."""
        return self._last_write.nbytes + self._last_read.nbytes

    def in_flight_batches(self) -> int:
        return len(self._events)

    def _prune(self) -> None:
        """Forget completed batches: one completion query per batch in flight. Their
        ids stay in the per-key arrays and match no event from now on."""
        done = self.executor.is_done
        for bid in [bid for bid, ev in self._events.items() if done(ev)]:
            del self._events[bid]
            del self._keys[bid]
        for k in [k for k, e in self._stream_last.items() if done(e)]:
            del self._stream_last[k]
