"""The transfer engine: turns a stream of single-block copies into ordered batches.

Rules enforced here (docs/design.md, "Synchronization rules"):

* S1 — pending copies are tracked per *physical slot*, in the global slot space where
  slot 0 of one tier never aliases slot 0 of another. (``EngineSeams.tracking``
  "block" keys them by the block's identity and "local" by tier-local index instead;
  both are the bugs S1 forbids, kept so the tests can show that they corrupt.)
* S2 — a copy into slot D waits for every pending read of D and the pending write to
  D; a copy out of S waits for the pending write to S. Inside one batch copies have no
  order (a batched DMA or gather kernel runs them in parallel), so a copy that would
  conflict with the open batch closes that batch first.
* S4 — a copy that touches a GPU slot the kernels of a step not known complete used
  (the rows of its block tables, ``compute_uses``) waits for the compute stream as it
  was at ``begin_step``; other copies (free GPU slots, host and disk slots) do not, so
  a scheduler running a step ahead moves blocks while the last step's kernels run.
* S5 — ``before_compute`` submits everything and makes compute wait for every copy
  touching the GPU tier (copies between host and disk, a prefetch's, are not its); with
  batches copied by layer group (``layered``), compute instead waits before it reads
  each layer (``before_layer``) for the groups holding that layer.

The engine never touches memory: an executor does the copies and owns the streams
and events. Per-slot state is four int32 arrays indexed by tracking key (16 bytes a
slot): the id of the last batch that wrote the slot and of the last that read it, and
the mark of the open (not yet submitted) batch touching it, which finds conflicts
with open batches without Python sets; and the step whose kernels used the slot last
(S4, 4 more bytes). Events live only for batches in flight (a dict
id -> event), so a stale id simply matches nothing, and the Python work per step is a
few numpy operations per batch (``copy_many``) plus a small constant per single
``copy``, independent of how many blocks exist.

One read entry per slot is exact because a batch that reads a slot with a pending
read from another batch is made to wait for that batch too (reads rarely repeat
before a write; the cost is an occasional extra wait, never a missing one). Ids wrap
at 2**31 (no batch stays in flight that long): a stale id that matches a newer batch
only adds a spurious wait."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from ..blocks import DISK, GPU, SlotSpace
from .contract import Event, Executor
from .routes import Route

__all__ = ["ALL_RULES", "EngineSeams", "TransferEngine", "TransferStats"]

ALL_RULES = frozenset({"S2", "S4", "S5"})


@dataclass(frozen=True, slots=True)
class EngineSeams:
    """The engine's test seams (``kvdist.seams.Seams`` hands them over at construction):
    every cache runs with the defaults; tests switch a rule off to show what it prevents."""

    rules: frozenset[str] = ALL_RULES  # the rules enforced, of S2, S4, S5
    tracking: str = "slot"  # S1: "slot"; "block" and "local" are the bugs S1 forbids
    copy_many_sizes: list[int] | None = None  # tests: the length of every copy_many call

    def __post_init__(self) -> None:
        assert self.rules <= ALL_RULES, f"unknown rules {set(self.rules) - ALL_RULES}"
        assert self.tracking in ("slot", "block", "local"), f"unknown tracking {self.tracking!r}"


@dataclass(slots=True)
class _Batch:
    """An open batch: copies of one route not submitted yet. Single copies are in
    ``src``/``dst``, ``copy_many`` calls add whole arrays to ``parts``; order inside a
    batch does not matter."""

    route: Route
    token: int  # marks the slots this batch touches (see TransferEngine._mark)
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    parts: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    in_parts: int = 0  # copies in ``parts``
    rkeys: list[int] = field(default_factory=list)  # tracking key read, per copy (tracking != "slot")
    wkeys: list[int] = field(default_factory=list)  # tracking key written, per copy

    @property
    def size(self) -> int:
        return len(self.src) + self.in_parts

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        srcs = [p[0] for p in self.parts] + [np.array(self.src, dtype=np.int64)]
        dsts = [p[1] for p in self.parts] + [np.array(self.dst, dtype=np.int64)]
        return np.concatenate(srcs), np.concatenate(dsts)


@dataclass(slots=True)
class TransferStats:
    batches: int = 0
    conflict_flushes: int = 0
    waits: int = 0  # dependencies handed to the executor (distinct batches and S4 events)


def _distinct(a: np.ndarray) -> np.ndarray:
    """The distinct values of ``a`` (sorted): sort-based, faster than np.unique's
    hashing for a few thousand mostly repeated ids."""
    if len(a) <= 1:
        return a
    a = np.sort(a)
    return a[np.concatenate(([True], a[1:] != a[:-1]))]


def _hazards_inside(s: np.ndarray, d: np.ndarray) -> bool:
    """Whether copies ``s[i] -> d[i]`` conflict among themselves: two into one slot,
    or one reading a slot another writes."""
    ds = np.sort(d)
    if (ds[1:] == ds[:-1]).any():
        return True
    at = np.minimum(np.searchsorted(ds, s), len(ds) - 1)
    return bool((ds[at] == s).any())


_ID_MASK = 0x7FFFFFFF
_NONE = -1


class TransferEngine:
    """Orders and batches block copies between tiers; see the module docstring."""

    def __init__(self, space: SlotSpace, executor: Executor, *, seams: EngineSeams = EngineSeams(),
                 block_id: Callable[[int], object] | None = None,
                 batch_limits: dict[Route, int] | None = None):
        assert seams.tracking != "block" or block_id is not None, "block tracking needs block_id"
        self.space = space
        # [lo, hi) of each tier's global slots
        self._bounds = tuple((b, b + c) for b, c in zip(space.base, space.capacity))
        self.executor = executor
        self.rules = seams.rules
        self.tracking = seams.tracking
        self._copy_many_sizes = seams.copy_many_sizes
        self._block_id = block_id
        self._open: dict[Route, _Batch] = {}
        # route -> copies: a batch of that route is submitted once it holds that many (a
        # later copy into one of its slots waits for the whole batch; a disk batch through a
        # bounce buffer holds that buffer until it is done).
        self.batch_limits = dict(batch_limits or {})
        assert all(n > 0 for n in self.batch_limits.values()), f"batch limits {batch_limits}"
        n = max(space.total, 1)
        self._last_write = np.full(n, _NONE, dtype=np.int32)  # key -> id of the last batch writing it
        self._last_read = np.full(n, _NONE, dtype=np.int32)  # key -> id of the last batch reading it
        # key -> (token << 1 | wrote) of the open batch that touched it last. A mark is
        # live while its token belongs to an open batch; stale marks are never cleared.
        # A key is touched by at most one open batch (a second batch touching it, even
        # to read, first flushes the other), so one mark per key is exact.
        self._mark = np.full(n, _NONE, dtype=np.int32)
        self._by_token: dict[int, _Batch] = {}  # open batches by token
        self._next_token = 0
        self._events: dict[int, object] = {}  # batch id -> event, batches in flight only
        self._next_id = 0
        self._interned: dict[object, int] = {}  # tracking="block": block id -> key
        self._stream_last: dict[str, Event] = {}
        # S4: key -> the step whose block tables held the slot last; the compute stream's
        # event at each begin_step not known complete; kernels of steps up to
        # _compute_done are complete.
        self._compute_mark = np.full(n, _NONE, dtype=np.int32)
        self._step = 0
        self._compute_events: deque[tuple[int, Event]] = deque()
        self._compute_done = _NONE
        self._compute_event = None
        self._layered = False  # the last before_compute left S5 to before_layer
        self._collect: tuple[Route, list[Event]] | None = None  # see ``collecting``
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
                self._mark = np.concatenate((self._mark, grow))
                self._compute_mark = np.concatenate((self._compute_mark, grow))
        return key

    # -- submission -----------------------------------------------------------------------
    def copy(self, route: Route, src: int, dst: int) -> None:
        """Queue a copy of the block in global slot ``src`` into global slot ``dst``
        along ``route`` (``src`` in its source tier, ``dst`` in its destination tier)."""
        # The per-block hot path: no calls when tracking by slot and no batch is open.
        lo, hi = self._bounds[route.src]
        assert lo <= src < hi, f"{route} copies from slot {src}, outside {lo}..{hi - 1}"
        lo, hi = self._bounds[route.dst]
        assert lo <= dst < hi, f"{route} copies into slot {dst}, outside {lo}..{hi - 1}"
        if self.tracking == "slot":
            ks, kd = src, dst
        else:
            ks, kd = self._key(src, src), self._key(dst, src)
        mark = self._mark
        if "S2" in self.rules and self._by_token:
            self._flush_conflicting(route, (int(mark[ks]), int(mark[kd])))
        b = self._open.get(route) or self._open_batch(route)
        b.src.append(src)
        b.dst.append(dst)
        if self.tracking != "slot":
            b.rkeys.append(ks)
            b.wkeys.append(kd)
        tok = b.token << 1
        mark[ks] = tok
        mark[kd] = tok | 1
        limit = self.batch_limits.get(route)
        if limit is not None and b.size >= limit:
            self._flush(route)

    def copy_many(self, route: Route, src, dst) -> None:
        """Queue ``src[i] -> dst[i]`` for all i (global slots) along ``route``, exactly as
        ``copy`` would one by one, at a small fraction of its per-block cost when the
        copies are free of hazards among themselves (the usual case): numpy work on
        the per-slot marks, no Python work per copy."""
        s = np.asarray(src, dtype=np.int64)
        d = np.asarray(dst, dtype=np.int64)
        assert s.shape == d.shape and s.ndim == 1, "src and dst must be 1-D and of one length"
        if self._copy_many_sizes is not None:
            self._copy_many_sizes.append(len(s))
        if len(s) == 0:
            return
        (slo, shi), (dlo, dhi) = self._bounds[route.src], self._bounds[route.dst]
        assert slo <= int(s.min()) and int(s.max()) < shi and dlo <= int(d.min()) and int(d.max()) < dhi, \
            f"{route} copies slots outside its tiers"
        if self.tracking != "slot" or _hazards_inside(s, d):
            for a, b in zip(s.tolist(), d.tolist()):  # hazards inside: one by one
                self.copy(route, a, b)
            return
        n = self.batch_limits.get(route)
        if n is None:
            self._add_part(route, s, d)
            return
        for i in range(0, len(s), n):
            if self._add_part(route, s[i:i + n], d[i:i + n]).size >= n:
                self._flush(route)

    def _add_part(self, route: Route, s: np.ndarray, d: np.ndarray) -> _Batch:
        """``copy_many``'s copies, free of hazards among themselves, into the open batch
        of ``route`` (returned)."""
        mark = self._mark
        if "S2" in self.rules and self._by_token:
            m = np.concatenate((mark[s], mark[d]))
            self._flush_conflicting(route, _distinct(m[m >= 0]).tolist())
        b = self._open.get(route) or self._open_batch(route)
        b.parts.append((s, d))
        b.in_parts += len(s)
        tok = b.token << 1
        mark[s] = tok
        mark[d] = tok | 1
        return b

    def _flush_conflicting(self, route: Route, marks: Iterable[int]) -> None:
        """S2 across batches: before a copy along ``route`` touches keys with these
        marks, submit each open batch that wrote one of them, or that belongs to another
        route (it read them). A batch of this route never reads the tier it writes, so
        its read marks are the only harmless ones."""
        for m in marks:
            if m >= 0:
                b = self._by_token.get(m >> 1)
                if b is not None and (m & 1 or b.route is not route):
                    self.stats.conflict_flushes += 1
                    self._flush(b.route)

    def _open_batch(self, route: Route) -> _Batch:
        b = _Batch(route, self._next_token)
        self._next_token = (self._next_token + 1) & (_ID_MASK >> 1)  # token << 1 stays an int32
        self._open[route] = self._by_token[b.token] = b
        return b

    def _flush(self, route: Route) -> None:
        b = self._open.pop(route)
        del self._by_token[b.token]
        src, dst = b.arrays()
        rk = src if self.tracking == "slot" else np.array(b.rkeys, dtype=np.int64)
        wk = dst if self.tracking == "slot" else np.array(b.wkeys, dtype=np.int64)
        deps: list = []
        if "S2" in self.rules and self._events:
            # Writes wait for the last write and the reads since; reads for the last
            # write; and a read for an earlier pending read (keeps one read entry exact).
            lw, lr = self._last_write, self._last_read
            ids = _distinct(np.concatenate((lw[rk], lw[wk], lr[wk], lr[rk])))
            events = self._events
            deps = [events[i] for i in ids.tolist() if i in events]
        if "S4" in self.rules and self._compute_event is not None and self._kernels_pending(rk, wk):
            deps.append(self._compute_event)
        self.stats.waits += len(deps)
        base_s, base_d = self.space.base[route.src], self.space.base[route.dst]
        ev = self.executor.submit(route, src - base_s if base_s else src,
                                  dst - base_d if base_d else dst, deps)
        bid = self._next_id
        self._next_id = (bid + 1) & _ID_MASK
        self._events[bid] = ev
        self._last_read[rk] = bid
        self._last_write[wk] = bid
        self._last_read[wk] = _NONE  # this batch waited for those reads: it stands for them now
        if route.src == GPU or route.dst == GPU:  # S5: compute waits for these alone
            self._stream_last[route.stream] = ev
        self.stats.batches += 1
        if self._collect is not None and self._collect[0] is route:
            self._collect[1].append(ev)

    @contextmanager
    def collecting(self, route: Route) -> Iterator[list[Event]]:
        """The events of the batches along ``route`` submitted inside the ``with``
        block; on leaving it the open batch of ``route`` is submitted too, so the list
        covers every copy queued along it by then (a prefetch's promotions: what its
        admission would wait for)."""
        assert self._collect is None, "collecting already"
        got: list[Event] = []
        self._collect = (route, got)
        try:
            yield got
            if route in self._open:
                self._flush(route)
        finally:
            self._collect = None

    def flush(self) -> None:
        """Submit every open batch (they are mutually independent by construction)."""
        for route in list(self._open):
            self._flush(route)

    # -- step barriers ----------------------------------------------------------------------
    def begin_step(self) -> None:
        """S4: copies queued from now on that touch a slot the kernels of an unfinished
        step use wait for the compute stream's work so far."""
        self.flush()
        self._prune()
        self._step = (self._step + 1) & _ID_MASK
        self._compute_event = None
        if "S4" in self.rules:
            self._compute_event = ev = self.executor.record_compute()
            self._compute_events.append((self._step, ev))

    def compute_uses(self, gpu_slots: np.ndarray) -> None:
        """The kernels of this step read and write these GPU slots (tier-local indices,
        a block table's rows; -1 is padding): a copy touching one waits for them (S4)."""
        slots = np.asarray(gpu_slots).ravel()
        self._compute_mark[self.space.base[0] + slots[slots >= 0]] = self._step

    def _kernels_pending(self, rk: np.ndarray, wk: np.ndarray) -> bool:
        """Whether a batch reading keys ``rk`` and writing ``wk`` touches a slot that
        kernels not known complete use (keys other than slots: assume so)."""
        if self.tracking != "slot":
            return True
        marks = self._compute_mark
        return bool(max(marks[rk].max(initial=_NONE), marks[wk].max(initial=_NONE)) > self._compute_done)

    def before_compute(self, layered: bool = False) -> None:
        """S5: submit every queued copy; the compute stream waits for all of them that
        touch the GPU tier, now or (``layered``) layer by layer, in ``before_layer``."""
        self.flush()
        self._layered = layered
        if "S5" not in self.rules:
            return
        # The last batch of each stream stands for the earlier ones (streams are FIFO).
        if layered:
            self.executor.compute_wait(list(self._stream_last.values()), layered=True)
        elif self._stream_last:
            self.executor.compute_wait(list(self._stream_last.values()))

    def before_layer(self, layer: int) -> None:
        """S5 for one layer: the compute stream waits for the layer groups holding
        ``layer`` of the copies submitted at the last ``before_compute(layered=True)``."""
        if self._layered and "S5" in self.rules:
            self.executor.wait_layer(layer)

    def synchronize(self) -> None:
        """The host waits until every queued copy has run."""
        self.flush()
        self.executor.synchronize()
        self._events.clear()
        self._stream_last.clear()

    def pending_events(self, slots) -> list:
        """The events of every queued or in-flight batch that reads or writes one of the
        global ``slots`` (open batches touching them are submitted first), and the S4
        compute event when a GPU slot is among them: what a copy into those slots made
        outside the engine (a remote fetch) must follow (S2, S4)."""
        keys = np.asarray(slots, dtype=np.int64)
        if len(keys) == 0:
            return []
        if self._by_token:
            m = self._mark[keys]
            for tok in _distinct(m[m >= 0] >> 1).tolist():
                b = self._by_token.get(tok)
                if b is not None:
                    self._flush(b.route)
        ids = _distinct(np.concatenate((self._last_write[keys], self._last_read[keys])))
        out = [self._events[i] for i in ids.tolist() if i in self._events]
        if self._compute_event is not None and self._kernels_pending(keys, keys[:0]):
            out.append(self._compute_event)  # an unfinished step's kernels use one of them
        return out

    def writes_pending(self, slots) -> np.ndarray:
        """Per global slot: whether a copy into it is queued or not known complete (the
        remote tier stamps a host slot's block valid only once this is False)."""
        keys = np.asarray(slots, dtype=np.int64)
        m = self._mark[keys]
        out = (m >= 0) & (m & 1 == 1)  # written by a batch that may still be open
        if out.any():  # by an open batch: few, compared without np.isin's overhead
            out &= (m[:, None] >> 1 == np.fromiter(self._by_token, dtype=np.int64)).any(axis=1)
        if self._events:
            done = self.executor.is_done
            out |= self._batches_where(self._last_write[keys], lambda ev: not done(ev))
        return out

    def disk_pending(self, slots) -> np.ndarray:
        """Per global slot: whether disk work still reads or writes it, so that a copy into
        it queued now would make the host wait (``Executor.holds_host``): a host slot a
        demotion is still writing to disk, or will once its open batch is submitted."""
        keys = np.asarray(slots, dtype=np.int64)
        out = np.zeros(len(keys), dtype=bool)
        if len(keys) == 0:
            return out
        if self._by_token:  # open disk batches touching them
            disk = [tok for tok, b in self._by_token.items() if DISK in (b.route.src, b.route.dst)]
            if disk:
                m = self._mark[keys]
                out |= (m >= 0) & np.isin(m >> 1, disk)
        if self._events:
            held = self.executor.holds_host
            out |= self._batches_where(self._last_read[keys], held)
            out |= self._batches_where(self._last_write[keys], held)
        return out

    def _batches_where(self, ids: np.ndarray, test: Callable[[Event], bool]) -> np.ndarray:
        """Per entry of ``ids`` (batch ids of a slot's last read or write): whether that
        batch is in flight and ``test`` holds for its event."""
        busy = [bid for bid in _distinct(ids).tolist()
                if (ev := self._events.get(bid)) is not None and test(ev)]
        return np.isin(ids, busy) if busy else np.zeros(len(ids), dtype=bool)

    @property
    def nbytes(self) -> int:
        """Per-slot tracking memory (16 bytes a slot), for metadata accounting."""
        arrays = (self._last_write, self._last_read, self._mark, self._compute_mark)
        return sum(a.nbytes for a in arrays)

    def check_invariants(self) -> None:
        """Every key an open batch touches carries that batch's live mark, read or
        written as the batch does; no key is touched by two open batches."""
        assert len(self._by_token) == len(self._open) and all(
            self._by_token.get(b.token) is b for b in self._open.values()), "open batches out of sync"
        seen: dict[int, int] = {}
        for b in self._open.values():
            src, dst = b.arrays()
            rk = src if self.tracking == "slot" else np.array(b.rkeys, dtype=np.int64)
            wk = dst if self.tracking == "slot" else np.array(b.wkeys, dtype=np.int64)
            assert not np.isin(rk, wk).any() or "S2" not in self.rules, \
                f"open {b.route.name} batch reads and writes one key"
            for keys, wrote in ((rk, 0), (wk, 1)):
                for k in keys.tolist():
                    if "S2" in self.rules:
                        assert seen.get(k, b.token) == b.token, f"key {k} touched by two open batches"
                        assert self._mark[k] == (b.token << 1 | wrote), \
                            f"key {k} of the open {b.route.name} batch has mark {self._mark[k]}"
                    seen[k] = b.token

    def _prune(self) -> None:
        """Forget completed batches: one completion query per batch in flight. Their
        ids stay in the per-key arrays and match no event from now on."""
        done = self.executor.is_done
        for bid in [bid for bid, ev in self._events.items() if done(ev)]:
            del self._events[bid]
        # The compute stream is FIFO: its event at step k's begin_step done = the
        # kernels of every step before k complete.
        while self._compute_events and done(self._compute_events[0][1]):
            self._compute_done = self._compute_events.popleft()[0] - 1
        for k in [k for k, e in self._stream_last.items() if done(e)]:
            del self._stream_last[k]
