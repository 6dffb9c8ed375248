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
and events. Per-slot state is a dict of the slots with copies in flight, pruned
each step, so its size follows the blocks in motion, not the blocks that exist."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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
    keys: list[tuple[object, object]] = field(default_factory=list)  # tracking keys per copy
    reads: set[object] = field(default_factory=set)
    writes: set[object] = field(default_factory=set)


@dataclass(slots=True)
class TransferStats:
    copies: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS.values(), 0))
    batches: int = 0
    conflict_flushes: int = 0


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
        self._writes: dict[object, object] = {}  # key -> event of the pending write
        self._reads: dict[object, list] = {}  # key -> events of pending reads since that write
        self._stream_last: dict[str, object] = {}
        self._inflight: list[tuple[object, list[tuple[object, object]]]] = []  # (event, keys) per batch
        self._compute_event = None
        self.stats = TransferStats()

    # -- keys ---------------------------------------------------------------------------
    def _key(self, slot: int, content_of: int) -> object:
        if self.tracking == "slot":
            return slot
        if self.tracking == "local":
            return self.space.local(slot)
        return self._block_id(content_of)

    # -- submission -----------------------------------------------------------------------
    def copy(self, src: int, dst: int) -> None:
        """Queue a copy of the block in global slot ``src`` into global slot ``dst``."""
        # The per-block hot path: tier by comparison, no calls when tracking by slot.
        b1, b2 = self._b1, self._b2
        direction = _DIRECTION_OF[(src >= b1) + (src >= b2)][(dst >= b1) + (dst >= b2)]
        assert direction is not None and 0 <= src < self.space.total and 0 <= dst < self.space.total, \
            f"no copy from slot {src} to slot {dst}"
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
        b.keys.append((ks, kd))
        b.reads.add(ks)
        b.writes.add(kd)
        self.stats.copies[direction] += 1

    def _flush(self, direction: str) -> None:
        b = self._open.pop(direction)
        deps: list = []
        if "S2" in self.rules:
            for ks, kd in b.keys:
                for ev in (self._writes.get(ks), self._writes.get(kd)):
                    if ev is not None:
                        deps.append(ev)
                deps.extend(self._reads.get(kd, ()))
        if "S4" in self.rules and self._compute_event is not None:
            deps.append(self._compute_event)
        unique = list({id(e): e for e in deps}.values())
        base_s = self.space.base[self.space.tier_of(b.src[0])]
        base_d = self.space.base[self.space.tier_of(b.dst[0])]
        stream = STREAM_OF[direction]
        ev = self.executor.submit(stream, direction, [s - base_s for s in b.src],
                                  [d - base_d for d in b.dst], unique)
        reads, writes = self._reads, self._writes
        for ks, kd in b.keys:
            r = reads.get(ks)
            if r is None:
                reads[ks] = [ev]
            else:
                r.append(ev)
            writes[kd] = ev
            reads.pop(kd, None)
        self._inflight.append((ev, b.keys))
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
        self._writes.clear()
        self._reads.clear()
        self._stream_last.clear()
        self._inflight.clear()

    def last_event(self, stream: str):
        """The event of the last batch submitted on ``stream`` ("offload", "onboard",
        "disk"), None once it is known complete."""
        return self._stream_last.get(stream)

    def pending_slots(self) -> int:
        """Slots with a copy possibly still in flight (bounded by blocks in motion)."""
        return len(self._writes.keys() | self._reads.keys())

    def _prune(self) -> None:
        """Forget the pending marks of completed batches: one completion query per
        batch, then work proportional to the copies that completed."""
        done = self.executor.is_done
        reads, writes = self._reads, self._writes
        running = []
        for ev, keys in self._inflight:
            if not done(ev):
                running.append((ev, keys))
                continue
            for ks, kd in keys:
                if writes.get(kd) is ev:
                    del writes[kd]
                r = reads.get(ks)
                if r is not None:
                    left = [e for e in r if e is not ev]
                    if left:
                        reads[ks] = left
                    else:
                        del reads[ks]
        self._inflight = running
        for k in [k for k, e in self._stream_last.items() if done(e)]:
            del self._stream_last[k]
